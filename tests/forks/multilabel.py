"""A multi-label fork's task.py: each output is one yes/no label; BCE loss, micro-averaged F1 at a
threshold of 0.5 as the main metric. The fork tests copy this file over task.py; the machinery
tests import it. Its data is forks/multilabel_data.py, a dataset entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from machinery.logs import image_grid
from machinery.processes import ALONE

NAME = "multilabel"
METRICS = ("loss", "f1")
TARGETS = "values"  # one number per output
TARGETS_MOVE_WITH_IMAGES = False  # facts about the digit's number: a crop keeps them (digit_facts pads)
MAIN_METRIC, HIGHER_IS_BETTER = "f1", True
SAVED_PICTURES = ()
THRESHOLD = 0.5


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """Each example's mean binary cross-entropy over its labels, summed over the examples."""
    return F.binary_cross_entropy_with_logits(outputs.float(), targets, reduction="sum") / outputs.shape[1]


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def show(name: str, value: float) -> str:
    return f"{value:.2%}" if name == "f1" else f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The loss sum and, per label, true positives, false positives and false negatives."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info, self.names = cfg, info, info.names
        self.sums = torch.zeros(2 + 3 * len(self.names), device=device)  # loss, count, then tp, fp, fn

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        outputs, n = outputs.float(), len(self.names)
        predicted, truth = outputs.sigmoid() > THRESHOLD, targets > 0.5
        self.sums[0] += loss(outputs, targets, self.cfg, self.info)
        self.sums[1] += len(targets)
        self.sums[2:2 + n] += (predicted & truth).sum(0)
        self.sums[2 + n:2 + 2 * n] += (predicted & ~truth).sum(0)
        self.sums[2 + 2 * n:] += (~predicted & truth).sum(0)

    def result(self, across=ALONE) -> Evaluation:
        values, n = across.sum(self.sums).tolist(), len(self.names)
        tp, fp, fn = (values[2 + k * n: 2 + (k + 1) * n] for k in range(3))
        f1 = 2 * sum(tp) / max(2 * sum(tp) + sum(fp) + sum(fn), 1)
        per_label = {name: 2 * t / max(2 * t + p + m, 1) for name, t, p, m in zip(self.names, tp, fp, fn,
                                                                                    strict=True)}
        return Evaluation({"loss": values[0] / values[1], "f1": f1}, {"f1_per_label": per_label})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return [f"{name:>12}  f1 {value:.2%}" for name, value in val.details["f1_per_label"].items()]


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    """--predict's columns: the labels whose probability is above THRESHOLD, then each label's."""
    chances = outputs.float().sigmoid().tolist()
    return ["tags", *names], [[" ".join(n for n, p in zip(names, row, strict=True) if p > THRESHOLD), *row]
                              for row in chances]


def input_picture(inputs, targets, names, to_pixels):
    if to_pixels is None:
        return None
    captions = [",".join(n for n, on in zip(names, row, strict=True) if on > 0.5)
                for row in targets[:16].tolist()]
    return image_grid(to_pixels(inputs[:16]).cpu(), captions)


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return None if images else "the inputs are not images: no input pictures"
