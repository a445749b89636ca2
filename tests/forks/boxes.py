"""A boxes fork's task.py, TARGETS = "any": one box per image, (x1, y1, x2, y2) in pixel edges, four
outputs that are a box's numbers (the Source gives their count, not names); smooth L1 loss, mean IoU
as the main metric. Its images are cropped and flipped, and augmented_targets moves each box with its
image. Its data is forks/boxes_data.py (rectangles)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAME = "boxes"
METRICS = ("loss", "iou")
TARGETS = "any"  # [N, 4] float boxes
MAIN_METRIC, HIGHER_IS_BETTER = "iou", True
SAVED_PICTURES = ()


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """Each box's mean smooth L1 over its four numbers, summed over the boxes."""
    return F.smooth_l1_loss(outputs.float(), targets, reduction="sum") / 4


def normalizer(targets: torch.Tensor, cfg, info) -> int:
    return len(targets)


def augmented_targets(boxes: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor,
                      size: tuple[int, int]) -> torch.Tensor:
    """Each box moved as its image was: by the crop's shift (rows, columns), then mirrored where the
    image was flipped (an edge at x goes to W - x), and kept inside the image."""
    height, width = size
    moved = boxes - shifts.flip(1).repeat(1, 2)  # (x, y) order: the columns' shift first
    mirrored = torch.stack([width - moved[:, 2], moved[:, 1], width - moved[:, 0], moved[:, 3]], 1)
    moved = torch.where(flips[:, None], mirrored, moved)
    return torch.minimum(moved.clamp_min(0), torch.tensor([width, height] * 2, device=boxes.device))


def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each pair of boxes' intersection over union."""
    sides = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp_min(0)
    overlap = sides.prod(1)

    def area(box):
        return (box[:, 2:] - box[:, :2]).clamp_min(0).prod(1)

    return overlap / (area(a) + area(b) - overlap).clamp_min(1e-6)


def show(name: str, value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Evaluation:
    metrics: dict[str, float]
    details: dict = field(default_factory=dict)


class Tally:
    """The loss, the IoU and the boxes summed on the device until result()."""

    def __init__(self, cfg, info, device: torch.device):
        self.cfg, self.info = cfg, info
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs) -> None:
        self.sums[0] += loss(outputs, targets, self.cfg, self.info).double()
        self.sums[1] += iou(outputs.float(), targets).sum().double()
        self.sums[2] += len(targets)

    def result(self, across) -> Evaluation:
        total, overlap, count = across.sum(self.sums).tolist()
        return Evaluation({"loss": total / count, "iou": overlap / count})


def describe(result: Evaluation, split: str = "val") -> str:
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    return []


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    return ["x1", "y1", "x2", "y2"], outputs.float().tolist()


def input_picture(inputs, targets, names, to_pixels):
    return None


def pictures(val: Evaluation, names, to_pixels) -> dict:
    return {}


def pictures_note(images: bool) -> str | None:
    return "no pictures"
