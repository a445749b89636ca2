"""How the model computes beyond AMP (processes.amp_setup): --compile (the training forward and the
evaluation forward, each compiled once) and --ema (an average of the weights, evaluated and kept). train.py
imports this only where one of them is on."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from machinery.inputs import each, rows

# ---------------------------------------------------------------- --compile


# Evaluation's mode: its outputs go to the task's tally, which may keep them (AP, retrieval); a CUDA graph's
# outputs are overwritten by its next replay, so evaluation compiles without CUDA graphs.
WITHOUT_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def compile_model(model: nn.Module, evaluated: nn.Module, mode: str, device: torch.device, *,
                  notes: list | None = None, accum_steps: int = 1, batch_size: int = 0) -> tuple:
    """--compile MODE: what the loop calls to train (the model's training forward, which DDP wraps) and to
    evaluate (`evaluated`'s: the model, or the --ema average), each compiled whole, once: static shapes,
    evaluation's last smaller batch padded up to `batch_size`; and whether zero_grad frees the gradients.
    The modules stay as they are (their state_dict keys too): compile after a resume's restore, load weights
    into them in place. reduce-overhead's CUDA graphs need a CUDA device: elsewhere the default mode runs,
    said in `notes`."""
    if mode == "reduce-overhead" and device.type != "cuda":
        if notes is not None:
            notes.append(f"--compile reduce-overhead: CUDA graphs need a CUDA device; on {device.type}, "
                         "torch.compile's default mode runs instead")
        mode = "default"
    elif keeps_gradients(mode, device, accum_steps):
        # A graph's backward writes each gradient into a buffer it reuses; where p.grad is None, autograd
        # takes that buffer as p.grad and the next micro-batch's replay overwrites it (pytorch#169545).
        # Gradients that exist are added to instead: made here once, zeroed (not freed) after each step.
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
    training = torch.compile(training_forward, mode=mode, dynamic=False)
    evaluation = torch.compile(evaluation_forward, mode=WITHOUT_GRAPHS.get(mode, mode), dynamic=False)
    frees = not keeps_gradients(mode, device, accum_steps)
    return CompiledForward(model, training), CompiledForward(evaluated, evaluation, batch_size), frees


# Two functions with one body, each compiled: dynamo keeps its graphs per function (code object), so the
# training graph (grad mode, BatchNorm's batch statistics) and the evaluation graph (no_grad, running
# statistics) are each compiled once and never count as the other's recompile. A function of ours, rather
# than Module.compile, makes the whole model one frame: on torch 2.11 Module.compile left an nn.Sequential
# model no frame of its own (pytorch#150915), and only its submodules' (Residual.forward) were compiled.
def training_forward(model: nn.Module, inputs):
    return model(inputs)


def evaluation_forward(model: nn.Module, inputs):
    return model(inputs)


class CompiledForward(nn.Module):
    """`model` called through `compiled` (training_forward or evaluation_forward, compiled). The model is
    its one child: its parameters are the model's, train() and eval() reach it. `batch_size` > 0: a smaller
    batch is padded up to it (its last example repeated) and its outputs cut back, so every batch runs
    through the one graph compiled for that size."""

    def __init__(self, model: nn.Module, compiled, batch_size: int = 0):
        super().__init__()
        self.model, self.compiled, self.batch_size = model, compiled, batch_size

    def forward(self, inputs):
        if not self.batch_size:
            return self.compiled(self.model, inputs)
        n = rows(inputs)
        if n >= self.batch_size:
            return self.compiled(self.model, inputs)
        padded = each(lambda _, t: torch.cat([t, t[-1:].expand(self.batch_size - n, *t.shape[1:])]), inputs)
        return first_rows(self.compiled(self.model, padded), n, self.batch_size)


def first_rows(outputs, n: int, padded: int):
    """The first n rows of each output with `padded` rows (a tensor, or a tuple or dict of them)."""
    if isinstance(outputs, torch.Tensor):
        return outputs[:n] if outputs.ndim and len(outputs) == padded else outputs
    if isinstance(outputs, Mapping):
        return {key: first_rows(value, n, padded) for key, value in outputs.items()}
    if isinstance(outputs, (tuple, list)):
        return tuple(first_rows(value, n, padded) for value in outputs)
    return outputs


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

    def state_dict(self) -> dict:
        return self.average.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.average.load_state_dict(state)

    def update(self, updates: int) -> None:
        """After an optimizer step that happened, the `updates`-th: the average moves toward the model,
        with the decay warmed up as timm's, min(decay, (1 + n) / (10 + n)), so early weights fade fast."""
        get_ema_multi_avg_fn(min(self.decay, (1 + updates) / (10 + updates)))(*self.pairs, None)
