"""How a run saves and how it stops: each stop ends in one line that says where, what last.pt holds, and
the command that continues, never with a traceback or a lost checkpoint.

- A signal (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1: signals.py): the loop finishes its step, saves last.pt and
  stops with the command that continues it (exit 128 + the signal). A second one stops at once.
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
from collections.abc import Callable
from pathlib import Path

from configs import Config, UserError, command_line, first_line
from machinery import processes
from machinery.checkpoints import all_finite, write_checkpoint
from machinery.image_files import UnreadableImage
from machinery.run_folder import continue_command, release_all
from machinery.signals import SIGNALS, Interrupted

# A logged training loss above this multiple of the run's first batch loss is not coming back
# (lr_find.py stops its sweep at the same factor over its best loss).
DIVERGENCE_FACTOR = 4.0


class Stops(contextlib.AbstractContextManager):
    """The training loop's saves and stops. `progress` is where the run stands (train.Progress: epoch,
    batch, step, start_loss), `checkpoint()` the dict a save writes, `tensorboard` flushed before it.
    Inside the block a signal only sets a flag, which `stop_if_signalled` reads after each step; the
    block turns an unreadable image, a lost peer or a second signal into its one line."""

    def __init__(self, out_dir: Path, progress, checkpoint: Callable[[], dict], tensorboard):
        self.out_dir, self.progress, self.checkpoint = out_dir, progress, checkpoint
        self.tensorboard = tensorboard
        # where last.pt stands ("run": epoch, batch, step): a resumed run's is where it resumed; None: none
        self.saved = dataclasses.asdict(progress) if progress.part > 1 else None
        self.step_begun = None  # the step count when the loop began its step's forwards (see mid_step)
        self.signals = contextlib.ExitStack()

    def save(self, *, best: bool = False) -> None:
        """`checkpoint()` as out_dir/last.pt, and as best.pt too where `best` (rank 0 writes them; a signal
        waits for them to be whole), never of nan or inf weights. TensorBoard writes first: its log holds
        every step saved."""
        state = self.checkpoint()
        if not all_finite(state["model"].values()):
            raise self.diverged("the weights hold nan or inf")
        self.tensorboard.flush()
        if processes.rank() == 0:  # the other ranks hold the same states
            with SIGNALS.in_mode("hold"):
                for name in ("last.pt", "best.pt")[:1 + best]:
                    write_checkpoint(state, self.out_dir / name)
        self.saved = state["run"]

    @property
    def mid_step(self) -> bool:
        """Between a step's first forward and its optimizer step: the state is the step's, half done."""
        return self.step_begun == self.progress.step

    def stop_if_signalled(self, log_point: bool, device) -> None:
        """After a step: stop, saved, if a signal came (under torchrun all ranks agree at log points)."""
        if SIGNALS.now(log_point, device):
            if not self.saved or self.saved["step"] != self.progress.step:
                self.save()
            processes.say(f"interrupted at step {self.progress.step}; saved {self.out_dir / 'last.pt'}; "
                          f"{self.resuming()}")
            raise SystemExit(SIGNALS.exit_code)

    def check_divergence(self, train_loss: float, device) -> None:
        """At a log point: stop when the training loss is not finite, or above DIVERGENCE_FACTOR x the run's
        first batch loss (on all ranks at one step, if any rank sees it)."""
        start = self.progress.start_loss
        why = (f"train loss {train_loss}" if not math.isfinite(train_loss) else
               f"train loss {train_loss:.4g}, over {DIVERGENCE_FACTOR:g}x the first batch's {start:.4g}"
               if start > 0 and train_loss > DIVERGENCE_FACTOR * start else None)
        if processes.any_rank(why is not None, device):
            raise self.diverged(why or "diverged on another process")

    def check_val_loss(self, loss: float, line: str) -> None:
        """After an evaluation: a val loss that is not finite stops the run (its epoch's line said first)."""
        if not math.isfinite(loss):
            processes.say(line)
            raise self.diverged(f"val loss {loss} after epoch {self.progress.epoch + 1}")

    def diverged(self, what: str) -> UserError:
        """The line a diverged run stops with: where, at what rate, what to try, and what last.pt holds. A
        first loss that is not finite came before any step: the data or the model, not the rate."""
        state, start = self.checkpoint(), self.progress.start_loss
        lr, at_lr = state["config"]["lr"], state["optimizer"]["param_groups"][0]["lr"]
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
        return f"continue with `{continue_command(self.out_dir, processes.world_size())}`"

    def __enter__(self) -> Stops:
        self.signals.enter_context(SIGNALS.installed())
        self.signals.enter_context(SIGNALS.in_mode("defer"))
        return self

    def __exit__(self, kind, err, traceback) -> None:
        try:  # the lines below are said with the signals still deferred: a save is never cut short
            self._stop(err)
        finally:
            self.signals.close()

    def _stop(self, err: BaseException | None) -> None:
        last, step = self.out_dir / "last.pt", self.progress.step
        if isinstance(err, UnreadableImage):  # stops the run as Ctrl-C does, saved where it stands
            here = (self.progress.epoch, self.progress.batch)
            if not self.saved or (self.saved["epoch"], self.saved["batch"]) != here:
                self.save()
            raise UnreadableImage(f"{err}; {last} holds step {self.saved['step']}; replace or delete it, "
                                  f"then {self.resuming()}") from None
        if isinstance(err, RuntimeError) and processes.peer_lost(err):
            # Between steps every rank holds the last whole step (equal on all of them), so rank 0 saves it
            # as it stands, which needs no collective; mid-step (a forward has moved BatchNorm's statistics
            # and the RNGs) last.pt stays as it is, whole.
            whole = not self.mid_step and step > (self.saved["step"] if self.saved else 0)
            if processes.rank() == 0 and whole:
                self.save()
            left = f"{last} holds step {self.saved['step']}" if self.saved else "no checkpoint was written"
            raise UserError(f"another process of this run failed ({first_line(err, 120)}): stopped at step "
                            f"{step}; {left}; continue with `torchrun ... train.py ... --resume auto` "
                            "(torchrun --max-restarts N does that itself)", 1) from None
        if isinstance(err, Interrupted):  # a second signal: stopped at once
            left = (f"{last} holds step {self.saved['step']}; {self.resuming()}" if self.saved
                    else "no checkpoint was written")
            raise UserError(f"interrupted again by {err}: stopped at once at step {step}; {left}",
                            128 + err.signum) from None


def lower_rate_command(config: dict, out_dir: Path) -> str:
    """The command that runs a diverged run again at a tenth of its rate, in a new folder beside out_dir: a
    new run in out_dir would be refused where its last.pt holds the unfinished run (and its logs stay there,
    to compare)."""
    lr, base = float(f"{config['lr'] / 10:.2g}"), out_dir if out_dir.name else out_dir.resolve()
    new, n = base.with_name(f"{base.name}-lr{lr:g}"), 1
    while new.exists():
        n += 1
        new = base.with_name(f"{base.name}-lr{lr:g}-{n}")
    command = command_line("train.py", Config(**{**config, "lr": lr, "out_dir": str(new)}), leave_out=())
    return command + (" (under torchrun, with those flags)" if processes.world_size() > 1 else "")


@contextlib.contextmanager
def one_line(after: str, *, status: int = 2, caught: type[Exception] = UserError, program: bool = True):
    """A script's whole run, ending in one line whatever stops it: a signal from start-up on (`after` says
    where it struck and what is as it was), a UserError (`caught`: also any ValueError, for lr_find.py) with
    its exit code (0: nothing to do, said and not an error), a failure torch reports at length (`status`).
    Under torchrun one process says it; the folder's lock and the process group are let go in any case.
    `program` False (the script's main() called in-process): a signal then goes on to the caller's handler
    (signals.py), after the line."""
    try:
        with SIGNALS.installed(program=True):  # handed on at the very end, where not `program`
            yield
    except caught as err:
        code = getattr(err, "code", 2)
        if code == 0:  # nothing to do (a complete run resumed)
            processes.say(str(err))
            return
        # Under torchrun, one line from one process; a file only one rank read, from that rank.
        if processes.rank() == 0 or isinstance(err, UnreadableImage):
            processes.tell_torchrun(f"error: {err}")
            exit_with_error(str(err), code)
        raise SystemExit(code) from None
    except (KeyboardInterrupt, Exception) as err:  # a signal outside the loop, or a known torch failure
        if processes.rank() != 0 and not isinstance(err, KeyboardInterrupt):
            raise  # torch's long report, from rank 0 alone
        exit_with_error(*failure_line(err, after, status))
    finally:
        release_all()
        processes.cleanup()
        if not program:
            SIGNALS.hand_on()
        else:  # the process ends next: its last collection walked torch's millions of objects, 0.7 s on exit
            gc.freeze()


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
    elif "does not have a deterministic implementation" in text:  # --deterministic: the op torch names
        line = (f"--deterministic: {text.split()[0]} has no deterministic kernel on this device; run without "
                "--deterministic, or replace the layer that uses it (docs/training.md lists the common ones)")
    elif type(err).__name__ in ("BackendCompilerFailed", "InductorError", "CppCompileError"):
        line = (f"--compile failed ({first}); run without --compile (on CPU, torch.compile also needs a "
                "C++ compiler such as g++)")
    else:
        raise err
    return line, status


def exit_with_error(message: str, status: int = 2):
    """The one line a script ends with: on stderr, and the exit status."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)
