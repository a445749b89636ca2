"""A class-imbalanced fork's task.py: cross-entropy weighted by each class's rarity in the training
data (data.DataInfo.class_counts), and balanced accuracy (the mean of the per-class recalls) as the
main metric. The loss is summed, and normalizer() gives the weights summed: every step then divides
by the weights of all its micro-batches and processes together, as one large batch would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from machinery.processes import ALONE

NAME = "weighted"
TARGETS = "classes"
METRICS = ("loss", "balanced_acc")
MAIN_METRIC, HIGHER_IS_BETTER = "balanced_acc", True
SAVED_PICTURES = ()


def class_weights(info) -> torch.Tensor:
    """Each class's weight: rare classes count more, 1 on average over the training examples."""
    counts = info.class_counts.float()
    return counts.sum() / (len(counts) * counts.clamp_min(1))


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), targets, weight=class_weights(info), reduction="sum")


def normalizer(targets: torch.Tensor, cfg, info) -> torch.Tensor:
    return class_weights(info)[targets].sum()


def show(name: str, value: float) -> str:
    return f"{value:.2%}" if name == "balanced_acc" else f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The weighted loss and weight sums, then each class's examples and those predicted right."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info, self.names = cfg, info, info.names
        self.sums = torch.zeros(2 + 2 * len(self.names), device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        n = len(self.names)
        self.sums[0] += loss(outputs, targets, self.cfg, self.info)
        self.sums[1] += normalizer(targets, self.cfg, self.info)
        self.sums[2:2 + n].index_add_(0, targets, torch.ones_like(targets, dtype=torch.float))
        right = (outputs.argmax(1) == targets).float()
        self.sums[2 + n:].index_add_(0, targets, right)

    def result(self, across=ALONE) -> Evaluation:
        values, n = across.sum(self.sums).tolist(), len(self.names)
        recalls = [r / c for c, r in zip(values[2:2 + n], values[2 + n:], strict=True) if c]
        return Evaluation({"loss": values[0] / values[1], "balanced_acc": sum(recalls) / len(recalls)})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    return ["class"], [[names[c]] for c in outputs.argmax(1).tolist()]


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return None
