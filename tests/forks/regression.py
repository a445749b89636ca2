"""A regression fork's task.py: MSE loss, mean absolute error as the main metric (lower is better).

The fork tests copy this file over task.py in a copy of the template; the machinery tests import it
directly and pass it to train.train. Its data is forks/regression_data.py, a dataset entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from machinery.logs import image_grid
from machinery.processes import ALONE

NAME = "regression"
METRICS = ("loss", "mae")
TARGETS = "values"  # one number per output
TARGETS_MOVE_WITH_IMAGES = True  # a position: a crop or flip moves it, and this task says not how (no
# augmented_targets), so a Source's pad or flip is refused, and so is evaluate.py --predict --tta flip
MAIN_METRIC, HIGHER_IS_BETTER = "mae", False
SAVED_PICTURES = ()


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """Each example's mean squared error over the outputs, summed over the examples."""
    return F.mse_loss(outputs.float(), targets, reduction="sum") / outputs.shape[1]


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """Squared and absolute error sums and the count, on the device until result()."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info, self.names = cfg, info, info.names
        self.sums = torch.zeros(3 + len(self.names), device=device)  # squared, absolute, count, per output

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        error = outputs.float() - targets
        self.sums[0] += error.pow(2).mean(1).sum()
        self.sums[1] += error.abs().mean(1).sum()
        self.sums[2] += len(targets)
        self.sums[3:] += error.abs().sum(0)

    def result(self, across=ALONE) -> Evaluation:
        squared, absolute, count, *per_output = across.sum(self.sums).tolist()
        each = {name: value / count for name, value in zip(self.names, per_output, strict=True)}
        return Evaluation({"loss": squared / count, "mae": absolute / count}, {"mae_per_output": each})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return [f"{name:>12}  mae {value:.4f}" for name, value in val.details["mae_per_output"].items()]


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    """--predict's columns: the number predicted for each output."""
    return list(names), outputs.float().tolist()


def input_picture(inputs, targets, names, to_pixels):
    if to_pixels is None:
        return None
    captions = [" ".join(f"{v:.2f}" for v in row) for row in targets[:16].tolist()]
    return image_grid(to_pixels(inputs[:16]).cpu(), captions)


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return None if images else "the inputs are not images: no input pictures"
