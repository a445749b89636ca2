"""A binned (ordinal) regression fork's task.py, TARGETS = "any": one float target in [0, 1) per example,
10 outputs, one per bin; the loss is the cross-entropy of the target's bin, the main metric the share of
examples whose bin is the most likely one. The data gives [N] floats: no repeat per output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from machinery.processes import ALONE

NAME = "binned"
METRICS = ("loss", "acc")
TARGETS = "any"  # [N] floats, read here as bins
MAIN_METRIC, HIGHER_IS_BETTER = "acc", True
SAVED_PICTURES = ()
BINS = 10


def bins(targets: torch.Tensor) -> torch.Tensor:
    return (targets.float() * BINS).long().clamp(0, BINS - 1)


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), bins(targets), reduction="sum")


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The summed loss, the right bins and the count, on the device until result()."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info = cfg, info
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        self.sums[0] += loss(outputs, targets, self.cfg, self.info).double()
        self.sums[1] += (outputs.argmax(1) == bins(targets)).sum()
        self.sums[2] += len(targets)

    def result(self, across=ALONE) -> Evaluation:
        total, right, count = across.sum(self.sums).tolist()
        return Evaluation({"loss": total / count, "acc": right / count})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    return ["bin"], [[b] for b in outputs.argmax(1).tolist()]


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return "no input pictures"
