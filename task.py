"""The task: what the model's outputs mean. To train for another task, this is the file to edit.

It holds the loss, the metrics an evaluation reports, the pictures TensorBoard shows, and what a
prediction is (a row of --predict's predictions.csv). Every path that computes a loss or a metric
calls these: the training loop, `--lr find` and `python lr_find.py`, evaluation, `--evaluate`, the
benchmarks. The rest of the template (resume, torchrun, checkpoints, logs) reads only the names
defined here, so it works for any task that defines them. This one is single-label classification:
cross-entropy, accuracy, a confusion matrix and the most confidently wrong images. tests/forks/
holds two other tasks written this way (regression, multi-label), which the machinery tests run too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from logs import confusion_picture, image_grid

NAME = "classification"  # saved with each sweep and checkpoint: --lr auto and --resume refuse another's
METRICS = ("loss", "acc")  # TensorBoard val/<name>, summary.json val_<name>, in this order
MAIN_METRIC, HIGHER_IS_BETTER = "acc", True  # best.pt is the checkpoint with the best val acc
SAVED_PICTURES = ("confusion",)  # also written as confusion.png (eval_confusion.png by --evaluate)
WORST_SHOWN = 16  # the most confidently wrong validation images in their picture
INPUTS_SHOWN = 32  # training images in the picture of what the model receives


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg) -> torch.Tensor:
    """The batch's mean loss: what training minimizes, lr_find sweeps, and evaluation reports."""
    return F.cross_entropy(outputs, targets, label_smoothing=cfg.label_smoothing)


def show(name: str, value: float) -> str:
    """How a metric is printed."""
    return f"{value:.2%}" if name == "acc" else f"{value:.4f}"


@dataclass
class Evaluation:
    """One pass over the validation split, read from the device once (in Tally.result)."""

    metrics: dict[str, float]  # every name in METRICS
    details: dict = field(default_factory=dict)  # more for summary.json and eval.json
    worst: tuple | None = None  # (confidence, inputs, targets, predictions), still on the device


class Tally:
    """Loss sum, confusion matrix and the most confidently wrong examples of one validation pass,
    kept on the device: a read per batch would wait for the device every batch. Under torchrun the
    counts are summed over processes; the wrong examples are this process's shard's."""

    def __init__(self, cfg, names: list[str], device: torch.device, keep: int = WORST_SHOWN):
        self.cfg, self.names, self.keep = cfg, names, keep
        self.sums = torch.zeros(1 + len(names) ** 2, device=device)  # the loss sum, then the confusion matrix
        self.worst: tuple | None = None

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        outputs, n = outputs.float(), len(self.names)
        self.sums[0] += loss(outputs, targets, self.cfg) * len(targets)
        predicted = outputs.argmax(1)
        self.sums[1:].index_add_(0, targets * n + predicted, torch.ones_like(targets, dtype=torch.float))
        confidence = outputs.softmax(1).amax(1).masked_fill_(predicted == targets, -1.0)  # -1: right
        top = confidence.topk(min(self.keep, len(targets))).indices
        batch = (confidence[top], inputs[top], targets[top], predicted[top])
        if self.worst is not None:
            batch = tuple(torch.cat(pair) for pair in zip(self.worst, batch, strict=True))
            top = batch[0].topk(min(self.keep, len(batch[0]))).indices
            batch = tuple(t[top] for t in batch)
        self.worst = batch

    def result(self, reduce=lambda sums: sums) -> Evaluation:
        """The metrics, after `reduce` (a sum over torchrun's processes) of the device's sums."""
        values, n = reduce(self.sums).tolist(), len(self.names)
        confusion = [[round(v) for v in values[1 + r * n: 1 + (r + 1) * n]] for r in range(n)]
        count = sum(map(sum, confusion))
        correct = sum(confusion[i][i] for i in range(n))
        per_class = [row[i] / sum(row) if sum(row) else None for i, row in enumerate(confusion)]
        return Evaluation({"loss": values[0] / count, "acc": correct / count},
                          {"per_class_acc": dict(zip(self.names, per_class, strict=True)),
                           "confusion": confusion}, self.worst)


def describe(val: Evaluation) -> str:
    """The line each epoch ends with: "val loss 0.1234  val acc 96.00%"."""
    return "  ".join(f"val {name} {show(name, val.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    """--evaluate's lines below `describe`'s: each class's accuracy."""
    return [f"{name:>12}  {'no examples' if acc is None else show('acc', acc)}"
            for name, acc in val.details["per_class_acc"].items()]


def predictions(outputs: torch.Tensor, names: list[str], top_k: int) -> tuple[list[str], list[list]]:
    """--predict's columns (after `file`) and a row per input: the most likely class and its softmax
    probability, then the next most likely ones, top_k in all (at most one per class)."""
    k = min(top_k, len(names))
    probabilities, classes = outputs.float().softmax(1).topk(k, 1)
    header = ["class", "probability", *(f"{what}_{i}" for i in range(2, k + 1)
                                         for what in ("class", "probability"))]
    rows = [[value for c, p in zip(row, chances, strict=True) for value in (names[c], p)]
            for row, chances in zip(classes.tolist(), probabilities.tolist(), strict=True)]
    return header, rows


# ---------------------------------------------------------------- pictures
# `pixels` turns a batch as the model receives it back into [0, 1] images; it is None where the
# inputs are not images, and the pictures that show inputs are skipped.

def input_picture(inputs: torch.Tensor, targets: torch.Tensor, names: list[str], pixels):
    """A training batch as the model receives it (after crop, flip, resize), each with its label."""
    if pixels is None:
        return None
    captions = [names[t] for t in targets[:INPUTS_SHOWN].tolist()]
    return image_grid(pixels(inputs[:INPUTS_SHOWN]).cpu(), captions)


def pictures(val: Evaluation, names: list[str], pixels) -> dict:
    """After each evaluation: the confusion matrix and the most confidently wrong images."""
    shown = {"confusion": confusion_picture(val.details["confusion"], names)}
    if pixels is not None and val.worst is not None:
        confidence, inputs, targets, predicted = val.worst
        wrong = [i for i, c in enumerate(confidence.tolist()) if c >= 0]  # -1 marks right answers
        if wrong:
            captions = [f"{names[t]} as {names[p]} {c:.0%}" for c, t, p in zip(
                confidence[wrong].tolist(), targets[wrong].tolist(), predicted[wrong].tolist(), strict=True)]
            shown["most_confidently_wrong"] = image_grid(pixels(inputs).cpu()[wrong], captions)
    return shown


def pictures_note(images: bool) -> str | None:
    """Said once at start-up when some pictures cannot be drawn for this data."""
    return None if images else "the inputs are not images: TensorBoard shows no input or wrong-input pictures"
