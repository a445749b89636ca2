"""The data contract: what a dataset must be for the task and the model, checked once at start-up,
before any file is written. A fork whose data, task and model do not fit stops here in one line
that names the shapes, dtypes or values, never with numbers that are quietly wrong later.

task.TARGETS says what the task's loss takes:
- "classes": integer class ids of any dtype, read as int64, in [0, classes): one per example ([N]),
  or one per position ([N, *S], say per pixel), where the model gives [N, classes, *S];
- "values": numbers, read as float32, shaped as the model's outputs; [N] is read as [N, 1] where
  the model has one output;
- "any": as the data gives them, to the task's loss and Tally (a binned regression's [N] floats for
  10 outputs, say); the check is the one batch: the loss of two examples is one finite number.
Targets whose last two dimensions are the images' height and width are dense: crops and flips move
them with their images, and a crop's padding gets IGNORE_INDEX, which the task's loss and metrics skip.
One class id or one row of values per example stays as it is. Others (TARGETS = "any": boxes, say) follow
crops and flips only by the task's augmented_targets (image_steps.py refuses them otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from configs import UserError, first_line
from machinery.inputs import described, each, members, named, rows

KINDS = ("classes", "values", "any")  # what task.TARGETS may say
IGNORE_INDEX = -100  # a dense class target that counts for nothing (torch's cross_entropy skips it)
SHOWN = 4  # bad values named in a refusal


@dataclass
class Targets:
    """What the check found: how batches treat the targets, and what the task may want to know."""

    kind: str  # task.TARGETS
    dense: bool  # one per pixel: the image steps move them too
    class_counts: torch.Tensor | None  # training examples (pixels, if dense) per class; None: unknown
    class_ids: torch.Tensor | None  # each training example's class (one per example), for balanced sampling
    per_example: bool = False  # one class id or one row of values per example: crops and flips keep them
    follow: Callable | None = None  # the task's augmented_targets: how its targets follow crops and flips


def check_splits(splits: dict, names: list[str], kind: str, image_size: tuple | None,
                 collate: Callable) -> tuple[Targets, str]:
    """Each split's targets read as the task takes them (`splits` maps a split's name to an (inputs,
    targets) pair, converted in place, or to a Dataset, whose first example is batched alone by `collate`)
    and checked; returns what was found, and a line saying what was checked. `image_size`: the images'
    (H, W), or None where inputs are not images."""
    if kind not in KINDS:
        raise UserError(f"task.TARGETS is {kind!r}; it says what the loss takes: one of {', '.join(KINDS)}")
    checked = []
    for split, pair in splits.items():
        listed = pair[1] if isinstance(pair, tuple) else getattr(pair, "targets", None)  # as ImageFolder
        whole = listed is not None  # else a Dataset's first item's targets stand for the rest
        first = None if whole else collate([pair[0]])[1]  # a batch of one: its targets as batches hold them
        first = tuple(first) if isinstance(first, list) else first  # default_collate's list of a tuple
        targets = _read_as(listed if whole else first, kind, len(names), split)
        if isinstance(pair, tuple):  # tensors: converted once here, checked whole
            _check_finite(split, pair[0], targets)
            splits[split] = (pair[0], targets)
        _check_values(targets, kind, len(names), split)
        checked.append(f"{rows(targets)} {split}" if whole else f"{split}'s first")
        if split == "train":  # dense: one target per pixel, its last two dimensions the images' (H, W)
            dense = kind != "any" and image_size is not None and tuple(targets[0].shape[-2:]) == tuple(
                image_size)
            ids = targets if whole and kind == "classes" else None
            one_each = targets.ndim == 2 if kind == "values" else targets[0].numel() == 1  # id, or values
            per_example = kind != "any" and one_each
    counts = None if ids is None else torch.bincount(ids[ids != IGNORE_INDEX], minlength=len(names))
    what = {"classes": f"class ids in [0, {len(names)})", "values": f"values for {len(names)} outputs",
            "any": "as the data gives them (TARGETS = \"any\")"}[kind]
    per_position = ids is not None and ids.ndim > 1  # tokens' ids, or pixels': no one class an example
    said = f"targets checked: {', '.join(checked)}, {what}{', one per pixel' if dense else ''}"
    return Targets(kind, dense, counts, None if per_position else ids, per_example), said


def check_model(model: nn.Module, batches, task, cfg, info) -> str:
    """The split's first two examples through the model, in eval mode and without gradients (nothing
    it holds changes), then through the task's loss: a forward that fails, outputs that do not fit the
    targets, or a loss that is not one number is one line naming them. Returns what was seen."""
    inputs, targets = batches.first(2)
    given = described(inputs)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except Exception as err:  # any layer's complaint: wrong channels, dtype, rank, size
        raise UserError(f"the model {cfg.model} cannot take this data's inputs ({given}): {first_line(err)}; "
                        "add a model for these inputs to MODELS in models.py and pass --model NAME") from None
    finally:
        model.train(training)
    if not isinstance(outputs, torch.Tensor):
        raise UserError(f"the model {cfg.model} returns a {type(outputs).__name__}, not a tensor of outputs")
    classes, shape = batches.targets.kind == "classes", list(outputs.shape)
    want = [shape[0], *shape[2:]] if classes else shape
    free = batches.targets.kind == "any"  # the task reads them as it likes: the loss below is the check
    if not free and not (outputs.ndim >= 2 and shape[1] == len(info.names) and list(targets.shape) == want):
        each = "a class id per example (or per position)" if classes else "one value per output"
        raise UserError(f"the model {cfg.model} gives outputs {shape} for {given} inputs, and the targets "
                        f"are {list(targets.shape)}: the task takes {each}, {len(info.names)} outputs (one "
                        "per name in the dataset's Source); make the model's outputs or the targets fit")
    loss = task.loss(outputs.float(), targets, cfg, info)
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
        what = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserError(f"task.loss returns {what} for a batch of 2: it must return one number, the batch's "
                        "summed loss (normalizer() says what it is divided by)")
    if free and not torch.isfinite(loss):
        raise UserError(f"task.loss gives {loss.item()} for the first two examples ({shape} outputs, "
                        f"{described(targets)} targets): with TARGETS = \"any\" that is the check, so make "
                        "the loss read these targets")
    return f"{cfg.model} takes {given} and gives {shape}"


def as_taken(targets: torch.Tensor, kind: str) -> torch.Tensor:
    """Targets as the task (`kind`: task.TARGETS) takes them: int64 class ids, or float32 values, [N] as
    [N, 1], or as they are. Tensor splits already are (no op then); a Dataset's batches are converted here."""
    if kind == "any":
        return targets
    if kind == "values" and targets.ndim == 1:
        targets = targets[:, None]
    return targets.to(torch.int64 if kind == "classes" else torch.float32)


# ---------------------------------------------------------------- the checks


def _read_as(targets, kind: str, outputs: int, split: str):
    """Targets in the dtype and shape the task takes, or one line saying why they cannot be. "any" takes a
    tuple or dict of tensors too (boxes and their labels, say): kept so, each one a row per example."""
    parts = list(targets.values() if isinstance(targets, Mapping) else targets) if isinstance(
        targets, (Mapping, tuple)) else []
    if parts and all(isinstance(t, torch.Tensor) for t in parts):  # several tensors
        if kind != "any":
            wanted = "class ids" if kind == "classes" else "values"
            raise UserError(f"the {split} targets are a {type(targets).__name__} of {len(parts)} tensors, "
                            f"and the task takes {wanted}, one tensor; give one, or set TARGETS = \"any\" in "
                            "task.py for a loss that reads them so")
        return each(lambda _, t: t, targets)
    targets = torch.as_tensor(targets)
    if kind == "classes":
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise UserError(f"the task takes class ids, and the {split} targets are {_dtype(targets)}: give "
                            "the dataset integer class ids (or set TARGETS = \"values\" in task.py)")
    elif kind == "values" and targets.ndim == 1 and outputs != 1:
        raise UserError(f"the task takes {outputs} values per example (one per name in the dataset's "
                        f"Source), and the {split} targets are {list(targets.shape)}: one each")
    return as_taken(targets, kind)


def _check_finite(split: str, inputs, targets: torch.Tensor) -> None:
    """Each input tensor (machinery/inputs.py) and the targets: a row per example, finite numbers."""
    named_tensors = [(named(key), t) for key, t in members(inputs).items()]
    targets_named = [(named(key).replace("inputs", "targets"), t) for key, t in members(targets).items()]
    for what, t in [*named_tensors, *targets_named]:
        if len(t) != rows(targets):
            raise UserError(f"the {split} {what} hold {len(t)} rows and the targets {rows(targets)}: give "
                            "each input one row per example")
        if t.is_floating_point() and not (finite := torch.isfinite(t)).all():
            bad = (~finite).reshape(len(t), -1).any(1)  # per example: any non-finite value
            raise UserError(f"the {split} {what} hold nan or inf in {int(bad.sum())} of {len(t)} examples "
                            f"(the first: {bad.nonzero()[0].item()}): clean or drop them in the dataset")


def _check_values(targets: torch.Tensor, kind: str, classes: int, split: str) -> None:
    """Class ids in [0, classes) (dense ones may be IGNORE_INDEX)."""
    if kind == "classes":
        ok = (targets >= 0) & (targets < classes)
        if targets.ndim > 1:
            ok |= targets == IGNORE_INDEX
        if not ok.all():
            values, counts = targets[~ok].unique(return_counts=True)
            bad = ", ".join(f"{v} ({c} times)" for v, c in zip(values[:SHOWN].tolist(), counts.tolist(),
                                                               strict=False))
            one_based = targets.min() == 1 and targets.max() == classes
            hint = (f"; they look like 1..{classes}: subtract 1" if one_based
                    else "; one name per class in the dataset's Source, ids counted from 0")
            raise UserError(f"the {split} targets hold class ids outside [0, {classes}): {bad}"
                            f"{' and more' if len(values) > SHOWN else ''}{hint}")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")

