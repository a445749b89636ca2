"""How the model computes: AMP (autocast's dtype and GradScaler), --compile (torch.compile) and --ema (an
average of the weights, evaluated and kept). train.py, evaluate.py and lr_find.py's command line take them
from here; models.py reads amp_dtype."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

# ---------------------------------------------------------------- AMP


def amp_setup(device: torch.device, mode: str) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """Autocast dtype and GradScaler: bf16 where the device has it, else fp16 with a scaler."""
    dtype = amp_dtype(device, mode)
    return dtype, torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def amp_dtype(device: torch.device, mode: str) -> torch.dtype | None:
    """The autocast dtype `mode` means on `device`; None is off. "auto" is off on CPU and MPS, where
    autocast rarely pays; bf16 or fp16 can still be forced. On CUDA it is bf16 only where the GPU computes
    in it natively (Ampere and later): V100 and T4 emulate bf16 slowly, which torch counts as supported
    unless including_emulation=False."""
    if mode == "auto":
        if device.type != "cuda":
            return None
        mode = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast, or nothing with AMP off: a disabled autocast still costs host time every step."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# ---------------------------------------------------------------- --compile


def compile_model(model: nn.Module, mode: str, device: torch.device, accum_steps: int) -> str | None:
    """--compile MODE: torch.compile the model in place (Module.compile: its state_dict keys stay the plain
    module's, and it stays the one module a run trains, saves and evaluates). reduce-overhead adds CUDA
    graphs, which need a CUDA device: elsewhere the default mode runs, and the line returned says so."""
    if mode == "off":
        return None
    said = None
    if mode == "reduce-overhead" and device.type != "cuda":
        said = (f"--compile reduce-overhead: CUDA graphs need a CUDA device; on {device.type}, "
                "torch.compile's default mode runs instead")
        mode = "default"
    elif keeps_gradients(mode, device, accum_steps):
        # A graph's backward writes each gradient into a buffer it reuses; where p.grad is None, autograd
        # takes that buffer as p.grad and the next micro-batch's replay overwrites it (pytorch#169545).
        # Gradients that exist are added to instead: made here once, zeroed (not freed) after each step.
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
    model.compile(mode=mode)
    return said


def keeps_gradients(mode: str, device: torch.device, accum_steps: int) -> bool:
    """Whether the loop zeroes gradients rather than freeing them (see compile_model)."""
    return mode == "reduce-overhead" and device.type == "cuda" and accum_steps > 1


# ---------------------------------------------------------------- --ema


class Ema:
    """--ema: an exponential moving average of a model's weights and BatchNorm statistics, kept on the device
    in a copy of the model (`average`, in eval mode, never trained), which evaluation, best.pt and
    evaluate.py use. torch's AveragedModel reads its step count from the device twice a step; this keeps
    the count on the host and moves the average with torch's own get_ema_multi_avg_fn (one lerp for all)."""

    def __init__(self, model: nn.Module, decay: float):
        """The average of `model`, starting as a copy of it (its integer buffers, such as BatchNorm's
        batch count, stay the copy's: only floats are averaged)."""
        self.average, self.decay = copy.deepcopy(model).eval().requires_grad_(False), decay
        tensors = zip(self.average.state_dict().values(), model.state_dict().values(), strict=True)
        floats = [(a, m) for a, m in tensors if a.is_floating_point()]
        self.pairs = [a for a, _ in floats], [m for _, m in floats]  # the average's tensors, the model's

    def update(self, updates: int) -> None:
        """After an optimizer step that happened, the `updates`-th: the average moves toward the model,
        with the decay warmed up as timm's, min(decay, (1 + n) / (10 + n)), so early weights fade fast."""
        get_ema_multi_avg_fn(min(self.decay, (1 + updates) / (10 + updates)))(*self.pairs, None)
