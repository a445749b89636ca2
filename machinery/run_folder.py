"""One --out-dir, one run: the folder is claimed before any data loads (writable, no unfinished run to
overwrite, no other live run in it) and locked while the run lives; --resume auto starts a run there or
continues it, one command for a first start and every restart.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import socket
from dataclasses import replace
from pathlib import Path

from configs import Config, UserError, validate
from machinery import processes
from machinery.checkpoints import Resumed, load_checkpoint, load_resume
from machinery.files import write_error


def resume(cfg: Config, given: dict | None, task, choices: dict) -> tuple[Config, Resumed | None]:
    """The config a run goes on with, and the checkpoint it continues (None: a new run). --resume auto
    with no last.pt yet is a first start."""
    if cfg.resume == "auto" and not (Path(cfg.out_dir) / "last.pt").is_file():
        processes.say(f"--resume auto: no {Path(cfg.out_dir) / 'last.pt'} yet, so a new run")
        cfg = replace(cfg, resume="")
    if not cfg.resume:
        return validate(cfg, choices), None
    return load_resume(cfg, given, task, choices)


def claim(out_dir: Path, resumed_from: Path | None = None) -> Path:
    """Before any data is loaded, by rank 0 for all: --out-dir can be written, holds no unfinished run (whose
    last.pt --resume would continue) that this one would overwrite, and no other live run. This process then
    owns the folder (lock) and removes the temporary files that a save killed midway left there."""
    processes.on_rank0(_claim, out_dir, resumed_from)
    return out_dir


def _claim(out_dir: Path, resumed_from: Path | None) -> None:
    # A file written and deleted proves the folder writable; the folders made for it go again, so that a
    # run that then stops on another error leaves nothing behind.
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise UserError(f"cannot create --out-dir {out_dir}: a file is in the way; pick another "
                        "--out-dir") from None
    except OSError as err:
        raise write_error(out_dir, err, label=f"--out-dir {out_dir}") from None
    finally:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
    lock(out_dir)  # first: a live run's folder is "in use", whatever its last.pt says by now
    last, saved = out_dir / "last.pt", {}
    if last.is_file() and (resumed_from is None or resumed_from.resolve() != last.resolve()):
        with contextlib.suppress(UserError):  # unreadable, so there is nothing to continue
            saved = load_checkpoint(last)
    step, total = saved.get("step", 0), saved.get("total_steps", 0)
    stopped = isinstance(saved.get("run"), dict) and saved["run"].get("stopped")  # --early-stop: finished
    if isinstance(step, int) and isinstance(total, int) and step < total and not stopped:
        release_all(out_dir / ".lock")
        this = f"resuming {resumed_from} there" if resumed_from else "a new run"
        raise UserError(f"{last} holds an unfinished run (step {step} of {total}) that {this} would "
                        f"overwrite; continue it with --resume --out-dir {out_dir}, or pick another "
                        "--out-dir, or delete the file to start over")
    for tmp in out_dir.glob(".*.tmp"):  # no other run is in the folder now: no one is writing these
        if not tmp.name.endswith(f".{os.getpid()}.tmp"):
            tmp.unlink(missing_ok=True)


def continue_command(out_dir: Path, world_size: int) -> str:
    """The command that continues this run from its last.pt."""
    return shlex.join(["python", "train.py", "--resume", "--out-dir", str(out_dir)]) + (
        " (under torchrun, with those flags)" if world_size > 1 else "")


# ---------------------------------------------------------------- the lock


def lock(out_dir: Path) -> None:
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
    """The block during which this process's run owns out_dir: its lock (claim's) goes at the end,
    whatever ends it; release_all() lets go of the rest (the scripts' main, and at exit)."""
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
