"""Batches of any other data than batches.DeviceBatches serves: several inputs (a tuple or dict of tensors,
machinery/inputs.py), tensors in host memory gathered into pinned batches for a GPU, a Dataset (image files
too many to hold, a fork's) read by DataLoader workers, image files decoded once (image_cache.py), and
targets that move with crops (per pixel, or by task.augmented_targets). The same epochs, crops, flips and
shards as DeviceBatches, bit for bit (tests/test_data.py), chosen at setup by train.build_loaders."""

from __future__ import annotations

import dataclasses
import traceback
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from configs import Config
from machinery import contract, placement, workers
from machinery.batches import DataInfo, ImageSteps, Serving, Splits, augment, epoch_plan, image_steps
from machinery.contract import IGNORE_INDEX, as_taken
from machinery.image_files import ImageFiles
from machinery.inputs import Examples, described, each, members, named, rows, stacked, take, total_bytes


class Batches:
    """A split's batches, from tensors (on the device, or in host memory) or a DataLoader: `epoch(e, start)`
    yields this rank's batches of epoch e from `start` (training drops a partial last one). `image`: the
    steps of the image inputs (one ImageSteps, or {member's key: ImageSteps} for several inputs); `spec`: how
    the task takes the targets (contract.check_splits); `class_ids`: training draws classes evenly."""

    def __init__(self, source, labels, serving: Serving, *, train: bool,
                 image: ImageSteps | dict | None = None, spec=None, class_ids: torch.Tensor | None = None):
        self.source, self.labels, self.serving, self.train = source, labels, serving, train
        self.collate = serving.collate or stacked  # a Dataset's examples as one batch
        self.spec, self.class_ids, self.device = spec, class_ids, serving.device
        self.images = image if isinstance(image, dict) else {} if image is None else {None: image}
        self.image = next(iter(self.images.values()), None)  # the first input's (pad and flip: every one's)
        self.tensors = not isinstance(source, torch.utils.data.Dataset)  # else: read by workers
        self.num_examples = rows(source) if self.tensors else len(source)
        # tensors in host memory for a GPU: batches gathered on the host, pinned, copied without blocking
        self.gathered_on_host = self.tensors and next(iter(members(source).values())).device != self.device
        self._loader, self._open = None, weakref.WeakSet()  # its DataLoader, and the epochs not yet done
        self.scale, self.shift = {}, {}  # per image input, per channel: x * scale - shift normalizes
        for key, steps in self.images.items():
            self.scale[key], self.shift[key] = steps.scale_shift(self.device)

    @property
    def to_pixels(self):  # a function: a batch as the model gets it back to images in [0, 1], to look at.
        return self.denormalize if self.image else None  # Not kept on self: that cycle kept workers alive

    def __len__(self) -> int:
        n, bs, ranks = self.num_examples, self.serving.batch_size, self.serving.world_size
        return n // ranks // bs if self.train else -(-len(range(self.serving.rank, n, ranks)) // bs)

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

    def raw(self, n: int):
        """The split's first n examples' inputs as held, before any step, on the CPU (what --export takes):
        a Dataset's batched by its collate, as training batches them (clips padded to one length, say)."""
        held = take(self.source, slice(0, n)) if self.tensors else self.collate(
            [self.source[i] for i in range(n)])[0]
        return each(lambda _, t: t.cpu(), held)

    def image_steps(self) -> dict:
        """{key: (steps, scale, shift)} of each image input: what --export puts inside the graph."""
        return {key: (steps, self.scale[key], self.shift[key]) for key, steps in self.images.items()}

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
        if self.spec is not None:
            targets = as_taken(targets, self.spec.kind)
        if crops is not None and self.spec is not None and self.spec.follow:
            size = tuple(members(inputs)[next(iter(self.images))].shape[-2:])  # the (first) image's (H, W)
            targets = self.spec.follow(targets, crops[0] - self.image.pad, crops[1], size)
        elif crops is not None and self.spec is not None and self.spec.dense:
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
        workers leave a signal to this process (workers.worker_init), which stops them in order."""
        if self._loader is None:
            s, self._order = self.serving, []  # the sampler: a list, given each pass's order in place
            self._loader = torch.utils.data.DataLoader(
                self.source, batch_size=s.batch_size, sampler=self._order, num_workers=s.num_workers,
                pin_memory=self.device.type == "cuda", persistent_workers=s.num_workers > 0,
                collate_fn=self.collate, worker_init_fn=workers.worker_init,
                generator=torch.Generator().manual_seed(s.seed))
        self._order[:] = indices
        with workers.starting():  # its workers start here, on the first pass
            return iter(self._loader)

    def denormalize(self, inputs) -> torch.Tensor:
        """A batch's (first) image input as the model gets it, back to pixel values in [0, 1], to look at."""
        key = next(iter(self.images))
        return ((members(inputs)[key].float() + self.shift[key]) / self.scale[key] / 255).clamp_(0, 1)


def build_served(cfg: Config, source, device: torch.device, *, targets: str, needs,
                 shard: tuple[int, int] = (0, 1), follow=None, moves=None) -> tuple[Splits, DataInfo]:
    """Train, val and test batches of data batches.plain() does not take (train.build_loaders chooses),
    as batches.build_plain builds them, and the data's DataInfo."""
    rank, world_size = shard
    splits = contract.checked_sizes(cfg, source, world_size)
    notes, files = list(source.notes), {split: examples.fingerprint() for split, examples in splits.items()
                                         if isinstance(examples, ImageFiles)} or None
    splits, held, digests = placement.held(cfg, splits, device, notes)  # image files that fit: tensors now
    streamed = not isinstance(splits["train"], tuple)  # a Dataset (files, say), read by workers
    collate = source.collate or stacked  # a Dataset's: the first example batched alone, as the model gets it
    sample = take(collate([splits["train"][0]])[0] if streamed else splits["train"][0], 0)  # its inputs
    parts = members(sample)
    keys = [key for key, t in parts.items() if t.dtype == torch.uint8 and t.ndim == 3]  # the image inputs
    if keys != [None]:
        contract.check_image_model(cfg, needs, described(sample))
    size = parts[keys[0]].shape[-2:] if keys else None  # (H, W) of the (first) image input: dense targets'
    spec, said = contract.check_splits(splits, list(source.names), targets, size, collate, moves)
    spec.follow = follow
    image, reading = _image_inputs(cfg, source, (splits["train"], {key: parts[key] for key in keys}),
                                   (spec, needs), notes)
    others = {key: t for key, t in parts.items() if key not in keys}
    if not keys:  # clips [C, T, H, W]: which axes would a crop take?
        contract.refuse_crops(cfg, source, described(sample))
    if others:
        what = "the inputs are" if len(parts) == 1 else f"{', '.join(map(named, others))}:"
        notes.append(contract.not_images_note(what, described(others)))
    notes.append(said)
    contract.check_balance(cfg, spec)
    count = workers.count(cfg.num_workers, device)
    serving = Serving(cfg.batch_size // world_size, device, cfg.seed, rank, world_size, count,
                      collate=source.collate)
    served = {}  # each split's batches: tensors on the device or in host memory, or a Dataset for workers
    for split, pair in splits.items():
        kept = (tuple(each(lambda _, t: t.to(device), part) for part in pair) if held.where == "device" else
                pair if held.where == "host" else (pair if streamed else Examples(*pair), None))
        served[split] = Batches(*kept, serving, train=split == "train", image=image, spec=spec,
                                class_ids=spec.class_ids if cfg.balance_classes else None)
    if held.where == "dataloader":
        workers.check_shared_memory(total_bytes(sample) * cfg.batch_size // world_size, count, notes)
    notes += contract.epoch_checks(cfg, served["train"], world_size)
    loader = {"device": f"device-resident tensors on {device.type}", "dataloader": f"DataLoader with "
              f"{count} workers", "host": f"host memory, pinned batches copied to {device}"}[held.where]
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
    members by key): one ImageSteps for one tensor, a dict for several, None for none, said in `notes`;
    and, for one image tensor, how it was read (DataInfo's reading: --predict reads files so)."""
    steps, (train, images) = {}, found
    for key, example in images.items():
        if isinstance(train, tuple):  # tensors: the statistics of the training images themselves
            steps[key] = image_steps(cfg, source, members(train[0])[key], fitting[1], notes, key=key)
        else:  # a Dataset: of a sample of them, read now, unless the Source gives them
            stats = source.stats or sampled_stats(train, key, example.shape[0], notes)
            steps[key] = image_steps(cfg, dataclasses.replace(source, stats=stats), example[None],
                                     fitting[1], notes, key=key)
    if not steps:
        return None, None
    first = next(iter(steps.values()))
    which = "" if None in steps else f" ({', '.join(map(named, steps))})"
    notes.append(contract.image_steps_note(first, fitting[0], cfg, which))
    if None not in steps:
        return steps, None  # several inputs: --predict, which reads one image per file, is refused
    channels, size = images[None].shape[0], images[None].shape[-1]
    return first, {"size": size, "resize": first.resize, "channels": channels, "mean": first.mean.tolist(),
                   "std": first.std.tolist()}


STATS_SAMPLE = 256  # training examples a Dataset's image statistics are read from, spread over it


def sampled_stats(dataset, key, channels: int, notes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and std, in [0, 1], of the uint8 image input `key` of STATS_SAMPLE examples
    spread evenly over a Dataset (all, if fewer), read in this process, said in `notes`. torch's RNG is left
    as it was, in case the Dataset draws from it."""
    count = min(len(dataset), STATS_SAMPLE)
    sums = torch.zeros(2, channels, dtype=torch.float64)  # of the values, of their squares
    pixels = 0
    with torch.random.fork_rng(devices=[]):
        for i in torch.linspace(0, len(dataset) - 1, count).round().long().tolist():
            x = members(dataset[i][0])[key].double().div_(255).reshape(channels, -1)
            sums += torch.stack([x.sum(1), x.square().sum(1)])
            pixels += x.shape[1]
    mean = sums[0] / pixels
    std = (sums[1] / pixels - mean.square()).clamp_min(0).sqrt()
    which = "" if key is None else f" ({named(key)})"
    notes.append(f"images{which}: normalized with the mean and std of {count} of the {len(dataset)} training "
                 "examples (read at start-up; a Source's stats=(mean, std) sets them)")
    return mean.float(), std.float().clamp_min(1e-3)
