"""Datasets by name (DATASETS), served as batches of (inputs, targets) on the training device.

Inputs may be any [N, ...] tensor, uint8 or float; targets, whatever the task's loss takes. uint8 [N, C, H, W]
inputs are images: crop and flip, normalization from 0..255, channels_last and resizing to a model's size,
in whole batches on the device (airbench-style), after DataLoader workers read any files. Each epoch's order
and augmentation come from a (seed, epoch) generator: a resumed run or DDP rank sees what it would have."""

import csv
import functools
import math
import os
import shutil
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import distributed
from checkpoints import downloading
from configs import Config, UserError, first_line
from contract import IGNORE_INDEX, Targets, as_taken, check_splits
from models import fit_images, input_needs

IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
IMAGE_SUFFIXES = tuple(".jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp .gif".split())  # ImageFolder's, GIF
DEVICE_MEMORY_SHARE = 0.25  # auto mode keeps data on a GPU only if it takes at most this share


@dataclass
class Source:
    """A dataset entry's splits, as (inputs [N, ...], targets [N, ...]) tensors or as Datasets for workers:
    `val` chooses best.pt (and --early-stop), `test` is evaluated once, at the end, and chooses nothing."""

    train: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    val: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    names: list[str]  # one per model output: the class names, for classification
    test: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset | None = None  # None: no test split
    pad: int = 0  # images: zero padding before the random crop (0: no crop)
    flip: bool = False  # images: left-right flips keep the labels
    stats: tuple | None = None  # images: per-channel (mean, std) tensors; None: the training images'
    notes: list[str] = field(default_factory=list)  # said once at start-up: files skipped, and why


# ---------------------------------------------------------------- the datasets

def digits(cfg: Config) -> Source:
    """scikit-learn's 8x8 digits, bundled with it: works offline. A fixed 360-image test split; val is
    --val-fraction of the other 1437."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images * (255 / 16)).round().to(torch.uint8).unsqueeze(1)
    labels = torch.from_numpy(bunch.target).long()
    test, rest = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1797)).split([360, 1437])
    train, val = (rest[at] for at in hold_out(labels[rest], cfg.val_fraction, "digits"))
    return Source((images[train], labels[train]), (images[val], labels[val]), list("0123456789"), pad=1,
                  test=(images[test], labels[test]))


def synthetic(cfg: Config) -> Source:
    """Class templates (smooth random patterns) plus noise: learnable, deterministic, any shape."""
    size, g = cfg.image_size or 16, torch.Generator().manual_seed(12345)
    coarse = torch.rand(cfg.num_classes, cfg.channels, 4, 4, generator=g)
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
        noise = torch.randn(n, cfg.channels, size, size, generator=g) * 0.25
        return ((templates[labels] + noise).clamp(0, 1) * 255).round().to(torch.uint8), labels

    held = cfg.synthetic_val_size or max(cfg.synthetic_size // 4, 1)
    train, val, test = draw(cfg.synthetic_size), draw(held), draw(held)  # test last: train and val stay
    return Source(train, val, [str(i) for i in range(cfg.num_classes)], test=test)


def torchvision_set(class_name: str, cfg: Config, pad: int = 2, flip: bool = False) -> Source:
    """A torchvision dataset, downloaded into --data-dir the first time (under torchrun by rank 0 alone).
    Its official test split is the test split; val is --val-fraction of its training split."""
    import torchvision

    cls, root = getattr(torchvision.datasets, class_name), Path(cfg.data_dir).absolute()
    downloader = distributed.rank() == 0
    if not downloader:
        distributed.barrier()  # the others wait: several writers would corrupt the archive
    failed = (f"dataset {cfg.dataset} is not in {_shown(root.resolve())} and could not be downloaded "
              f"({{reason}}); run once with network access, or copy torchvision's {class_name} files there")
    try:
        with downloading(root / class_name / "raw", failed):
            try:
                splits = [cls(str(root), train=t, download=False) for t in (True, False)]
            except RuntimeError:  # not there: rank 0 downloads it (the others fail again)
                splits = [cls(str(root), train=t, download=downloader) for t in (True, False)]
    finally:
        if downloader:
            distributed.barrier()
    pairs = [(torch.as_tensor(ds.data), torch.as_tensor(ds.targets).long()) for ds in splits]  # then NCHW
    (images, labels), test = [((x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)).contiguous(), y)
                              for x, y in pairs]
    train, val = ((images[at], labels[at]) for at in hold_out(labels, cfg.val_fraction, cfg.dataset))
    return Source(train, val, list(splits[0].classes), pad=pad, flip=flip, test=test)


def image_folder(cfg: Config) -> Source:
    """--data-dir/{train,val}/<class>/<image>: torchvision's ImageFolder layout, each split read by _scan;
    a test/ beside them (optional) is the test split."""
    root = Path(cfg.data_dir)
    splits = ("train", "val", "test") if (root / "test").is_dir() else ("train", "val")
    layout = f"expected {_shown(root)}/train/<class>/*.png|jpg and {_shown(root)}/val/<class>/*"
    if missing := [root / split for split in splits if not (root / split).is_dir()]:
        raise UserError(f"imagefolder: {_shown(missing[0])} is missing; {layout}")
    names, *held_names = (sorted(d.name for d in (root / split).iterdir() if d.is_dir()) for split in splits)
    for split, found in zip(splits, (names, *held_names), strict=True):
        if len(found) < 2:  # one level too high: train/ holds one folder that holds the classes
            raise UserError(f"imagefolder: {_shown(root / split)} holds {len(found)} class folder"
                            f"{'' if len(found) == 1 else 's'}{f' ({found[0]!r})' if found else ''}; a "
                            "classifier needs two or more: point --data-dir at the folder that holds train/ "
                            "and val/ with one folder per class")
        if found != names:
            raise UserError(f"imagefolder: train classes {names} differ from {split} {found}")
    classes = {os.path.realpath(root / at / name): name for at in splits for name in names}
    scanned = {at: _scan(root / at, names, classes) for at in splits}  # each split's (items, its note)
    if empty := sorted(set(names) - {names[label] for _, label in scanned["train"][0]}):
        raise UserError(f"imagefolder: no training images for {empty}{_skipped(scanned['train'][1])}; "
                        f"{layout}")
    for split, (found, skipped) in scanned.items():  # train's: each class has some, as just checked
        if not found:  # else its tally would divide by zero, after all the training
            raise UserError(f"imagefolder: {_shown(root / split)} holds no images{_skipped(skipped)}; the "
                            f"{split} split needs some {', '.join(IMAGE_SUFFIXES)} files (convert others, "
                            "HEIC say, to JPEG)")
    return _image_files(cfg, {at: items for at, (items, _) in scanned.items()}, names,
                        notes=[note for _, said in scanned.values() for note in said])


def csv_images(cfg: Config) -> Source:
    """--data-dir/train.csv rows of `file,label` (a header first; file paths relative to --data-dir),
    as many datasets ship; --data-dir/val.csv too, or else a fixed --val-fraction of train.csv; and a
    --data-dir/test.csv (optional), the test split."""
    root, notes = Path(cfg.data_dir), []  # rows read as data, or dropped as repeats: said at start-up
    rows = {split: _csv_rows(root, f"{split}.csv", notes) for split in ("train", "val", "test")
            if split == "train" or (root / f"{split}.csv").is_file()}
    if len(names := sorted({label for _, label in rows["train"]})) < 2:
        raise UserError(f"csv: {_shown(root / 'train.csv')} has 1 label ({names[0]!r}); a classifier needs "
                        "two or more: give each row its class after the file (file,label)")
    index = {name: i for i, name in enumerate(names)}
    if "val" not in rows:  # held out by class, by the split's own seed: the same rows whatever --seed says
        train = rows["train"]
        held = hold_out(torch.tensor([index[label] for _, label in train]), cfg.val_fraction, "csv")
        rows["train"], rows["val"] = ([train[i] for i in at.tolist()] for at in held)
    for split in ("val", "test"):
        if unknown := sorted({label for _, label in rows.get(split, [])} - set(names)):
            raise UserError(f"csv: {split} labels {unknown[:5]} are in no training row; each class needs "
                            "some")
    files = {split: {os.path.normpath(f) for f, _ in listed} for split, listed in rows.items()}
    for split, other in (("val", "train"), ("test", "train"), ("test", "val")):  # val held out: none shared
        if shared := sorted(files.get(split, set()) & files[other]):
            notes.append(f"csv: {split}.csv lists {len(shared)} of {other}.csv's files too "
                         f"({', '.join(map(_shown, shared[:3]))}): their {split} scores are no held-out "
                         "measure; list each file in one of them")
    return _image_files(cfg, {split: [(file, index[label]) for file, label in listed]
                              for split, listed in rows.items()}, names, notes=notes)


def hold_out(labels: torch.Tensor, fraction: float, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A training split's indices divided into train and val: round(`fraction` x N) examples held out, each
    class's share in proportion to its size (stratified; the largest remainders round up), drawn with the
    split's own seed: every run, --seed and process holds out the same ones."""
    total = round(fraction * len(labels))
    if not 0 < total < len(labels):
        raise UserError(f"{dataset}: {len(labels)} training examples are too few to hold out a "
                        f"--val-fraction of {fraction:g} ({'none' if total == 0 else 'all'} of them would "
                        "be); change --val-fraction, or give the dataset a val split of its own")
    classes, sizes = labels.unique(return_counts=True)
    quotas = fraction * sizes.double()
    shares = quotas.floor().long()
    shares[torch.argsort(shares - quotas, stable=True)[:total - int(shares.sum())]] += 1
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    drawn = labels[order]  # each class's examples in the drawn order: its first `share` are held out
    val = torch.cat([order[drawn == c][:share] for c, share in zip(classes, shares.tolist(), strict=True)])
    every = torch.arange(len(labels))
    return every[~torch.isin(every, val)], val.sort().values


# The one list of dataset names: --dataset, --help, the README's Fork it and the tests read it.
DATASETS = {"digits": digits, "mnist": functools.partial(torchvision_set, "MNIST"),
            "fashion_mnist": functools.partial(torchvision_set, "FashionMNIST"),
            "cifar10": functools.partial(torchvision_set, "CIFAR10", pad=4, flip=True),
            "cifar100": functools.partial(torchvision_set, "CIFAR100", pad=4, flip=True),
            "imagefolder": image_folder, "csv": csv_images, "synthetic": synthetic}


# ---------------------------------------------------------------- batches

@dataclass
class DataInfo:
    input_shape: tuple[int, ...]  # one example as the model gets it, (1, 8, 8) or (1, 256): [0] are channels
    input_dtype: torch.dtype  # as the model gets it: float32 for images
    names: list[str]  # one per model output: len(names) outputs
    class_counts: torch.Tensor | None  # training examples (pixels) per class on the device; None: not classes
    train_size: int
    val_size: int
    loader: str  # what serves the batches, said once at start-up
    images: bool  # whether the image steps apply
    test_size: int | None = None  # None: the data has no test split
    notes: list[str] = field(default_factory=list)  # resizing, normalization: said once at start-up
    reading: dict | None = None  # images: how they were read (size, resize, channels, mean, std)

    def inputs_record(self) -> dict:
        """What a checkpoint records of the inputs: --predict and models.load_trained read it."""
        dtype = str(self.input_dtype).removeprefix("torch.")
        return {"shape": list(self.input_shape), "dtype": dtype, "reading": self.reading}


@dataclass
class ImageSteps:
    """What image batches get on the device: crop and flip (training only), then normalization."""

    mean: torch.Tensor  # per channel, in [0, 1]
    std: torch.Tensor
    pad: int = 0
    flip: bool = False
    channels_last: bool = False
    resize: int = 0  # square size a model needs (a ViT, say); 0 keeps the images' own


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


def augment(images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, pad: int,
            fill: int = 0) -> torch.Tensor:
    """Random crop after padding with `fill`, then flip, for a batch [N, C, H, W] (or per-pixel targets
    [N, H, W]): one gather of each pixel's flat index in its padded image (flips read columns backwards),
    ~5x faster than 4-D indexing; no device reads."""
    if images.ndim == 3:
        return augment(images[:, None], offsets, flips, pad, fill)[:, 0]
    n, c, h, w = images.shape
    padded_h, padded_w = h + 2 * pad, w + 2 * pad
    padded = F.pad(images, (pad, pad, pad, pad), value=fill).reshape(n, -1)
    span = torch.arange(w, device=images.device)
    cols = offsets[:, 1, None] + torch.where(flips[:, None], span.flip(0), span)
    rows = (offsets[:, 0, None] + torch.arange(h, device=images.device)) * padded_w
    planes = torch.arange(c, device=images.device) * (padded_h * padded_w)
    index = planes[None, :, None, None] + rows[:, None, :, None] + cols[:, None, None, :]
    return padded.gather(1, index.reshape(n, -1)).reshape(n, c, h, w)


@dataclass(frozen=True)
class Serving:
    """How a split's batches are served: the same for the training and the validation split."""

    batch_size: int  # this process's share of the global batch
    device: torch.device
    seed: int = 0  # of the training order and augmentation (epoch_plan), and of the workers
    rank: int = 0  # under torchrun, this process's shard of each epoch
    world_size: int = 1
    num_workers: int = 0  # DataLoader workers, where the data is not on the device


class Batches:
    """A split's batches, from tensors on the device or a DataLoader: `epoch(e, start)` yields this rank's
    batches of epoch e from `start` (training drops a partial last one); no `image`: inputs pass as is.
    `targets`: how the task takes them (contract.check_splits); `class_ids`: training draws classes evenly."""

    def __init__(self, source, labels: torch.Tensor | None, serving: Serving, *, train: bool,
                 image: ImageSteps | None = None, targets: Targets | None = None,
                 class_ids: torch.Tensor | None = None):
        self.source, self.labels, self.serving, self.train, self.image = source, labels, serving, train, image
        self.targets, self.class_ids, self.device = targets, class_ids, serving.device
        self.on_device, self.num_examples = isinstance(source, torch.Tensor), len(source)
        self._loader, self._open = None, weakref.WeakSet()  # its DataLoader, and the epochs not yet done
        if image is not None:
            self.scale = (1 / (255 * image.std)).view(1, -1, 1, 1).to(self.device)
            self.shift = (image.mean / image.std).view(1, -1, 1, 1).to(self.device)

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
        batch = ((self.source[:n], self.labels[:n]) if self.on_device else
                 torch.utils.data.default_collate([self.source[i] for i in range(min(n, self.num_examples))]))
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
        if self.on_device:
            raw = ((self.source[idx], self.labels[idx]) for idx in order.to(self.device).split(bs)[start:])
        else:
            raw = self._from_workers(order[start * bs:].tolist())
        try:
            for i, (inputs, targets) in enumerate(raw, start):
                window = slice(i * bs, i * bs + len(inputs))
                crops = (offsets[window], flips[window]) if pad or flip else None
                yield self._prepared(inputs, targets, crops)
        except Exception as err:  # the loader's frames in its traceback would keep its workers alive
            traceback.clear_frames(err.__traceback__)
            raise
        finally:  # the loader's iterator: after close(), its workers go now, not with a traceback's frames
            del raw

    def _prepared(self, inputs: torch.Tensor, targets: torch.Tensor, crops=None):
        """A batch on the device as the model and the task take it: training images cropped and flipped by
        `crops` ((offsets, flips); dense targets with them), then normalized."""
        inputs, targets = (t.to(self.device, non_blocking=True) for t in (inputs, targets))
        if self.targets is not None:
            targets = as_taken(targets, self.targets.kind)
        if self.image is None:
            return (inputs.float() if inputs.is_floating_point() else inputs), targets
        if crops is not None:
            inputs = augment(inputs, *crops, self.image.pad)
            if self.targets is not None and self.targets.dense:
                targets = augment(targets, *crops, self.image.pad, fill=IGNORE_INDEX)
        memory = torch.channels_last if self.image.channels_last else torch.contiguous_format
        x = inputs.to(dtype=torch.float32, memory_format=memory)
        if self.image.resize:
            x = F.interpolate(x, (self.image.resize,) * 2, mode="bilinear").contiguous(memory_format=memory)
        return x.mul_(self.scale).sub_(self.shift), targets

    def _from_workers(self, indices: list[int]):
        """One DataLoader for all epochs (its workers start once), its order set for each pass; its own
        generator, as the global one (dropout's too) would start a resumed run's passes elsewhere. Its
        workers leave a signal to this process (distributed.worker_init), which stops them in order: a
        SIGTERM to the process group killed them mid-batch, in 60-80 lines."""
        if self._loader is None:
            s, self._order = self.serving, []  # the sampler: a list, given each pass's order in place
            self._loader = torch.utils.data.DataLoader(
                self.source, batch_size=s.batch_size, sampler=self._order, num_workers=s.num_workers,
                pin_memory=self.device.type == "cuda", persistent_workers=s.num_workers > 0,
                worker_init_fn=distributed.worker_init, generator=torch.Generator().manual_seed(s.seed))
        self._order[:] = indices
        return iter(self._loader)

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        """Image batches as the model receives them back to pixel values in [0, 1], to look at."""
        return ((inputs.float() + self.shift) / self.scale / 255).clamp_(0, 1)


def build_loaders(cfg: Config, device: torch.device, rank: int = 0, world_size: int = 1, *,
                  targets: str = "classes") -> tuple[Batches, Batches, Batches | None, DataInfo]:
    """Train, val and test batches of `cfg.dataset` on `device` (test: None where the data has no test
    split), sharded for this rank, their targets read and checked as the task takes them (`targets`:
    task.TARGETS; contract.py)."""
    if cfg.batch_size % world_size:
        raise UserError(f"batch_size {cfg.batch_size} must divide evenly over {world_size} processes")
    source = DATASETS[cfg.dataset](cfg)
    # the splits (tensor targets converted in place by check_splits), none empty: an empty val split trained
    # a whole epoch, then its tally divided by zero; an empty training split failed at its first example
    splits = {split: examples for split, examples in (("train", source.train), ("val", source.val),
                                                      ("test", source.test)) if examples is not None}
    for split, examples in splits.items():
        if len(examples[0] if isinstance(examples, tuple) else examples) == 0:
            skipped = f" ({'; '.join(source.notes)})" if source.notes else ""
            raise UserError(f"{cfg.dataset}: the {split} split holds no examples{skipped}; give it some (its "
                            "dataset entry in data.py, or the files in --data-dir)")
    files, sample = not isinstance(source.train, tuple), source.train[0][0]  # the first input (or file)
    shape, images = tuple(sample.shape), sample.dtype == torch.uint8 and sample.ndim == 3
    needs, notes = input_needs(cfg.model, cfg.pretrained), list(source.notes)
    if not images and needs.size:
        raise UserError(f"{cfg.model} is a torchvision image model, and {cfg.dataset}'s inputs are "
                        f"{list(shape)} {sample.dtype} tensors; add a model of yours to MODELS in models.py")
    spec, checked = check_splits(splits, list(source.names), targets, shape[-2:] if images else None)
    image, resize, (channels, size) = None, 0, (shape[0], shape[-1])
    if images:
        if source.stats is None:  # the training images' own statistics
            x = source.train[0].float().div_(255).transpose(0, 1).reshape(channels, -1)
            source.stats = x.mean(1), x.std(1).clamp_min(1e-3)
        resize, mean, std = fit_images(cfg, channels, size, *source.stats, notes)  # what the model asks
        flip = source.flip and cfg.flip and cfg.augment
        image = ImageSteps(mean, std, source.pad if cfg.augment else 0, flip, cfg.channels_last, resize)
        notes.append(_image_steps(image, spec, cfg))
    else:
        notes.append(f"the inputs are {list(shape)} {sample.dtype} tensors, not uint8 images: no crop, flip, "
                     "normalization or channels_last")
    notes.append(checked)
    if cfg.balance_classes and spec.class_ids is None:
        raise UserError(f"--balance-classes draws by class, and {cfg.dataset}'s training targets are not one "
                        "class id per example listed up front (tensors, or a Dataset with .targets)")
    mode = cfg.loader
    if files and mode == "device":
        raise UserError(f"{cfg.dataset} reads files through workers; use --loader dataloader")
    if mode == "auto":  # tensors that fit: on a GPU, in DEVICE_MEMORY_SHARE of its free memory
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else math.inf
        needed = 0 if files else sum(t.nbytes for split in splits.values() for t in split)
        mode = "device" if not files and needed <= DEVICE_MEMORY_SHARE * free else "dataloader"
    serving = Serving(cfg.batch_size // world_size, device, cfg.seed, rank, world_size, cfg.num_workers)
    served = {}  # each split's batches, of tensors on the device or of a Dataset for workers
    for split, pair in splits.items():
        held = ([t.to(device) for t in pair] if mode == "device" else
                (pair if files else torch.utils.data.TensorDataset(*pair), None))
        served[split] = Batches(*held, serving, train=split == "train", image=image, targets=spec,
                                class_ids=spec.class_ids if cfg.balance_classes else None)
    if mode == "dataloader":
        check_shared_memory(sample.nbytes * cfg.batch_size // world_size, cfg.num_workers, notes)
    if len(served["train"]) == 0:
        raise UserError(f"batch_size {cfg.batch_size} is larger than the {cfg.dataset} training "
                        f"set ({served['train'].num_examples}); lower --batch-size")
    loader = (f"device-resident tensors on {device.type}" if mode == "device"
              else f"DataLoader with {cfg.num_workers} workers")
    reading = image and {"size": size, "resize": resize, "channels": channels, "mean": image.mean.tolist(),
                         "std": image.std.tolist()}
    info = DataInfo(input_shape=(shape[0], resize, resize) if resize else shape,
                    input_dtype=torch.float32 if images or sample.is_floating_point() else sample.dtype,
                    names=list(source.names), loader=loader, images=images, notes=notes, reading=reading,
                    class_counts=None if spec.class_counts is None else spec.class_counts.to(device),
                    **{f"{split}_size": batches.num_examples for split, batches in served.items()})
    return served["train"], served["val"], served.get("test"), info


def _image_steps(image: ImageSteps, targets: Targets, cfg: Config) -> str:
    """Which image steps the training batches get, said at start-up; those per-pixel targets cannot
    follow are refused."""
    if targets.dense and image.resize:
        raise UserError(f"{cfg.model} takes {image.resize}x{image.resize} px inputs, and the per-pixel "
                        "targets cannot be resized with the images: give the dataset images of that size, or "
                        "use a model that takes these")
    if targets.dense and image.pad and targets.kind == "values":
        raise UserError("a random crop pads the images, and per-pixel values have none that counts for "
                        "nothing (class ids get IGNORE_INDEX): pass --no-augment, or set pad=0 in the "
                        "dataset's Source")
    steps = ([f"a random crop after {image.pad} px of zero padding"] if image.pad else []) + (
        ["random left-right flips (--no-flip where a mirror changes the class: digits, text)"] if image.flip
        else [])
    if not steps:
        return f"images: no crop or flip ({'--no-augment' if not cfg.augment else f'none for {cfg.dataset}'})"
    moved = "; the per-pixel targets move with them" if targets.dense else ""
    return f"images: {' and '.join(steps)} on training batches{moved}"


def check_shared_memory(batch_bytes: int, workers: int, notes: list[str]) -> None:
    """DataLoader workers hand their batches over in /dev/shm (Linux), which Docker makes 64 MB: too small
    for the batches in flight (prefetch_factor 2 per worker, one in use, for each process on this machine),
    refused now rather than in the loop; under twice that, said in a note."""
    if workers == 0 or not os.path.isdir("/dev/shm"):
        return
    need = batch_bytes * (2 * workers + 1) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = shutil.disk_usage("/dev/shm").free
    said = (f"/dev/shm has {free / 2**20:.1f} MiB free and the DataLoader's batches in flight need about "
            f"{need / 2**20:.1f} MiB")
    fix = "use --num-workers 0, or give the container more shared memory (docker run --shm-size=2g)"
    if free < need:
        raise UserError(f"{said}; {fix}")
    if free < 2 * need:
        notes.append(f"{said}: if workers fail for want of shared memory, {fix}")


def prediction_batches(cfg: Config, path: Path, reading: dict, device: torch.device) -> tuple:
    """Images a model never saw (a file, a folder's searched recursively, or a CSV's first column), read
    as its run read its own (`reading`: its DataInfo.reading, which its checkpoint keeps); files; skipped."""
    if not path.exists():
        raise UserError(f"--predict {_shown(path)}: no such file or folder (an image, a folder, a CSV)")
    listed, notes = path.suffix.lower() == ".csv", []  # a CSV's rows name the images: taken as they are
    found = ([file for file, _ in _csv_rows(path.parent, path.name, notes, labels=False)] if listed else
             sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    files = [p for p in found if listed or p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        what = "is not an image file" if path.is_file() else "holds no image files"
        raise UserError(f"--predict {_shown(path)}: {what} ({', '.join(IMAGE_SUFFIXES)})")
    said = [f"{len(found) - len(files)} skipped (not image files)"] if len(found) > len(files) else []
    skipped = "; ".join(said + [note.removeprefix("csv: ") for note in notes])
    as_run = replace(cfg, dataset="--predict", image_size=reading["size"], channels=reading["channels"])
    steps = ImageSteps(torch.tensor(reading["mean"]), torch.tensor(reading["std"]),
                       channels_last=cfg.channels_last, resize=reading["resize"])
    source = _image_files(as_run, {"train": [(f, 0) for f in files], "val": []}, []).train
    serving = Serving(cfg.batch_size, device, cfg.seed, num_workers=cfg.num_workers)
    return Batches(source, None, serving, train=False, image=steps), files, skipped


# ---------------------------------------------------------------- files and statistics

class UnreadableImage(UserError):
    """An image file that cannot be decoded; the message names the file and its class folder. From a
    DataLoader worker it arrives with the worker's traceback as text: its last line is ours."""

    def __init__(self, message: str):
        worker = "Original Traceback" in message
        super().__init__(message.rstrip().splitlines()[-1].split(": ", 1)[-1] if worker else message)


def read_image(path: str, mode: str = "RGB"):
    """PIL's loader (`mode` "RGB" or "L"), failing in one line naming the file and class; a GIF gives its
    first frame; 16-bit (0..65535) and float (0..1) values, widened to the image's range, map to 0..255."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            if image.mode[0] in "IF":  # "I;16", "I;16B", ..., "I" (32-bit integers), "F" (32-bit floats)
                values = np.nan_to_num(np.asarray(image, dtype=np.float64), posinf=0, neginf=0)  # nan, inf: 0
                low, high = min(values.min(), 0), max(values.max(), 1 if image.mode == "F" else 65535)
                image = Image.fromarray(np.interp(values, (low, high), (0, 255)).round().astype(np.uint8))
            return image.convert(mode)
    except Exception as err:  # decoders raise OSError, SyntaxError, ValueError, struct.error, ...
        reason = ("not an image format PIL can read" if isinstance(err, UnidentifiedImageError) else
                  first_line(err, 100))
        shown, folder = _shown(path), Path(path).parent.name
        raise UnreadableImage(f"cannot read image {shown} (class folder {folder!r}): {reason}") from None


def _shown(path) -> str:  # a path in a one-line message: repr'd if it holds a control character
    return str(path) if str(path).isprintable() else repr(str(path))


def _skipped(notes: list[str]) -> str:  # _scan's note of a split, in a message about that split
    return "".join(f" ({note.removeprefix('imagefolder: ')})" for note in notes)


def _scan(split: Path, names: list[str], classes: dict[str, str]) -> tuple[list[tuple[Path, int]], list[str]]:
    """Each class folder's images as sorted (path, class index) pairs, and a note of what was skipped. Links
    are followed once, after the real entries: what is reached twice is read once; a link into another
    class's folder (`classes`: their real paths; either split) is skipped, as its images are that class's."""
    items, skipped, seen = [], {}, set()

    def visit(path: Path, real: str, link: bool, is_dir: bool) -> None:  # in class `name`
        around = [real, *map(str, Path(real).parents)] if link else [real]  # the class folder it is in
        owner = next((classes[p] for p in around if p in classes), name)
        reason = ("links into another class" if owner != name else "reached twice" if real in seen
                  else "broken links" if link and not os.path.exists(path)
                  else "not images" if not is_dir and path.suffix.lower() not in IMAGE_SUFFIXES else None)
        try:
            entries = sorted(os.scandir(path), key=lambda entry: entry.name) if is_dir and not reason else []
        except OSError:
            reason = "unreadable folders"
        if reason:
            return skipped.setdefault(reason, []).append(_shown(path.relative_to(split)))
        seen.add(real)
        found.extend([] if is_dir else [path])
        for entry in entries:  # links wait until the real entries have their own paths
            if entry.is_symlink():
                links.append(Path(entry.path))
            else:
                visit(Path(entry.path), os.path.join(real, entry.name), False, entry.is_dir())

    for label, name in enumerate(names):
        found, links = [], [split / name]  # the class folder first, as it may itself be a link
        for link in links:  # a list that grows as linked folders are read
            visit(link, os.path.realpath(link), True, os.path.isdir(link))
        items += [(path, label) for path in sorted(found)]
    count, why = sum(map(len, skipped.values())), "; ".join(
        f"{reason}: {len(what)} ({', '.join(sorted(set(what))[:3])})" for reason, what in skipped.items())
    return items, [f"imagefolder: skipped {count} in {split.name}/ - {why}"] if skipped else []


class _Files(torch.utils.data.Dataset):
    """(path, class index) pairs read as images, as ImageFolder reads its folders."""

    def __init__(self, items: list[tuple[Path, int]], transform, mode: str):
        self.items, self.transform, self.mode = items, transform, mode
        self.targets = [label for _, label in items]  # read without the images, as ImageFolder's

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.transform(read_image(str(self.items[i][0]), self.mode)), self.items[i][1]


def _image_files(cfg: Config, splits: dict[str, list], names: list[str], notes=()) -> Source:
    """(path, class index) lists of the "train", "val" and "test" splits (none: no test split) as a Source
    read by workers: each image resized, center-cropped and made uint8 CHW, RGB or grayscale, normalized
    with ImageNet's statistics (their mean if gray); flips allowed (--flip decides)."""
    from torchvision import transforms as T

    if cfg.channels not in (1, 3):
        raise UserError(f"{cfg.dataset} loads images as RGB (--channels 3) or grayscale (--channels 1), "
                        f"not with {cfg.channels} channels")
    needs = input_needs(cfg.model, cfg.pretrained)
    size = cfg.image_size or needs.crop or max(needs.size, 32)
    transform = T.Compose([T.Resize(size), T.CenterCrop(size), T.PILToTensor()])
    mode, (mean, std) = "L" if cfg.channels == 1 else "RGB", (torch.tensor(s) for s in IMAGENET_STATS)
    stats = (mean.mean().view(1), std.mean().view(1)) if cfg.channels == 1 else (mean, std)
    files = {split: _Files(items, transform, mode) for split, items in splits.items()}
    return Source(files["train"], files["val"], names, pad=max(size // 8, 1), flip=True, stats=stats,
                  notes=list(notes), test=files.get("test"))


def _csv_rows(root: Path, name: str, notes: list[str], labels: bool = True) -> list[tuple[Path, str | None]]:
    """root/name's rows under its header: a file (relative to root), and with labels its label (next), each
    file once: a repeated row is dropped (else a copy of a training row could land in the held-out split),
    and said in `notes`; a file listed with two labels is refused. A first row that names a file under root
    is no header but data: kept, and said in `notes`."""
    try:
        with open(root / name, newline="", encoding="utf-8") as f:
            records = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"csv: cannot read {_shown(root / name)} as UTF-8 rows of file,label under a header "
                        f"({type(err).__name__})") from None
    start = 0 if records and records[0] and (root / records[0][0].strip()).is_file() else 1
    if start == 0:
        notes.append(f"csv: {_shown(root / name)} has no header (its first row names a file): read as data")
    if labels and (empty := [i for i, row in enumerate(records, 1)  # numbered as a spreadsheet shows them
                             if i > start and row and (len(row) < 2 or not row[1].strip())]):
        shown = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise UserError(f"csv: {_shown(root / name)} has rows without a label: "
                        f"{'rows' if len(empty) > 1 else 'row'} {shown} (the header is row 1); give each its "
                        "class after the file (file,label)")
    rows = [(root / row[0].strip(), row[1].strip() if labels else None) for row in records[start:] if row]
    if not rows or (missing := next((file for file, _ in rows if not file.is_file()), None)):
        what = f"names {_shown(missing)}, which does not exist" if rows else "has no rows"
        raise UserError(f"csv: {_shown(root / name)} {what}")
    if not labels:  # --predict's list: every row as it is
        return rows
    known = {}  # each file's first row, in order
    for file, label in rows:
        if (first := known.setdefault(os.path.normpath(file), (file, label))[1]) != label:
            raise UserError(f"csv: {_shown(root / name)} lists {_shown(file)} with two labels ({first!r} and "
                            f"{label!r}); keep one row per file, with its class")
    if repeats := len(rows) - len(known):
        notes.append(f"csv: {_shown(root / name)} repeats rows: dropped {repeats} repeats of a file and its "
                     "label, each file is read once")
    return list(known.values())

