"""A multi-label fork's task.py measured by macro average precision (mAP), a ranking metric: it needs
every example's scores, so its Tally keeps them and gathers them over torchrun's processes (where a sum
of each process's figures would not be the split's). Its Tally is the one docs/your_data.md shows. Its
data is forks/multilabel_data.py (digit_facts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAME = "multilabel_ap"
METRICS = ("loss", "map")
TARGETS = "values"  # one 0/1 number per label
TARGETS_MOVE_WITH_IMAGES = False  # facts about the digit's number: a crop keeps them (digit_facts pads)
MAIN_METRIC, HIGHER_IS_BETTER = "map", True
SAVED_PICTURES = ()


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """Each example's mean binary cross-entropy over its labels, summed over the examples."""
    return F.binary_cross_entropy_with_logits(outputs.float(), targets, reduction="sum") / outputs.shape[1]


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


def average_precision(scores: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Each label's AP over [N, labels] scores: the precision at each of its positives, ranked by score,
    averaged (nan for a label with none)."""
    ranked = truth.gather(0, scores.sort(dim=0, descending=True, stable=True).indices).float()
    precision = ranked.cumsum(0) / torch.arange(1, len(ranked) + 1, device=ranked.device)[:, None]
    return (precision * ranked).sum(0) / ranked.sum(0)


class Tally:
    """The loss sum on the device, and each example's scores and labels, gathered whole for AP."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info, self.names = cfg, info, info.names
        self.sums = torch.zeros(2, device=device)  # the loss, the examples
        self.scores, self.truth = [], []  # a batch each, on the device

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs) -> None:
        self.sums[0] += loss(outputs, targets, self.cfg, self.info)
        self.sums[1] += len(targets)
        self.scores.append(outputs.float())
        self.truth.append(targets > 0.5)

    def result(self, across) -> Evaluation:
        total, count = across.sum(self.sums).tolist()
        scores = across.gather(torch.cat(self.scores))  # every process's rows: the whole split's
        per_label = average_precision(scores, across.gather(torch.cat(self.truth))).tolist()
        known = [ap for ap in per_label if ap == ap]  # a label no example has: no AP
        return Evaluation({"loss": total / count, "map": sum(known) / max(len(known), 1)},
                          {"ap_per_label": dict(zip(self.names, per_label, strict=True)),
                           "examples": len(scores)})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return [f"{name:>12}  ap {value:.4f}" for name, value in val.details["ap_per_label"].items()]


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    """--predict's columns: each label's probability."""
    return list(names), outputs.float().sigmoid().tolist()


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return "no pictures"
