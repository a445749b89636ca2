"""Datasets by name (DATASETS): each a function of the config that returns a Source, its splits as tensors or
as a Dataset of files: the file to edit for your own data. Inputs may be any [N, ...] tensor; uint8
[N, C, H, W] ones are images, cropped, flipped and normalized on the device. Targets: what the task takes."""

import functools
import gzip
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
import torch.nn.functional as F

from configs import Config, UserError

IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@dataclass
class Source:
    """A dataset entry's splits, as (inputs [N, ...], targets [N, ...]) tensors or as Datasets for workers:
    `val` chooses best.pt (and --early-stop), `test` is evaluated once, at the end, and chooses nothing."""

    train: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    val: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    names: list[str] | int  # one per model output (the class names); a count where they have none: 0, 1, ...
    test: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset | None = None  # None: no test split
    pad: int = 0  # images: zero padding before the random crop (0: no crop)
    flip: bool = False  # images: left-right flips keep the labels
    stats: tuple | None = None  # images: per-channel (mean, std) tensors; None: the training images'
    collate: Callable | None = None  # a Dataset's: its examples (a list) as one batch; None: torch's stacking
    notes: list[str] = field(default_factory=list)  # said once at start-up: files skipped, and why

    def __post_init__(self):  # outputs that are no classes (a box's numbers, an embedding) need no names
        if isinstance(self.names, int):
            self.names = [str(i) for i in range(self.names)]


# ---------------------------------------------------------------- the datasets

def digits(cfg: Config) -> Source:
    """scikit-learn's 8x8 digits, offline: a fixed 360-image test split, val --val-fraction of the rest."""
    rows = bundled_digits()
    images = torch.from_numpy(rows[:, :64] * (255 / 16)).round().to(torch.uint8).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(rows[:, 64]).long()
    test, rest = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1797)).split([360, 1437])
    train, val = (rest[at] for at in hold_out(labels[rest], cfg.val_fraction, "digits"))
    return Source((images[train], labels[train]), (images[val], labels[val]), list("0123456789"), pad=1,
                  test=(images[test], labels[test]))


def bundled_digits() -> numpy.ndarray:
    """digits.csv.gz's [1797, 65] rows (64 pixels in 0..16, the label) read as load_digits reads them, without
    importing scikit-learn (a second of start-up); load_digits itself where the file is not found."""
    shipped = (Path(folder) / "sklearn" / "datasets" / "data" / "digits.csv.gz" for folder in sys.path)
    path = next((path for path in shipped if path.is_file()), None)
    if path:
        with gzip.open(path) as file:
            rows = numpy.loadtxt(file, delimiter=",")
        if rows.shape == (1797, 65):
            return rows
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return numpy.column_stack([bunch.data, bunch.target])


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

    from machinery.files import downloading
    from machinery.image_files import printable

    cls, root = getattr(torchvision.datasets, class_name), Path(cfg.data_dir).absolute()
    failed = (f"dataset {cfg.dataset} is not in {printable(root.resolve())} and could not be downloaded "
              f"({{reason}}); run once with network access, or copy torchvision's {class_name} files there")
    with downloading(root / class_name / "raw", failed) as allowed:  # under torchrun: rank 0 alone
        try:
            splits = [cls(str(root), train=t, download=False) for t in (True, False)]
        except RuntimeError:  # not there: rank 0 downloads it (the others fail again)
            splits = [cls(str(root), train=t, download=allowed) for t in (True, False)]
    pairs = [(torch.as_tensor(ds.data), torch.as_tensor(ds.targets).long()) for ds in splits]  # then NCHW
    (images, labels), test = [((x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)).contiguous(), y)
                              for x, y in pairs]
    train, val = ((images[at], labels[at]) for at in hold_out(labels, cfg.val_fraction, cfg.dataset))
    return Source(train, val, list(splits[0].classes), pad=pad, flip=flip, test=test)


def image_folder(cfg: Config) -> Source:
    """--data-dir/{train,val}/<class>/<image>: torchvision's ImageFolder layout (classes: the sorted folder
    names); a test/ beside them (optional) is the test split."""
    from machinery.image_files import folder_splits

    splits, names, notes = folder_splits(Path(cfg.data_dir))
    return image_files(cfg, splits, names, notes=notes)


def csv_images(cfg: Config) -> Source:
    """--data-dir/train.csv rows of `file,label` (a header first; file paths relative to --data-dir),
    as many datasets ship; --data-dir/val.csv too, or else a fixed --val-fraction of train.csv; and a
    --data-dir/test.csv (optional), the test split."""
    from machinery.image_files import csv_rows, printable

    root, notes = Path(cfg.data_dir), []  # rows read as data, or dropped as repeats: said at start-up
    rows = {split: csv_rows(root, f"{split}.csv", notes) for split in ("train", "val", "test")
            if split == "train" or (root / f"{split}.csv").is_file()}
    if len(names := sorted({label for _, label in rows["train"]})) < 2:
        raise UserError(f"csv: {printable(root / 'train.csv')} has 1 label ({names[0]!r}); a classifier "
                        "needs two or more: give each row its class after the file (file,label)")
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
                         f"({', '.join(map(printable, shared[:3]))}): their {split} scores are no held-out "
                         "measure; list each file in one of them")
    return image_files(cfg, {split: [(file, index[label]) for file, label in listed]
                              for split, listed in rows.items()}, names, notes=notes)


def hold_out(labels: torch.Tensor, fraction: float, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A training split's indices as train and val: round(`fraction` x N) held out, each class in proportion
    (never its last example), drawn by the split's own seed: every run and process holds out the same."""
    total = round(fraction * len(labels))
    if not 0 < total < len(labels):
        raise UserError(f"{dataset}: {len(labels)} training examples are too few to hold out a "
                        f"--val-fraction of {fraction:g} ({'none' if total == 0 else 'all'} of them would "
                        "be); change --val-fraction, or give the dataset a val split of its own")
    classes, sizes = labels.unique(return_counts=True)
    quotas = fraction * sizes.double()
    shares = torch.minimum(quotas.floor().long(), sizes - 1)
    room = [i for i in torch.argsort(shares - quotas, stable=True).tolist() if shares[i] < sizes[i] - 1]
    shares[room[:total - int(shares.sum())]] += 1  # a class of one example holds out none
    if not shares.sum():
        raise UserError(f"{dataset}: every class has one training example: none can be held out for "
                        "validation without leaving its class untrained; give the dataset a val split")
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


# ---------------------------------------------------------------- image files


def image_files(cfg: Config, splits: dict[str, list], names: list[str], notes=()) -> Source:
    """(path, class index) lists of the "train", "val" and "test" splits (none: no test split) as a Source
    of image files: each read at one size (resized on its short side, center-cropped), uint8, RGB or
    grayscale (--channels), normalized with ImageNet's statistics (their mean if gray); flips allowed
    (--flip decides). They are decoded once where they fit, and kept (--image-cache)."""
    from machinery.image_files import ImageFiles
    from models import input_needs

    if cfg.channels not in (1, 3):
        raise UserError(f"{cfg.dataset} loads images as RGB (--channels 3) or grayscale (--channels 1), "
                        f"not with {cfg.channels} channels")
    needs = input_needs(cfg.model, cfg.pretrained)
    size = cfg.image_size or needs.crop or max(needs.size, 32)
    mean, std = (torch.tensor(s) for s in IMAGENET_STATS)
    stats = (mean.mean().view(1), std.mean().view(1)) if cfg.channels == 1 else (mean, std)
    files = {split: ImageFiles(items, size, cfg.channels, cfg.data_dir) for split, items in splits.items()}
    return Source(files["train"], files["val"], names, pad=max(size // 8, 1), flip=True, stats=stats,
                  notes=list(notes), test=files.get("test"))
