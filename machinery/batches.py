"""Batches of (inputs, targets) on the training device, for each split of a dataset entry's Source.

Tensors, and image files decoded once (image_cache.py), stay on the device where they fit and are served
in whole batches (airbench-style); else in host memory, each batch gathered there into pinned memory and
copied without blocking; files too many to hold are read by DataLoader workers (placement.py). Inputs are
a tensor, or a tuple or dict of tensors (machinery/inputs.py); each uint8 [N, C, H, W] one is an image:
crop and flip, normalization from 0..255, channels_last and resizing to a model's size, in whole batches
on the device (machinery/image_steps.py). Each epoch's order and augmentation come from a (seed, epoch)
generator: a resumed run or DDP rank sees what it would have."""

from __future__ import annotations

import math
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from configs import Config, UserError
from machinery import placement
from machinery.contract import IGNORE_INDEX, Targets, as_taken, check_splits
from machinery.image_files import ImageFiles
from machinery.image_steps import ImageSteps, augment, fit_images, image_steps_note, sampled_stats
from machinery.inputs import Examples, described, each, members, named, rows, stacked, take, total_bytes
from machinery.signals import SIGNALS, worker_init


@dataclass
class DataInfo:
    input_shape: tuple[int, ...]  # one example as the model gets it, (1, 8, 8) or (1, 256): [0] are channels
    input_dtype: torch.dtype  # as the model gets it: float32 for images (several inputs: the first one's)
    names: list[str]  # one per model output: len(names) outputs
    class_counts: torch.Tensor | None  # training examples (pixels) per class on the device; None: not classes
    train_size: int
    val_size: int
    loader: str  # what serves the batches, said once at start-up
    images: bool  # whether the image steps apply
    test_size: int | None = None  # None: the data has no test split
    notes: list[str] = field(default_factory=list)  # resizing, normalization: said once at start-up
    reading: dict | None = None  # images: how they were read (size, resize, channels, mean, std)
    batches: int = 0  # this process's training batches per epoch
    files: dict[str, str] | None = None  # file datasets: each split's list, hashed (data.Source.files)
    digests: dict[str, torch.Tensor] | None = None  # image files decoded: each image's pixels, hashed
    members: str | None = None  # several inputs: each one's shape and dtype ("[3, 8, 8] uint8 + [12] int64")

    def sizes(self) -> dict:
        return {"train_size": self.train_size, "val_size": self.val_size, "test_size": self.test_size}

    def data_record(self) -> dict:
        """What a checkpoint records of the data, which a resume checks: the splits' sizes, the batches
        per epoch (they fix the schedule) and the names of the outputs; and what evaluate.py counts a
        split's images against, the training images' digests (None: tensors, or files read every epoch)."""
        return {**self.sizes(), "batches": self.batches, "names": self.names, "files": self.files,
                "train_digests": (self.digests or {}).get("train")}

    def inputs_record(self) -> dict:
        """What a checkpoint records of the inputs: evaluate.py (--predict, load_trained) reads it."""
        dtype = str(self.input_dtype).removeprefix("torch.")
        return {"shape": list(self.input_shape), "dtype": dtype, "reading": self.reading,
                **({"members": self.members} if self.members else {})}


def epoch_plan(n: int, seed: int, epoch: int, *, pad: int = 0, flip: bool = False,
               shard: tuple[int, int] = (0, 1), class_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's training order, crop offsets and flip flags for an epoch, drawn for the whole dataset
    from one (seed, epoch) generator, then sharded (`shard`: this rank, of how many) in equal shards, as
    DistributedSampler's: the same on any device, wherever a resumed run starts. `class_ids`
    (--balance-classes): n draws with replacement, each class equally likely."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    if class_ids is not None:
        per_class = torch.bincount(class_ids).double()
        order = torch.multinomial(1 / per_class[class_ids], n, replacement=True, generator=g)
    else:
        order = torch.randperm(n, generator=g)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n,), generator=g, dtype=torch.bool) & flip
    rank, world_size = shard
    mine = slice(rank, n // world_size * world_size, world_size)
    return order[mine], offsets[mine], flips[mine]


def epoch_note(n: int, batch_size: int, world_size: int, accum_steps: int) -> str | None:
    """What an epoch of `n` training examples trains where some sit out of it (a partial batch is dropped:
    --compile's shapes stay static, BatchNorm never sees a batch of one), and a --batch-size that fits."""
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


@dataclass(frozen=True)
class Serving:
    """How a split's batches are served: the same for the training and the validation split."""

    batch_size: int  # this process's share of the global batch
    device: torch.device
    seed: int = 0  # of the training order and augmentation (epoch_plan), and of the workers
    rank: int = 0  # under torchrun, this process's shard of each epoch
    world_size: int = 1
    num_workers: int = 0  # DataLoader workers, where the data is not on the device
    collate: Callable | None = None  # a Dataset's examples as one batch (data.Source's); None: inputs.stacked


class Batches:
    """A split's batches, from tensors on the device or a DataLoader: `epoch(e, start)` yields this rank's
    batches of epoch e from `start` (training drops a partial last one). `image`: the steps of the image
    inputs (one ImageSteps, or {member's key: ImageSteps} for several inputs); the others pass as they are.
    `targets`: how the task takes them (contract.check_splits); `class_ids`: training draws classes evenly."""

    def __init__(self, source, labels, serving: Serving, *, train: bool,
                 image: ImageSteps | dict | None = None, targets: Targets | None = None,
                 class_ids: torch.Tensor | None = None):
        self.source, self.labels, self.serving, self.train = source, labels, serving, train
        self.collate = serving.collate or stacked  # a Dataset's examples as one batch
        self.targets, self.class_ids, self.device = targets, class_ids, serving.device
        self.images = image if isinstance(image, dict) else {} if image is None else {None: image}
        self.image = next(iter(self.images.values()), None)  # the first input's (pad and flip: every one's)
        self.tensors = not isinstance(source, torch.utils.data.Dataset)  # else: read by workers
        self.num_examples = rows(source) if self.tensors else len(source)
        # tensors in host memory for a GPU: batches gathered on the host, pinned, copied without blocking
        self.gathered_on_host = self.tensors and next(iter(members(source).values())).device != self.device
        self._loader, self._open = None, weakref.WeakSet()  # its DataLoader, and the epochs not yet done
        self.scale, self.shift = {}, {}  # per image input, per channel: x * scale - shift normalizes
        for key, steps in self.images.items():
            self.scale[key] = (1 / (255 * steps.std)).view(1, -1, 1, 1).to(self.device)
            self.shift[key] = (steps.mean / steps.std).view(1, -1, 1, 1).to(self.device)

    @property
    def to_pixels(self):  # a function: a batch as the model gets it back to images in [0, 1], to look at.
        return self.denormalize if self.image else None  # Not kept on self: that cycle kept workers alive

    def __len__(self) -> int:
        n, bs, ranks = self.num_examples, self.serving.batch_size, self.serving.world_size
        return n // ranks // bs if self.train else math.ceil(len(range(self.serving.rank, n, ranks)) / bs)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.epoch(0)

    def close(self) -> None:
        """The DataLoader's workers stop now (a run's end, a failed one's too), not when the collector
        finds them: the epochs still open end, and the loader goes with its last reference."""
        for stream in list(self._open):
            stream.close()
        self._loader = None

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The split's first n examples as the model gets them, unaugmented, drawing no random number
        (read in this process: no worker starts): the start-up check's batch."""
        batch = ((take(self.source, slice(0, n)), take(self.labels, slice(0, n))) if self.tensors else
                 self.collate([self.source[i] for i in range(min(n, self.num_examples))]))
        return self._prepared(*batch)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stream = self._epoch(epoch, start)
        self._open.add(stream)
        return stream

    def _epoch(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        s, bs = self.serving, self.serving.batch_size
        pad, flip = (self.image.pad, self.image.flip) if self.image and self.train else (0, False)
        if self.train:  # shuffled (or drawn by class), cropped and flipped as its (seed, epoch) plan says
            order, offsets, flips = epoch_plan(self.num_examples, s.seed, epoch, pad=pad, flip=flip,
                                               shard=(s.rank, s.world_size), class_ids=self.class_ids)
            order, offsets, flips = order[: len(self) * bs], offsets.to(self.device), flips.to(self.device)
        else:  # in order, each rank its shard
            order = torch.arange(s.rank, self.num_examples, s.world_size)
        if self.tensors:
            plan = order.to(next(iter(members(self.labels).values())).device).split(bs)[start:]
            raw = ((self._gathered(self.source, idx), self._gathered(self.labels, idx)) for idx in plan)
        else:
            raw = self._from_workers(order[start * bs:].tolist())
        try:
            for i, (inputs, targets) in enumerate(raw, start):
                window = slice(i * bs, i * bs + rows(inputs))
                crops = (offsets[window], flips[window]) if pad or flip else None
                yield self._prepared(inputs, targets, crops)
        except Exception as err:  # the loader's frames in its traceback would keep its workers alive
            traceback.clear_frames(err.__traceback__)
            raise
        finally:  # the loader's iterator: after close(), its workers go now, not with a traceback's frames
            del raw

    def _gathered(self, held, index: torch.Tensor):
        """The rows `index` of `held` (the inputs, or the targets) where they are: on the device, or on the
        host gathered straight into pinned memory, from which _prepared's copy to the GPU does not block."""
        if not self.gathered_on_host:
            return take(held, index)

        def pinned(_, t: torch.Tensor) -> torch.Tensor:
            out = torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
            return torch.index_select(t, 0, index, out=out)

        return each(pinned, held)

    def _prepared(self, inputs, targets: torch.Tensor, crops=None):
        """A batch on the device as the model and the task take it: training images cropped and flipped by
        `crops` ((offsets, flips); the targets with them: by the task's augmented_targets, or dense ones as
        pixels), then normalized; floating inputs as float32."""
        targets = each(lambda _, t: t.to(self.device, non_blocking=True), targets)  # a tuple too ("any")
        if self.targets is not None:
            targets = as_taken(targets, self.targets.kind)
        if crops is not None and self.targets is not None and self.targets.follow:
            size = tuple(members(inputs)[next(iter(self.images))].shape[-2:])  # the (first) image's (H, W)
            targets = self.targets.follow(targets, crops[0] - self.image.pad, crops[1], size)
        elif crops is not None and self.targets is not None and self.targets.dense:
            targets = augment(targets, *crops, self.image.pad, fill=IGNORE_INDEX)
        inputs = each(lambda key, x: self._input(key, x.to(self.device, non_blocking=True), crops), inputs)
        return inputs, targets

    def _input(self, key, x: torch.Tensor, crops) -> torch.Tensor:
        steps = self.images.get(key)
        if steps is None:  # not an image
            return x.float() if x.is_floating_point() else x
        if crops is not None:
            x = augment(x, *crops, steps.pad)
        memory = torch.channels_last if steps.channels_last else torch.contiguous_format
        x = x.to(dtype=torch.float32, memory_format=memory)
        if steps.resize:
            x = F.interpolate(x, (steps.resize,) * 2, mode="bilinear").contiguous(memory_format=memory)
        return x.mul_(self.scale[key]).sub_(self.shift[key])

    def _from_workers(self, indices: list[int]):
        """One DataLoader for all epochs (its workers start once), its order set for each pass; its own
        generator, as the global one (dropout's too) would start a resumed run's passes elsewhere. Its
        workers leave a signal to this process (signals.worker_init), which stops them in order: a
        SIGTERM to the process group killed them mid-batch, in 60-80 lines."""
        if self._loader is None:
            s, self._order = self.serving, []  # the sampler: a list, given each pass's order in place
            self._loader = torch.utils.data.DataLoader(
                self.source, batch_size=s.batch_size, sampler=self._order, num_workers=s.num_workers,
                pin_memory=self.device.type == "cuda", persistent_workers=s.num_workers > 0,
                collate_fn=self.collate, worker_init_fn=worker_init,
                generator=torch.Generator().manual_seed(s.seed))
        self._order[:] = indices
        with SIGNALS.held_while_forking():  # its workers start here, on the first pass
            return iter(self._loader)

    def denormalize(self, inputs) -> torch.Tensor:
        """A batch's (first) image input as the model gets it, back to pixel values in [0, 1], to look at."""
        key = next(iter(self.images))
        return ((members(inputs)[key].float() + self.shift[key]) / self.scale[key] / 255).clamp_(0, 1)


@dataclass
class Splits:
    """Each split's batches (test: None where the data has no test split); closing them stops the
    DataLoader workers of all three."""

    train: Batches
    val: Batches
    test: Batches | None = None

    def __enter__(self) -> Splits:
        return self

    def __exit__(self, *_) -> None:
        for batches in (self.train, self.val, self.test):
            if batches is not None:
                batches.close()


def build_loaders(cfg: Config, source, device: torch.device, *, targets: str, needs,
                  shard: tuple[int, int] = (0, 1), follow=None) -> tuple[Splits, DataInfo]:
    """Train, val and test batches of a dataset entry's `source` (data.Source) on `device`, sharded for this
    process (`shard`: its rank, of how many), their targets read and checked as the task takes them
    (`targets`: task.TARGETS; contract.py) and moved with crops and flips by `follow` (task.py's
    augmented_targets, where it has one), images fitted to what the model needs (`needs`:
    models.input_needs' answer: size, mean and std)."""
    rank, world_size = shard
    if cfg.batch_size % world_size:
        raise UserError(f"batch_size {cfg.batch_size} must divide evenly over {world_size} processes")
    # the splits (tensor targets converted in place by check_splits), none empty: an empty val split trained
    # a whole epoch, then its tally divided by zero; an empty training split failed at its first example
    splits = {split: examples for split, examples in (("train", source.train), ("val", source.val),
                                                      ("test", source.test)) if examples is not None}
    for split, examples in splits.items():
        if (rows(examples[0]) if isinstance(examples, tuple) else len(examples)) == 0:
            skipped = f" ({'; '.join(source.notes)})" if source.notes else ""
            raise UserError(f"{cfg.dataset}: the {split} split holds no examples{skipped}; give it some (its "
                            "dataset entry in data.py, or the files in --data-dir)")
    notes, files = list(source.notes), {split: examples.fingerprint() for split, examples in splits.items()
                                         if isinstance(examples, ImageFiles)} or None
    splits, held, digests = placement.held(cfg, splits, device, notes)  # image files that fit: tensors now
    streamed = not isinstance(splits["train"], tuple)  # a Dataset (files, say), read by workers
    collate = source.collate or stacked  # a Dataset's: the first example batched alone, as the model gets it
    sample = take(collate([splits["train"][0]])[0] if streamed else splits["train"][0], 0)  # its inputs
    parts = members(sample)
    keys = [key for key, t in parts.items() if t.dtype == torch.uint8 and t.ndim == 3]  # the image inputs
    if needs.size and keys != [None]:
        raise UserError(f"{cfg.model} is a torchvision image model, which takes one image tensor, and "
                        f"{cfg.dataset}'s inputs are {described(sample)}; add a model of yours to MODELS in "
                        "models.py")
    size = parts[keys[0]].shape[-2:] if keys else None  # (H, W) of the (first) image input: dense targets'
    spec, checked = check_splits(splits, list(source.names), targets, size, collate)
    spec.follow = follow
    image, reading = _image_inputs(cfg, source, (splits["train"], {key: parts[key] for key in keys}),
                                   (spec, needs), notes)
    others = {key: t for key, t in parts.items() if key not in keys}
    if not keys and (source.pad or source.flip) and cfg.augment:  # clips [C, T, H, W]: which axes to crop?
        raise UserError(f"{cfg.dataset}'s Source asks for crops and flips (pad={source.pad}, flip="
                        f"{source.flip}), and its inputs are {described(sample)} tensors, not uint8 "
                        "[C, H, W] images: the template does not know which axes to crop; set pad=0 and "
                        "flip=False in its Source (augment in the dataset), or pass --no-augment")
    if others:
        what = "the inputs are" if len(parts) == 1 else f"{', '.join(map(named, others))}:"
        notes.append(f"{what} {described(others)} tensors, not uint8 images: no crop, flip, normalization or "
                     "channels_last")
    notes.append(checked)
    if cfg.balance_classes and spec.class_ids is None:
        raise UserError(f"--balance-classes draws by class, and {cfg.dataset}'s training targets are not one "
                        "class id per example listed up front (tensors, or a Dataset with .targets)")
    workers = placement.workers(cfg.num_workers, device)
    serving = Serving(cfg.batch_size // world_size, device, cfg.seed, rank, world_size, workers,
                      collate=source.collate)
    served = {}  # each split's batches: tensors on the device or in host memory, or a Dataset for workers
    for split, pair in splits.items():
        kept = (tuple(each(lambda _, t: t.to(device), part) for part in pair) if held.where == "device" else
                pair if held.where == "host" else (pair if streamed else Examples(*pair), None))
        served[split] = Batches(*kept, serving, train=split == "train", image=image, targets=spec,
                                class_ids=spec.class_ids if cfg.balance_classes else None)
    if held.where == "dataloader":
        placement.check_shared_memory(total_bytes(sample) * cfg.batch_size // world_size, workers, notes)
    if len(served["train"]) == 0:
        raise UserError(f"batch_size {cfg.batch_size} is larger than the {cfg.dataset} training "
                        f"set ({served['train'].num_examples}); lower --batch-size")
    if said := epoch_note(served["train"].num_examples, cfg.batch_size, world_size, cfg.accum_steps):
        notes.append(said)
    loader = {"device": f"device-resident tensors on {device.type}", "dataloader": f"DataLoader with "
              f"{workers} workers", "host": f"host memory, pinned batches copied to {device}"}[held.where]
    key, x = next(iter(parts.items()))  # the one input, or the first of several: the model's channels
    resize, several = reading["resize"] if reading else 0, described(sample) if len(parts) > 1 else None
    info = DataInfo(batches=len(served["train"]), input_shape=(x.shape[0], resize, resize) if resize else
                    tuple(x.shape), input_dtype=torch.float32 if key in keys or x.is_floating_point() else
                    x.dtype, names=list(source.names), loader=loader, images=bool(keys), notes=notes,
                    reading=reading, files=files, members=several, digests=digests,
                    class_counts=None if spec.class_counts is None else spec.class_counts.to(device),
                    **{f"{split}_size": batches.num_examples for split, batches in served.items()})
    return Splits(served["train"], served["val"], served.get("test")), info


def _image_inputs(cfg: Config, source, found: tuple, fitting: tuple, notes: list[str]) -> tuple:
    """The steps of the image inputs (`found`: the training split, and its first example's uint8 [C, H, W]
    members by key), each normalized with the Source's stats or its own training images' (one ImageSteps
    for one tensor, a dict for several, None for none), said in `notes`; and, for one image tensor, how it
    was read (DataInfo's reading: evaluate.py --predict reads files so). `fitting`: the targets' spec, the
    model's needs."""
    steps, (train, images), (spec, needs) = {}, found, fitting
    for key, example in images.items():
        channels, size, stats = example.shape[0], example.shape[-1], source.stats
        if stats is None and not isinstance(train, tuple):  # a sample of the training images', read now
            stats = sampled_stats(train, key, channels, notes)
        elif stats is None:  # the training images' own statistics
            x = members(train[0])[key].float().div_(255).transpose(0, 1).reshape(channels, -1)
            stats = x.mean(1), x.std(1).clamp_min(1e-3)
        elif len(stats[0]) != channels:
            raise UserError(f"{cfg.dataset}'s Source gives stats for {len(stats[0])} channels, and "
                            f"{named(key)} has {channels}: give one mean and std per channel, or stats=None")
        resize, mean, std = fit_images(cfg, needs, (channels, size), stats, notes)  # the model's asks
        flip = source.flip and cfg.flip and cfg.augment
        steps[key] = ImageSteps(mean, std, source.pad if cfg.augment else 0, flip, cfg.channels_last, resize)
    if not steps:
        return None, None
    first = next(iter(steps.values()))
    which = "" if None in steps else f" ({', '.join(map(named, steps))})"
    notes.append(image_steps_note(first, spec, cfg, which))
    if None not in steps:
        return steps, None  # several inputs: --predict, which reads one image per file, is refused
    channels, size = images[None].shape[0], images[None].shape[-1]
    return first, {"size": size, "resize": first.resize, "channels": channels, "mean": first.mean.tolist(),
                   "std": first.std.tolist()}
