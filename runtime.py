"""What train.py and lr_find.py both need around the loop: device, AMP, processes, checkpoints."""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
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
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
