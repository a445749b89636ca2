"""Files written whole, and downloads into a folder. Every file a run writes is written atomically (a
temporary file, fsync, rename: a kill leaves the old file or the new one); a failed write is one line naming
the file, the size it needed and the space left."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from configs import UserError, first_line
from machinery import processes

FIXES = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
         errno.EROFS: "use a writable disk", errno.ENOTDIR: "move the file in the way",
         errno.EISDIR: "move the folder in the way"}


def write_atomic(path: str | Path, write: Callable, size: Callable[[], int]) -> None:
    """`write(file)` into a temporary file beside `path`, then fsync and rename; `size()`: what it needs."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            keeper = _ErrorKeeper(f)
            try:
                write(keeper)
            except RuntimeError as err:  # torch.save's report of an OSError: the keeper kept the OSError
                raise (keeper.error or err) from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        error = write_error(path, err, size())
        raise UserError(f"{error}; any earlier {path.name} is unchanged") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    write_atomic(path, lambda file: file.write(data), lambda: len(data))


def write_json_atomic(path: str | Path, value) -> None:
    write_bytes_atomic(path, (json.dumps(value, indent=2) + "\n").encode())


@contextlib.contextmanager
def reporting_write_errors(path: str | Path, label: str | None = None):
    """An OSError in the block (a TensorBoard writer's, say) as one line naming `label` or the file."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err, label=label or err.filename) from None


def write_error(path: str | Path, err: OSError, size: int | None = None,
                label: str | None = None) -> UserError:
    """One line for a failed write: the file, why, the size it needed and the space left there."""
    free = free_bytes(Path(path))
    facts = ([f"needs about {shown_size(size)}"] if size is not None else []) + (
        [f"{shown_size(free)} free"] if free is not None else [])
    detail = f" ({', '.join(facts)})" if facts else ""
    reason = err.strerror or str(err) or type(err).__name__
    fix = FIXES.get(err.errno, "fix its permissions")
    return UserError(f"cannot write {label or path}: {reason[:1].lower()}{reason[1:]}{detail}; {fix} "
                     "or pick another --out-dir")


class _ErrorKeeper:
    """torch.save reports an OSError from write() as a RuntimeError without its errno: keep it."""

    def __init__(self, file):
        self.file, self.flush, self.error = file, file.flush, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding `path`, or its nearest existing parent; None if unknown."""
    for folder in (path, *path.absolute().parents):
        with contextlib.suppress(OSError):  # a folder not made yet: its parent's disk
            return shutil.disk_usage(folder).free
    return None


def shown_size(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


@contextlib.contextmanager
def downloading(folder: Path, failed: str) -> Iterator[bool]:
    """A download into `folder`, quiet: a failure (no network, a proxy, a bad hash, a full disk) is one line,
    `failed` with its {reason}, and the folders it made go. Under torchrun rank 0 alone downloads (the block
    gets True there) while the others wait, then read what it left: several writers would corrupt it."""
    first = processes.rank() == 0
    if not first:
        barrier()  # rank 0 downloads first
    created = [f for f in (folder, *folder.absolute().parents) if not f.exists()]  # deepest first
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield first
    except Exception as err:
        for empty in created:
            with contextlib.suppress(OSError):
                empty.rmdir()
        raise UserError(failed.format(reason=first_line(getattr(err, "reason", "") or err, 100))) from None
    finally:
        if first:
            barrier()  # the others read it now


def barrier() -> None:
    """In a process group, wait for every process here."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
