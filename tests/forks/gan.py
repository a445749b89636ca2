"""A GAN fork's task.py: two networks trained in turn (its model: forks/gan_model.py, whose turns() names
them), on the digits' images, their classes unused. The loss scores the discriminator's logits in each
turn; evaluation measures how well the discriminator tells real images from generated ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAME = "gan"
METRICS = ("loss", "d_acc")
TARGETS = "any"  # the digits' class ids, unused: a GAN's targets are "real" and "generated"
TARGETS_MOVE_WITH_IMAGES = False  # a crop leaves an image real
MAIN_METRIC, HIGHER_IS_BETTER = "loss", False  # the discriminator's val loss: a fork may rank otherwise
SAVED_PICTURES = ()


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info, turn: str | None = None) -> torch.Tensor:
    """The discriminator's turn (and eval mode): real images' logits, then generated ones', each scored as
    what it is. The generator's turn: its images scored as real (the non-saturating GAN loss). Summed."""
    real = torch.ones_like(outputs, dtype=torch.float32)
    if turn != "generator":
        real[len(targets):] = 0
    return F.binary_cross_entropy_with_logits(outputs.float(), real, reduction="sum")


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def show(name: str, value: float) -> str:
    return f"{100 * value:.2f}%" if name == "d_acc" else f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The discriminator's loss and right calls over real and generated images, summed on the device."""

    def __init__(self, cfg, info, device: torch.device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs) -> None:
        real = torch.arange(len(outputs), device=outputs.device)[:, None] < len(targets)
        self.sums[0] += loss(outputs, targets, None, None)
        self.sums[1] += ((outputs > 0) == real).sum()
        self.sums[2] += len(outputs)

    def result(self, across) -> Evaluation:
        total, right, n = across.sum(self.sums).tolist()
        return Evaluation({"loss": total / n, "d_acc": right / n})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    return ["real_logit"], [[f"{v:.4f}"] for v in outputs[:len(outputs) // 2, 0].tolist()]


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return "no pictures"
