"""Where a run computes: its device, autocast's dtype, and its processes: this one alone (Alone), or
torchrun's (machinery/torchrun.py), chosen once at start. Rank 0 alone prints, logs and saves."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from configs import UserError


def start(device_name: str, timeout_minutes: float = 60.0, deterministic: bool = False):
    """This process's device and its place: Alone, or under torchrun (RANK set) one of its process group."""
    device = pick_device(device_name, deterministic)
    if "RANK" not in os.environ:
        return Alone(device)
    from machinery.torchrun import Torchrun

    return Torchrun.joined(device, timeout_minutes)


class Alone:
    """One process, rank 0 of 1: what Torchrun shares, sums or agrees on is already whole here."""

    rank, world_size, shard = 0, 1, (0, 1)  # shard: this process's part of each epoch, of how many

    def __init__(self, device: torch.device):
        self.device = device

    def on_rank0(self, work, *args) -> None:
        work(*args)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, rows):
        return rows

    def any(self, flag: bool) -> bool:
        return flag

    def share(self, tensors) -> None:
        """Rank 0's tensors on every rank: here they are."""

    def parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def gradient_sync(self, model: torch.nn.Module, last: bool):
        return contextlib.nullcontext()

    def agree(self, module: torch.nn.Module) -> bool:
        return True


ALONE = Alone(None)  # one process's sums and gathers (evaluate()'s default)


def rank() -> int:
    """This process's rank: its process group's, or as torchrun sets it before one starts; 0 alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def say(*lines: str) -> None:
    """Print, once: on rank 0 alone under torchrun."""
    if rank() == 0:
        print(*lines, sep="\n")


def pick_device(name: str = "auto", deterministic: bool = False) -> torch.device:
    """cuda > mps > cpu unless named; --deterministic: repeatable kernels only."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # refused just below
    backend = getattr(torch, device.type, None) if device.type in ("mps", "xpu") else None
    if device.type not in ("cpu", "cuda", "mps", "xpu") or (backend and not backend.is_available()):
        there = f"{name} is not on this machine" if backend else f"{name!r} is not a device to train on"
        raise UserError(f"--device {there}; use auto, cpu, cuda, cuda:N, mps or xpu")
    if device.type == "cuda":
        return cuda_device(device, deterministic)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        say(f"--deterministic: on {device.type} the kernels already repeat bit for bit; only an op with no "
            "deterministic kernel would now stop the run")
    return device


def cuda_device(device: torch.device, deterministic: bool) -> torch.device:
    """This process's GPU (under torchrun its LOCAL_RANK's), fast (TF32, cuDNN autotuning) or repeatable."""
    if device.index is not None and world_size() > 1:
        raise UserError(f"--device {device} would put all {world_size()} torchrun processes on one GPU; "
                        "use --device cuda (each process takes its LOCAL_RANK's GPU)")
    if not torch.cuda.is_available():
        raise UserError("device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    if device.index is None:  # where each process sees one GPU (Slurm's --gpus-per-task=1), it is 0
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    if deterministic:  # cuBLAS reads this at its first matmul: set it before
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = not deterministic, deterministic
    return device


def amp_setup(device: torch.device, mode: str) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """Autocast's dtype (None: off) and a GradScaler for fp16."""
    dtype = amp_dtype(device, mode)
    return dtype, torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def amp_dtype(device: torch.device, mode: str) -> torch.dtype | None:
    """auto: off on CPU and MPS; on CUDA bf16 where the GPU computes in it natively, else fp16."""
    if mode == "auto" and device.type == "cuda":
        mode = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast, or nothing with AMP off: a disabled autocast still costs host time every step."""
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
