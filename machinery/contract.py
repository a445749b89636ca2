"""The data contract: what a dataset must be for the task and the model, checked once at start-up, before
any file is written. A fork whose data, task and model do not fit stops here in one line that names the
shapes, dtypes or values, never with numbers that are quietly wrong later.

task.TARGETS says what the task's loss takes:
- "classes": integer class ids, read as int64, in [0, classes): one per example ([N]) or per position
  ([N, *S], say per pixel), where the model gives [N, classes, *S];
- "values": numbers, read as float32, shaped as the model's outputs; [N] is [N, 1] for one output;
- "any": as the data gives them; the check is one batch: the loss of two examples is one finite number.
Targets whose last two dimensions are the images' height and width are dense: crops and flips move them,
and a crop's padding gets IGNORE_INDEX, which the loss and metrics skip. One class id per example stays as
it is; other targets (a point, a box, an age) stay only where task.TARGETS_MOVE_WITH_IMAGES is False, and
follow crops and flips only by task.augmented_targets: the template cannot tell a position from an age.

Each check reads in a line or two; the line it ends with, when it fails, is built below, under "refusals".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from configs import Config, UserError, first_line

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
    per_example: bool = False  # one class id or one row of values per example
    stays: bool = False  # crops and flips leave them as they are: a class id an example, or as task.py says
    moves: bool | None = None  # task.TARGETS_MOVE_WITH_IMAGES (None: task.py says nothing)
    follow: Callable | None = None  # the task's augmented_targets: how its targets follow crops and flips


def checked_sizes(cfg: Config, source, world_size: int) -> dict:
    """The Source's splits by name, none empty, and a batch that divides over the processes."""
    if cfg.batch_size % world_size:
        raise UserError(f"batch_size {cfg.batch_size} must divide evenly over {world_size} processes")
    splits = {"train": source.train, "val": source.val, "test": source.test}
    splits = {split: examples for split, examples in splits.items() if examples is not None}
    for split, examples in splits.items():
        if (_rows(examples[0]) if isinstance(examples, tuple) else len(examples)) == 0:
            raise empty_split(cfg, source, split)  # an empty val split trained an epoch, then divided by 0
    return splits


def check_splits(splits: dict, names: list[str], kind: str, image_size: tuple | None,
                 collate: Callable | None, moves: bool | None = None) -> tuple[Targets, str]:
    """Each split's targets (an (inputs, targets) pair, converted in place, or a Dataset's first example)
    read as the task takes them and checked; what was found, and its line. `image_size`: (H, W) or None."""
    if kind not in KINDS:
        raise UserError(f"task.TARGETS is {kind!r}; it says what the loss takes: one of {', '.join(KINDS)}")
    checked = []
    for split, pair in splits.items():
        listed = pair[1] if isinstance(pair, tuple) else getattr(pair, "targets", None)  # as ImageFolder
        whole = listed is not None  # else a Dataset's first item's targets stand for the rest
        targets = _read_as(listed if whole else _first_targets(pair, collate), kind, len(names), split)
        if isinstance(pair, tuple):  # tensors: converted once here, checked whole
            _check_finite(split, pair[0], targets)
            splits[split] = (pair[0], targets)
        if kind == "classes":
            _check_classes(targets, len(names), split)
        checked.append(f"{_rows(targets)} {split}" if whole else f"{split}'s first")
        if split == "train":  # dense: one target per pixel, its last two dimensions the images' (H, W)
            dense = kind != "any" and image_size is not None and tuple(targets[0].shape[-2:]) == tuple(
                image_size)
            ids = targets if whole and kind == "classes" else None
            one_each = targets.ndim == 2 if kind == "values" else targets[0].numel() == 1  # id, or values
            per_example = kind != "any" and one_each
            stays = moves is False or kind == "classes" and one_each  # a crop keeps a class id, or as said
    counts = None if ids is None else torch.bincount(ids[ids != IGNORE_INDEX], minlength=len(names))
    what = {"classes": f"class ids in [0, {len(names)})", "values": f"values for {len(names)} outputs",
            "any": "as the data gives them (TARGETS = \"any\")"}[kind]
    per_position = ids is not None and ids.ndim > 1  # tokens' ids, or pixels': no one class an example
    said = f"targets checked: {', '.join(checked)}, {what}{', one per pixel' if dense else ''}"
    return Targets(kind, dense, counts, None if per_position else ids, per_example, stays, moves), said


def check_model(model: nn.Module, batches, task, cfg: Config, info) -> str:
    """The split's first two examples through the model (eval mode, no gradients), then the loss; the line."""
    inputs, targets = batches.first(2)
    given, training = _described(inputs), model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except Exception as err:  # any layer's complaint: wrong channels, dtype, rank, size
        raise model_refused(cfg, given, err) from None
    finally:
        model.train(training)
    if not isinstance(outputs, torch.Tensor):
        raise UserError(f"the model {cfg.model} returns a {type(outputs).__name__}, not a tensor of outputs")
    shape, kind = list(outputs.shape), task.TARGETS
    want = [shape[0], *shape[2:]] if kind == "classes" else shape
    named = len(info.names)  # outputs
    if kind != "any" and not (outputs.ndim >= 2 and shape[1] == named and list(targets.shape) == want):
        raise outputs_misfit(cfg, (given, shape, list(targets.shape)), kind, named)
    loss = task.loss(outputs.float(), targets, cfg, info)
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
        raise loss_not_a_number(loss)
    if kind == "any" and not torch.isfinite(loss):  # the task reads them as it likes: the loss is the check
        raise loss_not_finite(loss, shape, _described(targets))
    return f"{cfg.model} takes {given} and gives {shape}"


def as_taken(targets: torch.Tensor, kind: str) -> torch.Tensor:
    """Targets as the task takes them: int64 class ids, or float32 values ([N] as [N, 1]), or as they are."""
    if kind == "any":
        return targets
    if kind == "values" and targets.ndim == 1:
        targets = targets[:, None]
    return targets.to(torch.int64 if kind == "classes" else torch.float32)


# ---------------------------------------------------------------- images, epochs


def image_steps_note(image, targets: Targets, cfg: Config, which: str = "") -> str:
    """The image steps training batches get, and how the targets follow; one the targets cannot is refused."""
    if targets.dense:
        check_dense(image, targets, cfg)
    if (image.pad or image.flip) and not (targets.follow or targets.dense or targets.stays):
        raise unmovable(image, targets, cfg)
    steps = ([f"a random crop after {image.pad} px of zero padding"] if image.pad else []) + (
        ["random left-right flips (--no-flip where a mirror changes the class: digits, text)"] if image.flip
        else [])
    if not steps:
        why = "--no-augment" if not cfg.augment else f"none for {cfg.dataset}"
        return f"images{which}: no crop or flip ({why})"
    moved = ("; the targets follow them by task.py's augmented_targets" if targets.follow else
             "; the per-pixel targets move with them" if targets.dense else "")  # they stay, as said
    return f"images{which}: {' and '.join(steps)} on training batches{moved}"


def plain_inputs(cfg: Config, source, needs, example: torch.Tensor) -> str:
    """The note for one input tensor that is no image; a torchvision model or crops of it are refused."""
    shown = f"{list(example.shape)} {_dtype(example)}"
    check_image_model(cfg, needs, shown)
    refuse_crops(cfg, source, shown)
    return not_images_note("the inputs are", shown)


def not_images_note(what: str, shown: str) -> str:
    return f"{what} {shown} tensors, not uint8 images: no crop, flip, normalization or channels_last"


def check_balance(cfg: Config, spec: Targets) -> None:
    if cfg.balance_classes and spec.class_ids is None:
        raise UserError(f"--balance-classes draws by class, and {cfg.dataset}'s training targets are not one "
                        "class id per example listed up front (tensors, or a Dataset with .targets)")


def epoch_checks(cfg: Config, train, world_size: int) -> list[str]:
    """The note on what an epoch leaves out, if any (none where it trains no batch: check_trainable)."""
    said = len(train) and epoch_note(train.num_examples, cfg.batch_size, world_size, cfg.accum_steps)
    return [said] if said else []


def check_trainable(cfg: Config, info) -> None:
    """A batch larger than the training set is refused where the run trains (evaluate.py trains nothing)."""
    if info.batches == 0:
        raise UserError(f"batch_size {cfg.batch_size} is larger than the {cfg.dataset} training "
                        f"set ({info.train_size}); lower --batch-size")


def epoch_note(n: int, batch_size: int, world_size: int, accum_steps: int) -> str | None:
    """What an epoch of `n` training examples trains where some sit out of it (the partial last batch is
    dropped: --compile's shapes stay static, BatchNorm never sees a batch of one); a better --batch-size."""
    per_rank, local = n // world_size, batch_size // world_size
    batches, whole = per_rank // local, -(-per_rank // local)  # full batches; batches that take them all
    if not (out := n - batches * batch_size):
        return None
    steps, fits = -(-batches // accum_steps), per_rank // whole * world_size
    shards = f" and what does not divide over {world_size} processes" if n % world_size else ""
    said = (f"training: {steps} optimizer step{'s' * (steps != 1)} an epoch ({batches} batch"
            f"{'es' * (batches != 1)} of {batch_size}{f', {accum_steps} a step' * (accum_steps > 1)}); "
            f"{out} of the {n} training examples {'sit' if out > 1 else 'sits'} out of each epoch, others "
            f"each time (the last, partial batch is dropped{shards})")
    left = n - fits * whole
    return said + (f"; --batch-size {fits} leaves {left or 'none'} out, in {whole} batches" * (left < out))


# ---------------------------------------------------------------- the checks


def _read_as(targets, kind: str, outputs: int, split: str):
    """Targets in the dtype and shape the task takes, or one line saying why they cannot be."""
    parts = list(targets.values()) if isinstance(targets, Mapping) else targets if isinstance(
        targets, tuple) else []
    if parts and all(isinstance(t, torch.Tensor) for t in parts):  # several tensors
        return _several_targets(targets, kind, split)
    targets = torch.as_tensor(targets)
    if kind == "classes" and (targets.is_floating_point() or targets.is_complex() or
                              targets.dtype is torch.bool):
        raise UserError(f"the task takes class ids, and the {split} targets are {_dtype(targets)}: give the "
                        "dataset integer class ids (or set TARGETS = \"values\" in task.py)")
    if kind == "values" and targets.ndim == 1 and outputs != 1:
        raise UserError(f"the task takes {outputs} values per example (one per name in the dataset's "
                        f"Source), and the {split} targets are {list(targets.shape)}: one each")
    return as_taken(targets, kind)


def _several_targets(targets, kind: str, split: str):
    """A tuple or dict of tensors (boxes and their labels): "any" takes them so, each a row per example."""
    if kind != "any":
        wanted = "class ids" if kind == "classes" else "values"
        raise UserError(f"the {split} targets are a {type(targets).__name__} of {len(targets)} tensors, and "
                        f"the task takes {wanted}, one tensor; give one, or set TARGETS = \"any\" in task.py "
                        "for a loss that reads them so")
    from machinery.inputs import each

    return each(lambda _, t: t, targets)


def _first_targets(dataset, collate: Callable):
    """A Dataset's first example batched alone, as batches hold it: its targets."""
    first = collate([dataset[0]])[1]
    return tuple(first) if isinstance(first, list) else first  # default_collate's list of a tuple


def _check_finite(split: str, inputs, targets) -> None:
    """Each input tensor and the targets: a row per example, finite numbers."""
    tensors = [("inputs", inputs), ("targets", targets)]
    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        from machinery.inputs import members, named

        tensors = [(named(key), t) for key, t in members(inputs).items()] + [
            (named(key).replace("inputs", "targets"), t) for key, t in members(targets).items()]
    for what, t in tensors:
        if len(t) != _rows(targets):
            raise UserError(f"the {split} {what} hold {len(t)} rows and the targets {_rows(targets)}: give "
                            "each input one row per example")
        if t.is_floating_point() and not (finite := torch.isfinite(t)).all():
            raise not_finite(split, what, finite)


def _check_classes(targets: torch.Tensor, classes: int, split: str) -> None:
    """Class ids in [0, classes) (dense ones may be IGNORE_INDEX)."""
    ok = (targets >= 0) & (targets < classes)
    if targets.ndim > 1:
        ok |= targets == IGNORE_INDEX
    if not ok.all():
        raise outside_classes(targets, ok, classes, split)


def _rows(x) -> int:
    if isinstance(x, torch.Tensor):
        return len(x)
    from machinery.inputs import rows

    return rows(x)


def _described(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{list(x.shape)} {_dtype(x)}"
    from machinery.inputs import described

    return described(x)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# ---------------------------------------------------------------- refusals: the line a failed check ends with


def empty_split(cfg: Config, source, split: str) -> UserError:
    skipped = f" ({'; '.join(source.notes)})" if source.notes else ""
    return UserError(f"{cfg.dataset}: the {split} split holds no examples{skipped}; give it some (its "
                     "dataset entry in data.py, or the files in --data-dir)")


def model_refused(cfg: Config, given: str, err: Exception) -> UserError:
    return UserError(f"the model {cfg.model} cannot take this data's inputs ({given}): {first_line(err)}; "
                     "add a model for these inputs to MODELS in models.py and pass --model NAME")


def outputs_misfit(cfg: Config, shapes: tuple, kind: str, outputs: int) -> UserError:
    given, shape, targets = shapes
    each = "a class id per example (or per position)" if kind == "classes" else "one value per output"
    return UserError(f"the model {cfg.model} gives outputs {shape} for {given} inputs, and the targets are "
                     f"{targets}: the task takes {each}, {outputs} outputs (one per name in the dataset's "
                     "Source); make the model's outputs or the targets fit")


def loss_not_a_number(loss) -> UserError:
    what = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
    return UserError(f"task.loss returns {what} for a batch of 2: it must return one number, the batch's "
                     "summed loss (normalizer() says what it is divided by)")


def loss_not_finite(loss: torch.Tensor, shape: list, targets: str) -> UserError:
    return UserError(f"task.loss gives {loss.item()} for the first two examples ({shape} outputs, {targets} "
                     "targets): with TARGETS = \"any\" that is the check, so make the loss read these "
                     "targets")


def not_finite(split: str, what: str, finite: torch.Tensor) -> UserError:
    bad = (~finite).reshape(len(finite), -1).any(1)  # per example: any non-finite value
    return UserError(f"the {split} {what} hold nan or inf in {int(bad.sum())} of {len(finite)} examples (the "
                     f"first: {bad.nonzero()[0].item()}): clean or drop them in the dataset")


def outside_classes(targets: torch.Tensor, ok: torch.Tensor, classes: int, split: str) -> UserError:
    values, counts = targets[~ok].unique(return_counts=True)
    shown = zip(values[:SHOWN].tolist(), counts.tolist(), strict=False)
    bad = ", ".join(f"{v} ({c} times)" for v, c in shown)
    one_based = targets.min() == 1 and targets.max() == classes
    hint = (f"; they look like 1..{classes}: subtract 1" if one_based
            else "; one name per class in the dataset's Source, ids counted from 0")
    return UserError(f"the {split} targets hold class ids outside [0, {classes}): {bad}"
                     f"{' and more' if len(values) > SHOWN else ''}{hint}")


def check_dense(image, targets: Targets, cfg: Config) -> None:
    """Per-pixel targets cannot be resized with their images, and per-pixel values have no padding value."""
    if image.resize:
        raise UserError(f"{cfg.model} takes {image.resize}x{image.resize} px inputs, and the per-pixel "
                        "targets cannot be resized with the images: give the dataset images of that size, or "
                        "use a model that takes these")
    if image.pad and targets.kind == "values" and not targets.follow:
        raise UserError("a random crop pads the images, and per-pixel values have none that counts for "
                        "nothing (class ids get IGNORE_INDEX): pass --no-augment, or set pad=0 in the "
                        "dataset's Source")


def unmovable(image, targets: Targets, cfg: Config) -> UserError:
    """Targets a crop or flip would leave where they were: the task says how they move, or that they stay."""
    steps = f"{cfg.dataset}'s images get crops and flips (pad={image.pad}, flip={image.flip}), and"
    hook = "augmented_targets(targets, shifts, flips, size) in task.py (docs/your_data.md)"
    others = "set pad=0 and flip=False in the dataset's Source, or pass --no-augment"
    if targets.moves:
        return UserError(f"{steps} task.py says its targets move with them (TARGETS_MOVE_WITH_IMAGES = True) "
                         f"and gives no augmented_targets to move them: define {hook}, or {others}")
    if targets.kind == "values" and targets.per_example:
        return UserError(f"{steps} the template cannot tell whether a row of values moves with its image (a "
                         f"position) or stays (an age): define {hook} where they move, or set "
                         f"TARGETS_MOVE_WITH_IMAGES = False in task.py where they stay; or {others}")
    what = ('TARGETS = "any" targets' if targets.kind == "any" else
            f"{targets.kind} targets that are neither one per example nor one per pixel")
    return UserError(f"{steps} the template cannot move {what} with them: define {hook}, or set "
                     "TARGETS_MOVE_WITH_IMAGES = False there where a crop and a flip leave them as they are; "
                     f"or {others}")


def refuse_crops(cfg: Config, source, shown: str) -> None:
    """A Source's crops and flips of inputs that are no uint8 images: which axes of a [C, T, H, W] clip
    would a crop take?"""
    if (source.pad or source.flip) and cfg.augment:
        raise UserError(f"{cfg.dataset}'s Source asks for crops and flips (pad={source.pad}, flip="
                        f"{source.flip}), and its inputs are {shown} tensors, not uint8 [C, H, W] images: "
                        "the template does not know which axes to crop; set pad=0 and flip=False in its "
                        "Source (augment in the dataset), or pass --no-augment")


def check_image_model(cfg: Config, needs, shown: str) -> None:
    """A torchvision image model takes one image tensor."""
    if needs.size:
        raise UserError(f"{cfg.model} is a torchvision image model, which takes one image tensor, and "
                        f"{cfg.dataset}'s inputs are {shown}; add a model of yours to MODELS in models.py")
