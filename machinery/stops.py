"""How a run stops: each stop ends in one line that says where, what last.pt holds and the command that
continues, never with a traceback or a lost checkpoint.

- A signal (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1): inside the loop it sets a flag; the loop finishes its step,
  saves last.pt and stops (exit 128 + the signal). A second one stops at once. Outside the loop it stops
  at once (Interrupted). Nothing interrupts a save.
- An image the data cannot decode: last.pt is saved where the run stands, the file named.
- Another process of a torchrun run gone: rank 0 saves the last whole step, if it holds one.
- Divergence: no checkpoint of nan weights is written; the line says what rate to try.
- What torch reports at length (out of memory, shared memory, a closed stdout): one line (failure_line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from configs import Config, UserError, command_line, exit_with_error, first_line
from machinery.checkpoints import all_finite, write_checkpoint
from machinery.processes import say
from machinery.run_folder import continue_command, release_all

# A logged training loss above this multiple of the run's first batch loss is not coming back
# (lr_find.py stops its sweep at the same factor over its best loss).
DIVERGENCE_FACTOR = 4.0


class UnreadableImage(UserError):
    """An image file that cannot be decoded: the run saves where it stands, the line names the file. From a
    DataLoader worker it arrives with the worker's traceback as text: its last line is ours."""

    def __init__(self, message: str):
        worker = "Original Traceback" in message
        super().__init__(message.rstrip().splitlines()[-1].split(": ", 1)[-1] if worker else message)


class Interrupted(KeyboardInterrupt):
    """A signal that stops the process where it stands."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """The signal received (0: none), and what it does: "raise" stops at once, "defer" (the loop) sets the
    flag, "hold" (a save) lets nothing interrupt."""

    NAMES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

    def __init__(self):
        self.received, self.mode, self.previous = 0, "raise", {}
        self.stopped_by = 0  # the signal the outermost block received, until hand_on() passes it on
        self.pass_on = True  # False: a signal ends the run as in a program (tests that signal themselves)

    @contextlib.contextmanager
    def installed(self, *, program: bool = False):
        """Our handlers for the block (nested blocks share them); then the earlier ones, which get the signal
        unless the script runs as a `program` (hand_on)."""
        outermost = not self.previous and threading.current_thread() is threading.main_thread()
        if outermost:
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.NAMES}
            self.stopped_by = 0
        try:
            yield self
        finally:
            if outermost:
                self.stopped_by = self.received
                for sig, handler in self.previous.items():
                    signal.signal(sig, handler)
                self.previous, self.received, self.mode = {}, 0, "raise"
                if not program:
                    self.hand_on()

    def hand_on(self) -> None:
        """The signal that stopped the run, to the handler put back (a caller's: pytest's, a notebook's), so
        that it stops too; Python's own SIGINT handler raises KeyboardInterrupt here."""
        signum, self.stopped_by = self.stopped_by, 0
        if signum and self.pass_on:
            signal.raise_signal(signum)

    @contextlib.contextmanager
    def in_mode(self, mode: str):
        before, self.mode = self.mode, mode
        try:
            yield self
        finally:
            self.mode = before

    @contextlib.contextmanager
    def held_while_forking(self):
        """A signal while DataLoader workers start is acted on after: raised inside a fork's at-fork
        callbacks, it was only printed."""
        before, first = self.mode, not self.received
        with self.in_mode("hold"):
            yield
        if before == "raise" and first and self.received:
            raise Interrupted(self.received)

    def _handle(self, signum, frame):
        first = not self.received
        self.received = self.received or signum
        if self.mode == "hold" or (self.mode == "defer" and first):
            return
        raise Interrupted(signum)

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGTERM)  # a rank stopped by the others': as SIGTERM


SIGNALS = Signals()  # one per process, as signal handlers are


class Stops(contextlib.AbstractContextManager):
    """The loop's saves and stops: `progress` where the run stands (train.Progress), `checkpoint()` what a
    save writes, `logs` flushed first, `process` where it runs. In the block a signal only sets a flag."""

    def __init__(self, out_dir: Path, progress, checkpoint: Callable[[], dict], logs, process):
        self.out_dir, self.progress, self.checkpoint = out_dir, progress, checkpoint
        self.logs, self.process = logs, process
        self.saved = dataclasses.asdict(progress) if progress.part > 1 else None  # where last.pt stands
        self.step_begun = None  # the step whose forwards have begun (mid_step)
        self.signals = contextlib.ExitStack()

    def save(self, *, best: bool = False, val: dict | None = None) -> None:
        """last.pt (and best.pt), by rank 0; never of nan or inf weights; logs first. `val`: --keep-best's."""
        state = self.checkpoint()
        if not all_finite(state["model"].values()):
            raise self.diverged("the weights hold nan or inf")
        self.logs.flush()
        if self.process.rank == 0:  # the other ranks hold the same states
            with SIGNALS.in_mode("hold"):
                for name in ("last.pt", "best.pt")[:1 + best]:
                    write_checkpoint(state, self.out_dir / name)
        self.saved = state["run"]

    def begin_step(self) -> None:  # from the first forward until the optimizer step: half a step
        self.step_begun = self.progress.step

    @property
    def mid_step(self) -> bool:
        return self.step_begun == self.progress.step

    def stop_if_signalled(self, log_point: bool) -> None:
        """After a step: saved, then stopped, if a signal came; torchrun's ranks agree at log points."""
        if (log_point or self.process.world_size == 1) and self.process.any(bool(SIGNALS.received)):
            if not self.saved or self.saved["step"] != self.progress.step:
                self.save()
            say(f"interrupted at step {self.progress.step}; saved {self.out_dir / 'last.pt'}; "
                f"{self.resuming()}")
            raise SystemExit(SIGNALS.exit_code)

    def check_divergence(self, train_loss: float) -> None:
        """A loss that is not finite, or above DIVERGENCE_FACTOR x the first batch's, stops the run."""
        start = self.progress.start_loss
        diverged = not math.isfinite(train_loss) or (start > 0 and train_loss > DIVERGENCE_FACTOR * start)
        if self.process.any(diverged):
            raise self.diverged(diverged_because(train_loss, start) if diverged else
                                "diverged on another process")

    def check_val_loss(self, loss: float, line: str) -> None:
        """A val loss that is not finite stops the run, its epoch's `line` said first."""
        if not math.isfinite(loss):
            say(line)
            raise self.diverged(f"val loss {loss} after epoch {self.progress.epoch + 1}")

    def diverged(self, what: str) -> UserError:
        """Where, at what rate, what to try, what last.pt holds; a first loss that is not finite came before
        any step: the data or the model, not the rate."""
        from machinery.turns import first_group

        state, start = self.checkpoint(), self.progress.start_loss
        lr, at_lr = state["config"]["lr"], first_group(state["optimizer"])["lr"]
        kept = (f"{self.out_dir / 'last.pt'} still holds step {self.saved['step']}" if self.saved
                else "this run wrote no checkpoint")
        if start is not None and not math.isfinite(start):
            return UserError(f"the first batch's loss is {start}, before any optimizer step: not the "
                             "learning rate but the data or the model (nan or inf in the inputs or targets, "
                             f"or a layer that makes them); check them, e.g. the dataset's files; {kept}")
        return UserError(f"training diverged at step {self.progress.step} ({what}; lr {float(at_lr):.3g}): "
                         f"try a lower --lr than {lr:.3g} in a new folder, e.g. "
                         f"`{lower_rate_command(state['config'], self.out_dir)}`, or `python lr_find.py` "
                         f"with the same options to find one; {kept}")

    def resuming(self) -> str:
        return f"continue with `{continue_command(self.out_dir, self.process.world_size)}`"

    def __enter__(self) -> Stops:
        self.signals.enter_context(SIGNALS.installed())
        self.signals.enter_context(SIGNALS.in_mode("defer"))
        return self

    def __exit__(self, kind, err, traceback) -> None:
        try:  # with the signals still deferred: a save is never cut short
            if err is not None:
                self.stopped_by(err)
        finally:
            self.signals.close()

    def stopped_by(self, err: BaseException) -> None:
        """An unreadable image, a lost peer or a second signal as its one line, saved where that helps."""
        last, step = self.out_dir / "last.pt", self.progress.step
        if isinstance(err, UnreadableImage):  # stops as Ctrl-C does, saved where it stands
            here = (self.progress.epoch, self.progress.batch)
            if not self.saved or (self.saved["epoch"], self.saved["batch"]) != here:
                self.save()
            raise UnreadableImage(f"{err}; {last} holds step {self.saved['step']}; replace or delete it, "
                                  f"then {self.resuming()}") from None
        if isinstance(err, RuntimeError) and self.process.world_size > 1:
            from machinery.torchrun import peer_lost

            if peer_lost(err):
                self.peer_lost(err)
        if isinstance(err, Interrupted):  # a second signal: stopped at once
            left = (f"{last} holds step {self.saved['step']}; {self.resuming()}" if self.saved
                    else "no checkpoint was written")
            raise UserError(f"interrupted again by {err}: stopped at once at step {step}; {left}",
                            128 + err.signum) from None

    def peer_lost(self, err: BaseException) -> None:
        """Between steps every rank holds the last whole step, so rank 0 saves it, no collective; mid-step
        (a forward moved BatchNorm's statistics and the RNGs) last.pt stays as it is, whole."""
        whole = not self.mid_step and self.progress.step > (self.saved["step"] if self.saved else 0)
        if self.process.rank == 0 and whole:
            self.save()
        left = f"{self.out_dir / 'last.pt'} holds step {self.saved['step']}" if self.saved else (
            "no checkpoint was written")
        raise UserError(f"another process of this run failed ({first_line(err, 120)}): stopped at step "
                        f"{self.progress.step}; {left}; continue with `torchrun ... train.py ... --resume "
                        "auto` (torchrun --max-restarts N does that itself)", 1) from None


def diverged_because(train_loss: float, start: float) -> str:
    if not math.isfinite(train_loss):
        return f"train loss {train_loss}"
    return f"train loss {train_loss:.4g}, over {DIVERGENCE_FACTOR:g}x the first batch's {start:.4g}"


def lower_rate_command(config: dict, out_dir: Path) -> str:
    """The command that runs a diverged run again at a tenth of its rate, in a new folder beside out_dir
    (a new run in out_dir would be refused: its last.pt holds the unfinished run)."""
    lr, base = float(f"{config['lr'] / 10:.2g}"), out_dir if out_dir.name else out_dir.resolve()
    new, n = base.with_name(f"{base.name}-lr{lr:g}"), 1
    while new.exists():
        n += 1
        new = base.with_name(f"{base.name}-lr{lr:g}-{n}")
    command = command_line("train.py", Config(**{**config, "lr": lr, "out_dir": str(new)}), leave_out=())
    return command + (" (under torchrun, with those flags)" if "RANK" in os.environ else "")


@contextlib.contextmanager
def one_line(after: str, *, status: int = 2, caught: type[Exception] = UserError, program: bool = True):
    """A script's run, ending in one line whatever stops it (`after`: what a signal outside the loop left as
    it was), its lock and process group let go. `program` False: main() called in-process, by pytest say."""
    try:
        with SIGNALS.installed(program=True):  # handed on at the very end, where not `program`
            yield
    except (KeyboardInterrupt, Exception) as err:
        ended(err, after, status=status, caught=caught)
    finally:
        release_all()
        if "RANK" in os.environ:
            from machinery.torchrun import leave

            leave()
        if not program:
            SIGNALS.hand_on()
        else:  # the process ends next: its last collection would walk torch's objects (0.7 s)
            gc.freeze()


def ended(err: BaseException, after: str, *, status: int, caught: type[Exception]) -> None:
    """The line a script ends with: a UserError's (`caught`; code 0: nothing to do, said, no error), a
    signal's, or a known failure of torch's; under torchrun from one process."""
    torchrun, rank = "RANK" in os.environ, int(os.environ.get("RANK", "0"))
    if isinstance(err, caught):
        code = getattr(err, "code", 2)
        if code == 0:  # nothing to do (a complete run resumed)
            say(str(err))
            return
        if rank == 0 or isinstance(err, UnreadableImage):  # a file only one rank read, from that rank
            if torchrun:
                from machinery.torchrun import tell_torchrun

                tell_torchrun(f"error: {err}")
            exit_with_error(str(err), code)
        time.sleep(10)  # rank > 0 refuses as rank 0 does: rank 0 says why first, then torchrun stops this one
        raise SystemExit(code) from None
    if rank != 0 and not isinstance(err, KeyboardInterrupt):
        raise err  # torch's long report, from rank 0 alone
    exit_with_error(*failure_line(err, after, status))


def failure_line(err: BaseException, after: str, status: int = 2) -> tuple[str, int]:
    """The one line and exit code for a signal (`after`: where, what is as it was, what to do) or a known
    failure of torch's (`status`); any other error raises again."""
    if isinstance(err, KeyboardInterrupt):
        signum = getattr(err, "signum", signal.SIGINT)
        return f"interrupted by {signal.Signals(signum).name}{after}", 128 + signum
    if isinstance(err, BrokenPipeError):  # stdout's reader ended (`| head`): end as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        line = ("the output was closed (its reader, such as `head`, ended): stopped, and every file written "
                "so far is whole (a train.py run continues with --resume)")
        return line, 128 + signal.SIGPIPE
    text, first = str(err).strip(), first_line(err)
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
    elif "does not have a deterministic implementation" in text:  # --deterministic: the op torch names
        line = (f"--deterministic: {text.split()[0]} has no deterministic kernel on this device; run without "
                "--deterministic, or replace the layer that uses it (docs/training.md lists the common ones)")
    elif type(err).__name__ in ("BackendCompilerFailed", "InductorError", "CppCompileError"):
        line = (f"--compile failed ({first}); run without --compile (on CPU, torch.compile also needs a "
                "C++ compiler such as g++)")
    else:
        raise err
    return line, status
