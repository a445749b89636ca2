"""A sequence fork's task.py, TARGETS = "any": [N, T] token ids in, the same tokens reversed out. Its
model (forks/reversal_model.py) gives logits [N, tokens, T] in training and, in eval mode, token ids [N, T]
as a greedy decode does: the loss takes both (the start-up check runs the model in eval mode, then the
loss), and the Tally measures the decoded ids. Its data is forks/reversal_data.py (reversed_tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAME = "reversal"
METRICS = ("loss", "acc")
TARGETS = "any"  # [N, T] ids; "classes" would hold the eval-mode ids [N, T] to [N, tokens, T] logits' shape
MAIN_METRIC, HIGHER_IS_BETTER = "acc", True
SAVED_PICTURES = ()


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """Training's logits [N, tokens, T]: each token's cross-entropy, summed. Eval mode's decoded ids [N, T]:
    the wrong tokens, counted (one finite number, as the start-up check wants; nothing trains on it)."""
    if outputs.ndim == 3:
        return F.cross_entropy(outputs.float(), targets, reduction="sum")
    return (outputs != targets).sum().float()


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return targets.numel()


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The wrong tokens of the decoded ids (the eval-mode outputs) and the tokens, summed on the device: the
    "loss" it reports is the share of wrong tokens, not training's cross-entropy."""

    def __init__(self, cfg, info, device: torch.device):
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs) -> None:
        self.sums[0] += (outputs != targets).sum()
        self.sums[1] += targets.numel()

    def result(self, across) -> Evaluation:
        wrong, tokens = across.sum(self.sums).tolist()
        return Evaluation({"loss": wrong / tokens, "acc": 1 - wrong / tokens})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    """The decoded tokens of each sequence."""
    return ["tokens"], [[" ".join(names[i] for i in row)] for row in outputs.long().tolist()]


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return "no pictures"
