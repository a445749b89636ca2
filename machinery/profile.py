"""--profile N: a torch.profiler trace of N optimizer steps after a warm-up, written into the run folder as
Chrome/Perfetto JSON (profile.json: open it in https://ui.perfetto.dev or chrome://tracing), and the top
operators by time printed. Driven by the optimizer's own step hook: the loop is not touched. Rank 0 only.
A resume traces only where --profile is given again (train.py's profiled)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from configs import UserError
from machinery.files import reporting_write_errors, write_bytes_atomic
from machinery.processes import say

WARMUP = 5  # optimizer steps before recording: the first pay for allocation, cuDNN's autotuning, compiling
MOST_STEPS = 20  # the file's bound: a step of the default model is about 0.4 MB of trace (docs/training.md)
TOP_ROWS = 10  # operators in the printed table
TRACE = "profile.json"


def record_steps(optimizer: torch.optim.Optimizer, steps: int, out_dir: Path, *, device: torch.device,
                 steps_left: int, rank: int = 0, restart: bool = False):
    """Profile optimizer steps WARMUP + 1 to WARMUP + `steps` of this run (`steps_left`: the steps it has
    still to take), from the optimizer's step hook, in the context returned; refused in one line where they
    do not fit, or skipped in one in a `restart` (--resume auto's, whose command line cannot change)."""
    if steps > MOST_STEPS:
        raise UserError(f"--profile {steps}: at most {MOST_STEPS} steps are recorded, which keeps the trace "
                        "file small; profile fewer")
    if WARMUP + steps > steps_left:
        why = (f"--profile {steps} records steps {WARMUP + 1} to {WARMUP + steps}, after a warm-up of "
               f"{WARMUP}, and this run has {steps_left} left")
        if not restart:
            raise UserError(f"{why}: profile fewer, or train longer")
        say(f"{why}: not traced in this restart")
    elif rank == 0:
        return StepProfile(optimizer, steps, out_dir / TRACE, device)
    return contextlib.nullcontext()


class StepProfile(contextlib.AbstractContextManager):
    """Counts the optimizer's steps: starts torch.profiler after WARMUP, stops after `steps` more, then writes
    the trace, prints the table and takes its hook away; at the block's end, does so for a window the run
    ended inside."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int, path: Path, device: torch.device):
        self.steps, self.path, self.device, self.taken = steps, path, device, 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        # No shapes, stacks or memory: each would add to every event of the trace
        self.profiler = profile(activities=activities, record_shapes=False, with_stack=False,
                                profile_memory=False)
        self.hook = optimizer.register_step_post_hook(self.stepped)

    def stepped(self, *_) -> None:
        self.taken += 1
        if self.taken == WARMUP:
            self.profiler.start()
        elif self.taken == WARMUP + self.steps:
            self.profiler.stop()
            self.hook.remove()
            self.report()

    def __exit__(self, *_) -> None:
        """The run ended inside the window (an early stop, a signal, a crash, AMP's skipped steps): the
        profiler, the process's, stopped, and what it recorded written, or a line that nothing was."""
        if self.taken >= WARMUP + self.steps:
            return
        self.hook.remove()
        if self.taken >= WARMUP:
            self.profiler.stop()
        if self.taken > WARMUP:
            self.report()
        else:
            say(f"--profile {self.steps}: the run ended after {self.taken} optimizer steps, before step "
                f"{WARMUP + 1}: nothing traced")

    def report(self) -> None:
        """The trace into the run folder, and the operators that took the most time."""
        self.write()
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=by, row_limit=TOP_ROWS)
        size = self.path.stat().st_size / 1e6
        cut = "" if self.taken == WARMUP + self.steps else f" (of {self.steps} asked: the run ended)"
        say(f"--profile: optimizer steps {WARMUP + 1} to {self.taken} traced{cut} into {self.path} "
            f"({size:.1f} MB); the top {TOP_ROWS} operators by {by}:", table)

    def write(self) -> None:
        """The exporter writes in place: into a temporary file beside the trace, then written whole
        (files.py), so that a kill during the export leaves no truncated profile.json."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with reporting_write_errors(self.path):
                self.profiler.export_chrome_trace(str(tmp))
                trace = tmp.read_bytes()  # kineto says a failed write in a line of its own, and goes on
        finally:
            tmp.unlink(missing_ok=True)
        write_bytes_atomic(self.path, trace)
