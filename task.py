"""The task: what the model's outputs mean, the file to edit to train for another task: the loss, the metrics,
the pictures, what a prediction is. Every path that computes a loss or a metric calls these; the rest of the
template reads only the names defined here (docs/your_data.md lists them). This one is single-label
classification; tests/forks/ holds other tasks written this way."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from machinery.contract import IGNORE_INDEX
from machinery.inputs import joined, take
from machinery.logs import confusion_picture, image_grid
from machinery.processes import ALONE

NAME = "classification"  # saved with each sweep and checkpoint: --lr auto and --resume refuse another's
TARGETS = "classes"  # what loss() takes: class ids, one per example or per pixel (contract.py checks them)
METRICS = ("loss", "acc")  # TensorBoard val/<name>, summary.json val_<name>, in this order
MAIN_METRIC, HIGHER_IS_BETTER = "acc", True  # best.pt is the checkpoint with the best val acc
SAVED_PICTURES = ("confusion",)  # also written as confusion.png (eval_confusion.png by evaluate.py)
WORST_SHOWN = 16  # the most confidently wrong validation images in their picture
INPUTS_SHOWN = 32  # training images in the picture of what the model receives


def loss(outputs: torch.Tensor, targets: torch.Tensor, cfg, info) -> torch.Tensor:
    """The batch's loss summed over what `normalizer` counts, not a mean: training, lr_find and evaluation
    divide once by the normalizers of all the batches they take together, so weighted means stay exact."""
    return F.cross_entropy(outputs, targets, label_smoothing=cfg.label_smoothing, ignore_index=IGNORE_INDEX,
                           reduction="sum")


def normalizer(targets: torch.Tensor, cfg, info) -> int | torch.Tensor:
    """What loss() sums over: the examples; per-pixel targets count their pixels but a crop's padding (a
    tensor, as it depends on the values: never read on the host)."""
    return len(targets) if targets.ndim == 1 else (targets != IGNORE_INDEX).sum()


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
    """One evaluation's sums, confusion matrix and most confidently wrong examples, kept on the device (a read
    a batch would wait for it); under torchrun each process tallies its shard and result() combines them."""

    def __init__(self, cfg, info, device: torch.device, keep: int = WORST_SHOWN):
        self.cfg, self.info, self.names, self.keep = cfg, info, info.names, keep
        self.loss = torch.zeros((), device=device)
        # the normalizer's sum, then the confusion matrix: in int64, as float32 stops counting at 2^24
        self.counts = torch.zeros(1 + len(self.names) ** 2, dtype=torch.int64, device=device)
        self.worst: tuple | None = None

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        outputs, n = outputs.float(), len(self.names)
        self.loss += loss(outputs, targets, self.cfg, self.info)
        self.counts[0] += normalizer(targets, self.cfg, self.info)
        predicted, counted = outputs.argmax(1), targets != IGNORE_INDEX
        cells = torch.where(counted, targets * n + predicted, 0).flatten()  # indexing by a mask would sync
        self.counts[1:].index_add_(0, cells, counted.flatten().long())
        if targets.ndim == 1:  # one class per example: its confidence says which were wrong
            self._keep_worst(outputs, targets, inputs, predicted)

    def _keep_worst(self, outputs, targets, inputs, predicted) -> None:
        confidence = outputs.softmax(1).amax(1).masked_fill_(predicted == targets, -1.0)  # -1: right
        batch = self._top((confidence, inputs, targets, predicted))  # inputs: a tensor, or several
        if self.worst is not None:
            batch = self._top(tuple(joined(pair) for pair in zip(self.worst, batch, strict=True)))
        self.worst = batch

    def _top(self, kept: tuple) -> tuple:
        """The `keep` most confident of `kept` (confidence, inputs, targets, predictions), most first."""
        top = kept[0].topk(min(self.keep, len(kept[0]))).indices
        return tuple(take(x, top) for x in kept)

    def result(self, across=ALONE) -> Evaluation:
        """The metrics, the tallies summed (and the wrong examples gathered) `across` the run's processes."""
        total, (count, *cells) = across.sum(self.loss).item(), across.sum(self.counts).tolist()
        n = len(self.names)
        confusion = [cells[r * n: (r + 1) * n] for r in range(n)]
        correct = sum(confusion[i][i] for i in range(n))
        per_class = [row[i] / sum(row) if sum(row) else None for i, row in enumerate(confusion)]
        return Evaluation({"loss": total / count, "acc": correct / sum(map(sum, confusion))},
                          {"per_class_acc": dict(zip(self.names, per_class, strict=True)),
                           "confusion": confusion},
                          None if self.worst is None else self._top(tuple(map(across.gather, self.worst))))


def describe(result: Evaluation, split: str = "val") -> str:
    """The line each epoch ends with, "val loss 0.1234  val acc 96.00%", and evaluate.py's, of its split."""
    return "  ".join(f"{split} {name} {show(name, result.metrics[name])}" for name in METRICS)


def report(val: Evaluation) -> list[str]:
    """evaluate.py's lines below `describe`'s: each class's accuracy."""
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
# `to_pixels` turns a batch as the model receives it back into [0, 1] images; it is None where the
# inputs are not images, and the pictures that show inputs are skipped.

def input_picture(inputs, targets: torch.Tensor, names: list[str], to_pixels):
    """A training batch as the model receives it, each with its label (per-pixel: the classes it holds)."""
    if to_pixels is None:
        return None
    shown = targets[:INPUTS_SHOWN].cpu()
    captions = [names[t] for t in shown.tolist()] if shown.ndim == 1 else [
        ", ".join(names[c] for c in mask[mask != IGNORE_INDEX].unique().tolist()) for mask in shown]
    return image_grid(to_pixels(inputs)[:INPUTS_SHOWN].cpu(), captions)  # several inputs: the first image


def pictures(val: Evaluation, names: list[str], to_pixels) -> dict:
    """After each evaluation: the confusion matrix and the most confidently wrong images."""
    shown = {"confusion": confusion_picture(val.details["confusion"], names)}
    if to_pixels is not None and val.worst is not None:
        confidence, inputs, targets, predicted = val.worst
        wrong = [i for i, c in enumerate(confidence.tolist()) if c >= 0]  # -1 marks right answers
        if wrong:
            captions = [f"{names[t]} as {names[p]} {c:.0%}" for c, t, p in zip(
                confidence[wrong].tolist(), targets[wrong].tolist(), predicted[wrong].tolist(), strict=True)]
            shown["most_confidently_wrong"] = image_grid(to_pixels(inputs).cpu()[wrong], captions)
    return shown


def pictures_note(images: bool) -> str | None:
    """Said once at start-up when some pictures cannot be drawn for this data."""
    return None if images else "the inputs are not images: TensorBoard shows no input or wrong-input pictures"
