"""Where the run's processes work and how they agree: the device, torchrun's process group and its
collectives, the one process that owns a run folder, and the signals that stop a run.

Under torchrun every process runs train.py; rank 0 alone prints, logs and saves, and decisions
that only rank 0 can make (its files, a signal it received) reach the others by a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from configs import UserError, first_line

# ---------------------------------------------------------------- the device


def pick_device(name: str = "auto") -> torch.device:
    """cuda > mps > cpu unless forced; under torchrun each process takes its LOCAL_RANK's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # refused just below
    backend = getattr(torch, device.type, None) if device.type in ("mps", "xpu") else None
    if device.type not in ("cpu", "cuda", "mps", "xpu") or (backend and not backend.is_available()):
        there = f"{name} is not on this machine" if backend else f"{name!r} is not a device to train on"
        raise UserError(f"--device {there}; use auto, cpu, cuda, cuda:N, mps or xpu") from None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda" and device.index is not None and world_size > 1:
        raise UserError(f"--device {name} would put all {world_size} torchrun processes on one GPU; "
                        "use --device cuda (each process takes its LOCAL_RANK's GPU)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device cuda was asked for but no CUDA GPU is visible; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    return device


# ---------------------------------------------------------------- torchrun


def setup(device_name: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun: one process per GPU (nccl), or gloo on CPU."""
    device = pick_device(device_name)
    if "RANK" not in os.environ:
        return 0, 1, device
    watch_parent()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world_size))
    # Keys of this attempt's own: torchrun's restarts may keep its store, where a dead process's address
    # would otherwise be found first (gloo then connects to it, and fails or hangs).
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size)
    return rank, world_size, device


def watch_parent() -> None:
    """Under torchrun: should the agent that started this process die (a kill -9 of torchrun), this
    process gets the SIGTERM the agent would have sent, so it saves and stops at its next log point,
    as the others do, instead of training on unwatched (and writing into a folder a new job may use)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="torchrun-agent-watch", daemon=True).start()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: rank 0 alone prints, logs and saves. Before the process group starts (a
    failure at start-up), torchrun's RANK says."""
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def peer_lost(err: BaseException) -> bool:
    """Whether a failed collective says another process of the run is gone (killed, or stopped by
    torchrun after another failure): NCCL's errors are torch's DistError, gloo's a closed connection."""
    return is_distributed() and (isinstance(err, dist.DistError) or "gloo/transport" in str(err))


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any, so that all of them stop at the same step."""
    if not is_distributed():
        return flag
    return all_reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0


def from_rank0(value):
    """Rank 0's value on every rank, for decisions only rank 0 can make (its files, say)."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def on_rank0(work: Callable, *args) -> None:
    """`work(*args)` on rank 0 alone (a check of its files, a write), its UserError raised on every
    rank: rank 0 decides, and one broadcast makes all ranks go on, or stop, together."""
    problem = None
    if not is_distributed():
        work(*args)
    elif rank() == 0:
        try:
            work(*args)
        except UserError as err:
            problem = str(err)
    problem = from_rank0(problem)  # on every rank: the ranks that did not run `work` wait here
    if problem:
        raise UserError(problem)


def share_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Copy rank 0's `tensors` to every rank, in place: weights that rank 0 alone read from a file, or
    BatchNorm statistics, which DDP broadcasts at the start of each forward, so that after the last one
    every rank holds statistics updated by its own shard (shared before evaluation and saving)."""
    if is_distributed():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def ranks_agree(module: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters and buffers (a DDP sanity check)."""
    if not is_distributed():
        return True
    flat = torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return not any_rank(not torch.equal(flat, reference), flat.device)


def cleanup() -> None:
    """Leave the process group, then pause a moment before the process exits. Gloo's worker threads
    let go of a finished collective's tensors just after the caller's wait returns, and need the GIL
    to free one that Python created; a process that is already exiting then aborts with "terminate
    called without an active exception" (seen at exit of torchrun runs, error paths included)."""
    if is_distributed():
        dist.destroy_process_group()
        time.sleep(0.1)  # the GIL is free: the worker threads finish


# ---------------------------------------------------------------- one run per folder


def lock_out_dir(out_dir: Path) -> None:
    """out_dir/.lock for this process, released (with the folders made for it, if empty) at its exit.
    A lock of a process that is gone (a kill -9) is taken over; one of a live run is refused."""
    path, mine = out_dir / ".lock", f"{os.getpid()} {socket.gethostname()}"
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            with open(path, "x") as f:
                f.write(mine)
            break
        except FileExistsError:
            held = path.read_text(errors="replace").split()
            if held[:2] == mine.split():
                return  # this process's own, from an earlier run in it
            pid, host = (int(held[0]), held[1]) if len(held) >= 2 and held[0].isdigit() else (0, "")
            if host == socket.gethostname() and pid and _alive(pid):
                raise UserError(f"{out_dir} is in use by another run (process {pid}); wait for it to end, "
                                "or pick another --out-dir") from None
            if host not in ("", socket.gethostname()):
                raise UserError(f"{out_dir} is in use by a run on {host} (process {pid}); if none runs "
                                f"there, delete {path}, or pick another --out-dir") from None
            path.unlink(missing_ok=True)  # the run that held it is gone
    if not _HELD:
        atexit.register(release_all)
    _HELD.append((path, mine, created))


_HELD = []  # this process's locks: (path, its text, the folders made for it)


@contextlib.contextmanager
def holding(out_dir: Path):
    """The block during which this process's run owns out_dir: its lock (claim_out_dir's) goes at the
    end, whatever ends it; release_all() lets go of the rest (train.py's main, and at exit)."""
    try:
        yield
    finally:
        release_all(out_dir / ".lock")


def release_all(only: Path | None = None) -> None:
    """Remove this process's locks (or the one at `only`), and the folders made for them while empty."""
    for path, mine, created in [h for h in _HELD if only is None or h[0] == only]:
        _HELD.remove((path, mine, created))
        with contextlib.suppress(OSError):
            if path.read_text() == mine:
                path.unlink()
            for folder in created:
                folder.rmdir()  # only while empty


def _alive(pid: int) -> bool:
    try:
        with contextlib.suppress(PermissionError):  # someone else's process: alive
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- failures said in one line


def tell_torchrun(message: str) -> None:
    """Under torchrun, the one line this process ends with, in the error file torchrun reads: its
    summary then shows the line as the root cause (after its own traceback, which it always prints)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            info = {"py_callstack": message, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": message, "extraInfo": info}}, f)


def failure_line(err: BaseException, after: str, status: int = 2) -> tuple[str, int]:
    """The one line and exit code for a signal (`after` its name: where, what is as it was, what to do)
    or a known failure of torch's (`status`); any other error raises again."""
    if isinstance(err, KeyboardInterrupt):
        signum = getattr(err, "signum", signal.SIGINT)
        return f"interrupted by {signal.Signals(signum).name}{after}", 128 + signum
    if isinstance(err, BrokenPipeError):  # stdout's reader ended (`| head`): end as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        line = ("the output was closed (its reader, such as `head`, ended): stopped, and every file written "
                "so far is whole (a train.py run continues with --resume)")
        return line, 128 + signal.SIGPIPE
    text, first = str(err).strip(), first_line(err)  # a failure torch reports at length: one line of it
    if "more than 1 value per channel" in text:
        line = (f"the model's BatchNorm gets one value per channel ({first}); use a --batch-size of 2 or "
                "more, or larger inputs (--image-size)")
    elif "shared memory" in text:  # a DataLoader worker's batch did not fit in /dev/shm (Docker's: 64 MB)
        line = (f"DataLoader workers ran out of shared memory ({text.splitlines()[-1][:120]}); use "
                "--num-workers 0, or give the container more shared memory (docker run --shm-size=2g); the "
                "checkpoints on disk are as they were")
    elif isinstance(err, MemoryError) or "out of memory" in text or "can't allocate memory" in text:
        line = f"out of memory ({first}); lower --batch-size, --image-size, --synthetic-size or --width"
    elif "without overflow" in text:
        line = (f"a setting is too large for float32 ({first}); check --lr, --weight-decay, --momentum, "
                "--div-factor and --final-div-factor")
    elif type(err).__name__ in ("BackendCompilerFailed", "InductorError", "CppCompileError"):
        line = (f"--compile failed ({first}); run without --compile (on CPU, torch.compile also needs a "
                "C++ compiler such as g++)")
    else:
        raise err
    return line, status


# ---------------------------------------------------------------- signals


class Interrupted(KeyboardInterrupt):
    """A signal that stops the process where it stands (the scripts say so in one line)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """Ctrl-C, SIGTERM (systemd, Slurm, `kill`, torchrun stopping its workers), SIGHUP (a dropped ssh
    session) and SIGUSR1 (what Slurm's --signal sends before a time limit), for the whole process. Outside
    the loop a signal raises Interrupted at once. Inside it (`deferred`), a signal only sets `received`:
    the loop saves after its step, then stops; a second one stops at once, except while a save runs
    (`holding`), which nothing interrupts."""

    NAMES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

    def __init__(self):
        self.received, self.mode, self.previous = 0, "raise", {}

    @contextlib.contextmanager
    def installed(self):
        """The handlers for the block (nested blocks share them); only the main thread can have any."""
        outermost = not self.previous and threading.current_thread() is threading.main_thread()
        if outermost:
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.NAMES}
            atexit.register(_end_workers)  # run before multiprocessing's, which would wait for them
        try:
            yield self
        finally:
            if outermost:
                for sig, handler in self.previous.items():
                    signal.signal(sig, handler)
                self.previous, self.received, self.mode = {}, 0, "raise"

    @contextlib.contextmanager
    def in_mode(self, mode: str):
        """"defer" (the loop: save, then stop) or "hold" (a save: nothing interrupts it)."""
        before, self.mode = self.mode, mode
        try:
            yield self
        finally:
            self.mode = before

    def _handle(self, signum, frame):
        first = not self.received
        self.received = self.received or signum
        if self.mode == "hold" or (self.mode == "defer" and first):
            return
        raise Interrupted(signum)

    def now(self, log_point: bool, device: torch.device) -> bool:
        """Stop after this step? Alone: as soon as a signal came. Under torchrun every rank must stop
        at the same step (one that left would hang the others in DDP's next all-reduce), so they
        agree by an all-reduce, at log points only, where the loop reads the device anyway."""
        if not is_distributed():
            return bool(self.received)
        return log_point and any_rank(bool(self.received), device)

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGTERM)  # a rank stopped by the others': as SIGTERM


SIGNALS = Signals()  # one per process, as signal handlers are


def continue_command(out_dir: Path, world_size: int) -> str:
    """The command that continues this run from its last.pt."""
    return shlex.join(["python", "train.py", "--resume", "--out-dir", str(out_dir)]) + (
        " (under torchrun, with those flags)" if world_size > 1 else "")


def worker_init(worker: int) -> None:
    """A DataLoader worker's first step: where the main process handles signals (train.py saves first,
    then ends its workers), a signal to the whole group (systemd, Slurm, kill -TERM -PGID) spares it."""
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):  # the parent's, inherited
        for sig in Signals.NAMES:
            signal.signal(sig, signal.SIG_IGN)


def _end_workers() -> None:
    """At exit: DataLoader workers leave signals to this process (data.py), so the SIGTERM with which
    multiprocessing ends them would be ignored, and its wait for them last for ever. (Their end is not
    an error: torch's SIGCHLD handler, which would say it is, goes first.)"""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
