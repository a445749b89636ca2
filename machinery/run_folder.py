"""One --out-dir, one run: the folder is claimed before any data loads (writable, no unfinished run to
overwrite, no other live run) and locked while the run lives."""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import socket
from pathlib import Path

from configs import Config, UserError, validate
from machinery.checkpoints import load_checkpoint
from machinery.files import write_atomic, write_error


def resume(cfg: Config, given: dict | None, task, choices: dict):
    """The config a run goes on with, and the checkpoint it continues (None: a new run: no resume code)."""
    if not cfg.resume:
        return validate(cfg, choices), None
    from machinery.resume import load

    return load(cfg, given, task, choices)


def claim(out_dir: Path, resumed=None, process=None) -> Path:
    """--out-dir writable, with no unfinished run to overwrite and no live one, then locked, by rank 0 for all
    (`process`); a run `resumed` from another folder takes an empty one, with its best.pt."""
    if process is None:
        _claim(out_dir, resumed)
    else:
        process.on_rank0(_claim, out_dir, resumed)
    return out_dir


def _claim(out_dir: Path, resumed) -> None:
    writable(out_dir)
    lock(out_dir)  # first: a live run's folder is "in use", whatever its last.pt says by now
    last = out_dir / "last.pt"
    if last.is_file() and (resumed is None or resumed.path.resolve() != last.resolve()):
        check_overwrite(out_dir, resumed)
    if resumed is not None and resumed.path.parent.resolve() != out_dir.resolve():
        _take_best(out_dir, resumed)
    for tmp in out_dir.glob(".*.tmp"):  # no other run is in the folder now: no one is writing these
        if not tmp.name.endswith(f".{os.getpid()}.tmp"):
            tmp.unlink(missing_ok=True)


def writable(out_dir: Path) -> None:
    """A file written and deleted proves the folder writable; the folders made for it go again."""
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


def check_overwrite(out_dir: Path, resumed) -> None:
    """An unfinished run's last.pt (whose run --resume would continue) is never overwritten by another."""
    last, saved, this = out_dir / "last.pt", {}, f"resuming {resumed.path} there" if resumed else "a new run"
    try:
        saved = load_checkpoint(last)
    except UserError:  # emptied or cut short: maybe an unfinished run's, which best.pt can continue
        best = out_dir / "best.pt"
        keep = f"{best}, which can still continue it (--resume {best})" if best.is_file() else "it"
        if resumed is None:
            _refuse(out_dir, f"{last} cannot be read (emptied or cut short) and may be an unfinished "
                    f"run's: {this} would overwrite {keep}; delete last.pt to start over, or pick "
                    "another --out-dir")
    step, total = saved.get("step", 0), saved.get("total_steps", 0)
    stopped = isinstance(saved.get("run"), dict) and saved["run"].get("stopped")  # --early-stop: finished
    if isinstance(step, int) and isinstance(total, int) and step < total and not stopped:
        _refuse(out_dir, f"{last} holds an unfinished run (step {step} of {total}) that {this} would "
                f"overwrite; continue it with --resume --out-dir {out_dir}, or pick another --out-dir, or "
                "delete the file to start over")


def _take_best(out_dir: Path, resumed) -> None:
    """A run resumed into another folder: an empty one (another run's best.pt, summary or --keep-best files
    would pass for this one's, and its kept files be deleted as this one's), given the best.pt beside its
    checkpoint, which its test pass reads unless it betters it."""
    named = ("last.pt", "best.pt", "summary.json", "best-k.json")
    held = [name for name in named if (out_dir / name).exists()] + sorted(
        path.name for path in out_dir.glob("best-step*.pt"))
    if held:
        _refuse(out_dir, f"{out_dir} holds another run ({', '.join(held)}): resuming {resumed.path} there "
                "would mix the two; resume it into an empty --out-dir, or into its own folder")
    best = resumed.path.parent / "best.pt"
    if resumed.state["run"].get("best") is None:  # not evaluated yet: it has no best weights so far
        return
    if not best.is_file():
        _refuse(out_dir, f"{resumed.path} has no best.pt beside it, and its run's test pass reads its best "
                "weights; put them there, or start a new run from these weights with --init-from "
                f"{resumed.path}")
    with open(best, "rb") as source:
        write_atomic(out_dir / "best.pt", lambda file: shutil.copyfileobj(source, file),
                     lambda: best.stat().st_size)


def _refuse(out_dir: Path, message: str) -> None:
    release_all(out_dir / ".lock")
    raise UserError(message)


def continue_command(out_dir: Path, world_size: int) -> str:
    """The command that continues this run from its last.pt."""
    return shlex.join(["python", "train.py", "--resume", "--out-dir", str(out_dir)]) + (
        " (under torchrun, with those flags)" if world_size > 1 else "")


# ---------------------------------------------------------------- the lock


def lock(out_dir: Path) -> None:
    """out_dir/.lock for this process, released (and the folders made for it, if empty) at its exit."""
    path, mine = out_dir / ".lock", f"{os.getpid()} {socket.gethostname()}"
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            with open(path, "x") as f:
                f.write(mine)
            break
        except FileExistsError:
            if not stale(path, mine, out_dir):
                return  # this process's own, from an earlier run in it
    if not _HELD:
        atexit.register(release_all)
    _HELD.append((path, mine, created))


_HELD = []  # this process's locks: (path, its text, the folders made for it)


def stale(path: Path, mine: str, out_dir: Path) -> bool:
    """A lock held by a process that is gone (kill -9) is removed (True); this process's own stays (False);
    a live run's, here or on another host, is refused."""
    held = path.read_text(errors="replace").split()
    if held[:2] == mine.split():
        return False
    pid, host = (int(held[0]), held[1]) if len(held) >= 2 and held[0].isdigit() else (0, "")
    if host == socket.gethostname() and pid and _alive(pid):
        raise UserError(f"{out_dir} is in use by another run (process {pid}); wait for it to end, "
                        "or pick another --out-dir") from None
    if host not in ("", socket.gethostname()):
        raise UserError(f"{out_dir} is in use by a run on {host} (process {pid}); if none runs "
                        f"there, delete {path}, or pick another --out-dir") from None
    path.unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def holding(out_dir: Path):
    """The block in which this run owns out_dir: its lock goes at the end, whatever ends it."""
    try:
        yield
    finally:
        release_all(out_dir / ".lock")


def release_all(only: Path | None = None) -> None:
    """This process's locks (or the one at `only`) go, and the folders made for them, if empty."""
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
