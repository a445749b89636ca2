"""A keypoints fork's task.py, TARGETS = "values": three points a face, (x, y) in pixel columns and rows,
[N, 6]; MSE loss, the mean distance in pixels as the main metric. Its images are cropped and flipped:
augmented_targets moves each point with its image, and a mirror image's left eye is its right one, so
unflipped_outputs maps the outputs of a mirror image back for `evaluate.py --predict --tta flip`. Its data is
forks/keypoints_data.py (face_points)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAME = "keypoints"
METRICS = ("loss", "distance")
TARGETS = "values"  # [N, 6]: left eye, right eye, nose, each (x, y)
MAIN_METRIC, HIGHER_IS_BETTER = "distance", False
SAVED_PICTURES = ()
SWAPPED = [2, 3, 0, 1, 4, 5]  # in a mirror image the left eye is the right one, and back; the nose stays


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """Each face's mean squared error over its six numbers, summed over the faces."""
    return F.mse_loss(outputs.float(), targets, reduction="sum") / outputs.shape[1]


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def mirrored(points: torch.Tensor, width: int) -> torch.Tensor:
    """Points as they lie in the mirror image: a pixel's column x at W - 1 - x, the eyes swapped."""
    flipped = points[:, SWAPPED]
    flipped[:, 0::2] = width - 1 - flipped[:, 0::2]
    return flipped


def augmented_targets(points: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor,
                      size: tuple[int, int]) -> torch.Tensor:
    """Each point moved as its image was: by the crop's shift (rows, columns), then mirrored where the
    image was flipped."""
    moved = points - shifts.flip(1).repeat(1, 3)  # (x, y) order: the columns' shift first
    return torch.where(flips[:, None], mirrored(moved, size[1]), moved)


def unflipped_outputs(outputs: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The points a model gives for mirror images, as they lie in the images themselves: mirrored back."""
    return mirrored(outputs, size[1])


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The loss, each point's distance from its target and the faces, summed on the device until result()."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info = cfg, info
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs) -> None:
        self.sums[0] += loss(outputs, targets, self.cfg, self.info).double()
        self.sums[1] += (outputs.float() - targets).view(-1, 3, 2).norm(dim=2).mean(1).sum().double()
        self.sums[2] += len(targets)

    def result(self, across) -> Evaluation:
        total, distance, count = across.sum(self.sums).tolist()
        return Evaluation({"loss": total / count, "distance": distance / count})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    return list(names), outputs.float().tolist()


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return "no pictures"
