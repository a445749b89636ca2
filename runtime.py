"""What train.py and lr_find.py both need around the loop: device, AMP, processes, checkpoints."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from configs import UserError


def pick_device(name: str = "auto") -> torch.device:
    """cuda > mps > cpu unless forced; under torchrun each process takes its LOCAL_RANK's GPU."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
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


def amp_setup(device: torch.device, mode: str) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """Autocast dtype and GradScaler: bf16 where the device has it, else fp16 with a scaler."""
    dtype = amp_dtype(device, mode)
    return dtype, torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def amp_dtype(device: torch.device, mode: str) -> torch.dtype | None:
    """The autocast dtype `mode` means on `device`; None is off.

    "auto" is off on CPU and MPS, where autocast rarely pays; bf16 or fp16 can still be forced.
    On CUDA it is bf16 only where the GPU computes in it natively (Ampere and later): V100 and
    T4 emulate bf16 slowly, which torch counts as supported unless including_emulation=False.
    """
    if mode == "auto":
        if device.type != "cuda":
            return None
        mode = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ---------------------------------------------------------------- processes (torchrun)

def setup_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun: one process per GPU (nccl), or gloo on CPU."""
    if "RANK" not in os.environ:
        return 0, 1, pick_device(device_name)
    device = pick_device(device_name)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


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


def sync_buffers(module: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank.

    DDP broadcasts buffers at the start of each forward, so after the last one every rank holds
    statistics updated by its own shard; syncing before evaluation and saving removes that skew.
    """
    if is_distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def ranks_agree(module: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters and buffers (a DDP sanity check)."""
    if not is_distributed():
        return True
    flat = torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([float(torch.equal(flat, reference))], device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def cleanup_distributed() -> None:
    if is_distributed():
        dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP's `.module` and torch.compile's `._orig_mod` wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, fsync, then os.replace.

    A crash or kill at any moment leaves either the old file or the new one, never a torn one.
    A failed write (disk full, no permission, read-only) raises UserError naming the path, the
    size it needed and the free space, and leaves the old file as it was.
    """

    def write(file) -> None:
        keeper = _ErrorKeeper(file)
        try:
            torch.save(state, keeper)
        except RuntimeError:
            if keeper.error is None:
                raise
            raise keeper.error from None

    _write_atomic(Path(path), write, lambda: _tensor_bytes(state))


def load_checkpoint(path: str | Path) -> dict:
    """torch.load with weights_only=True: tensors and plain data only, never code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train first or pass --resume PATH")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "unsafe content"
        if "Weights only load failed" in reason:
            reason = "it holds objects other than tensors and plain data"
        raise UserError(f"checkpoint {path} refused: {reason}; only weights_only checkpoints "
                        "load (nothing in it was executed)") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first[:120]}); "
                        "delete it or resume from another file") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} does not hold a dict of training state")
    return state


def all_finite(tensors) -> bool:
    """True when no floating-point tensor holds a nan or inf; one device read for all of them."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


# ---------------------------------------------------------------- output files

FIXES = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
         errno.EROFS: "use a writable disk", errno.ENOTDIR: "move the file in the way"}

def check_writable_dir(path: str | Path, what: str = "--out-dir") -> None:
    """Prove that `path` can be created and written, before any time is spent training.

    Folders it had to create are removed again, so a run that then stops on another error
    leaves nothing behind.
    """
    path = Path(path)
    created = [folder for folder in (path, *path.parents) if not folder.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise UserError(f"cannot create {what} {path}: a file is in the way; pick another {what}") from None
    except OSError as err:
        raise write_error(path, err, label=f"{what} {path}") from None
    finally:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()


def check_free_space(path: str | Path, needed: int, what: str) -> None:
    """Refuse at start-up when `path`'s disk cannot hold `needed` bytes (one checkpoint, say)."""
    free = _free_bytes(Path(path))
    if free is not None and free < needed:
        raise UserError(f"{path} has {_size(free)} free but {what} needs about {_size(needed)}; "
                        "free some space or pick another --out-dir")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file the way checkpoints are written: whole or not at all, one line on failure."""
    data = text.encode()
    _write_atomic(Path(path), lambda file: file.write(data), lambda: len(data))


def write_json_atomic(path: str | Path, value) -> None:
    write_text_atomic(path, json.dumps(value, indent=2) + "\n")


@contextlib.contextmanager
def reporting_write_errors(path: str | Path, label: str | None = None):
    """Turn an OSError inside the block (say, from a TensorBoard writer) into one UserError line."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err, label=label) from None


def quiet_tensorboard_thread() -> None:
    """Keep Python from printing a traceback when TensorBoard's writer thread dies of an OSError.

    That thread keeps its error and raises it again at the next write or flush, in the main
    thread, where reporting_write_errors makes it one line. Other threads report as before.
    """
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


def write_error(path: str | Path, err: OSError, size: int | None = None,
                label: str | None = None) -> UserError:
    """One line for a failed write: the file, why, the size it needed and the space left there."""
    free = _free_bytes(Path(path))
    facts = ([f"needs about {_size(size)}"] if size is not None else []) + (
        [f"{_size(free)} free"] if free is not None else [])
    detail = f" ({', '.join(facts)})" if facts else ""
    fix = FIXES.get(err.errno, "fix its permissions")
    return UserError(f"cannot write {label or path}: {_reason(err)}{detail}; {fix} or pick "
                     "another --out-dir")


def _write_atomic(path: Path, write: Callable, size: Callable[[], int]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
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


class _ErrorKeeper:
    """torch.save reports an OSError from write() as a RuntimeError without its errno; keep it."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding `path`, or its nearest existing parent; None if unknown."""
    for folder in (path, *path.absolute().parents):
        with contextlib.suppress(OSError):
            if folder.exists():
                return shutil.disk_usage(folder).free
    return None


def _size(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def _reason(err: OSError) -> str:
    text = err.strerror or str(err) or type(err).__name__
    return text[:1].lower() + text[1:]
