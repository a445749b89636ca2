"""A fork's task.py whose targets come as a tuple, TARGETS = "any": each example's brightness in [0, 1)
and its bin of ten, `(levels [N], bins [N])`, as a detection fork gives (boxes, labels). The loss is the
cross-entropy of the bin, the metrics the share of right bins and the mean distance of the most likely
bin's middle from the brightness."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from machinery.processes import ALONE

NAME = "paired"
METRICS = ("loss", "acc", "distance")
TARGETS = "any"  # (levels, bins): a tuple, batched as a tuple
MAIN_METRIC, HIGHER_IS_BETTER = "acc", True
SAVED_PICTURES = ()
BINS = 10


def loss(outputs: torch.Tensor, targets: tuple, cfg, info) -> torch.Tensor:
    _, bins = targets
    return F.cross_entropy(outputs.float(), bins, reduction="sum")


def normalizer(targets: tuple, cfg, info) -> int:
    return len(targets[0])


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The summed loss, the right bins, the summed distance and the count, on the device until result()."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info = cfg, info
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, outputs: torch.Tensor, targets: tuple, inputs) -> None:
        levels, bins = targets
        guessed = outputs.argmax(1)
        self.sums[0] += loss(outputs, targets, self.cfg, self.info).double()
        self.sums[1] += (guessed == bins).sum()
        self.sums[2] += ((guessed + 0.5) / BINS - levels).abs().sum()
        self.sums[3] += len(levels)

    def result(self, across=ALONE) -> Evaluation:
        total, right, distance, count = across.sum(self.sums).tolist()
        return Evaluation({"loss": total / count, "acc": right / count, "distance": distance / count})


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
