"""The task the machinery tests train with, whatever task.py holds: single-label classification, its loss
summed over the examples (or the pixels a crop's padding did not add), accuracy as the main metric, the
top classes as --predict's columns, and no pictures.

It is a deliberate copy of the default task's core rather than an import of task.py: a fork replaces
task.py, and the tests of resume, accumulation, faults, torchrun and signals must stay green there.
conftest.py puts this module in place of `task` for the tests and for the scripts they start (through
tests/launch.py); only the default task's own tests read task.py (conftest.TEMPLATE_TASK).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from contract import IGNORE_INDEX

NAME = "machinery"
TARGETS = "classes"
METRICS = ("loss", "acc")
MAIN_METRIC, HIGHER_IS_BETTER = "acc", True
SAVED_PICTURES = ()


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, label_smoothing=cfg.label_smoothing, ignore_index=IGNORE_INDEX,
                           reduction="sum")


def normalizer(targets: torch.Tensor, cfg, info) -> int | torch.Tensor:
    return len(targets) if targets.ndim == 1 else (targets != IGNORE_INDEX).sum()


def show(name: str, value: float) -> str:
    return f"{value:.2%}" if name == "acc" else f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The loss sum, its normalizer, and the examples (pixels) right and counted, on the device."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info = cfg, info
        self.sums = torch.zeros(4, device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        outputs, counted = outputs.float(), targets != IGNORE_INDEX
        self.sums[0] += loss(outputs, targets, self.cfg, self.info)
        self.sums[1] += normalizer(targets, self.cfg, self.info)
        self.sums[2] += ((outputs.argmax(1) == targets) & counted).sum()
        self.sums[3] += counted.sum()

    def result(self, reduce=lambda sums: sums) -> Evaluation:
        total, count, right, counted = reduce(self.sums).tolist()
        return Evaluation({"loss": total / count, "acc": right / counted})


def describe(val: Evaluation) -> str:
    return "  ".join(f"val {name} {show(name, val.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    """The most likely class and its probability, then the next ones, top_k in all."""
    k = min(top_k, len(names))
    probabilities, classes = outputs.float().softmax(1).topk(k, 1)
    header = ["class", "probability", *(f"{what}_{i}" for i in range(2, k + 1)
                                         for what in ("class", "probability"))]
    rows = [[value for c, p in zip(row, chances, strict=True) for value in (names[c], p)]
            for row, chances in zip(classes.tolist(), probabilities.tolist(), strict=True)]
    return header, rows


def input_picture(inputs, targets, names, pixels):
    return None


def pictures(val: Evaluation, names, pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return None
