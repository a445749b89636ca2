"""Datasets by name (DATASETS): each a function of the config that returns a Source, its splits as tensors
or as a Dataset of files, and the readers of image folders and CSV files. This is the file to edit for your
own data; machinery/batches.py serves a Source's batches on the device, after contract.py has checked them
against the task.

Inputs may be any [N, ...] tensor, uint8 or float; targets, whatever the task's loss takes. uint8
[N, C, H, W] inputs are images, which get crops, flips and normalization on the device."""

import csv
import functools
import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from configs import Config, UserError, first_line
from machinery.batches import UnreadableImage
from machinery.files import downloading
from models import input_needs

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
    files: dict[str, str] | None = None  # file datasets: each split's list, hashed (a checkpoint keeps it)


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
    failed = (f"dataset {cfg.dataset} is not in {named(root.resolve())} and could not be downloaded "
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
    """--data-dir/{train,val}/<class>/<image>: torchvision's ImageFolder layout, each split read by _scan;
    a test/ beside them (optional) is the test split."""
    root = Path(cfg.data_dir)
    splits = ("train", "val", "test") if (root / "test").is_dir() else ("train", "val")
    layout = f"expected {named(root)}/train/<class>/*.png|jpg and {named(root)}/val/<class>/*"
    if missing := [root / split for split in splits if not (root / split).is_dir()]:
        raise UserError(f"imagefolder: {named(missing[0])} is missing; {layout}")
    names, *held_names = (sorted(d.name for d in (root / split).iterdir() if d.is_dir()) for split in splits)
    for split, found in zip(splits, (names, *held_names), strict=True):
        if not found and split != "train":
            raise UserError(f"imagefolder: {named(root / split)} is empty; give it a folder per class as "
                            f"train/ has ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                            f"{', or remove it: a test split is optional' if split == 'test' else ''}")
        if len(found) < 2:  # one level too high: train/ holds one folder that holds the classes
            raise UserError(f"imagefolder: {named(root / split)} holds {len(found)} class folder"
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
            raise UserError(f"imagefolder: {named(root / split)} holds no images{_skipped(skipped)}; the "
                            f"{split} split needs some {', '.join(IMAGE_SUFFIXES)} files (convert others, "
                            "HEIC say, to JPEG)")
    return image_files(cfg, {at: items for at, (items, _) in scanned.items()}, names,
                        notes=[note for _, said in scanned.values() for note in said])


def csv_images(cfg: Config) -> Source:
    """--data-dir/train.csv rows of `file,label` (a header first; file paths relative to --data-dir),
    as many datasets ship; --data-dir/val.csv too, or else a fixed --val-fraction of train.csv; and a
    --data-dir/test.csv (optional), the test split."""
    root, notes = Path(cfg.data_dir), []  # rows read as data, or dropped as repeats: said at start-up
    rows = {split: csv_rows(root, f"{split}.csv", notes) for split in ("train", "val", "test")
            if split == "train" or (root / f"{split}.csv").is_file()}
    if len(names := sorted({label for _, label in rows["train"]})) < 2:
        raise UserError(f"csv: {named(root / 'train.csv')} has 1 label ({names[0]!r}); a classifier needs "
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
                         f"({', '.join(map(named, shared[:3]))}): their {split} scores are no held-out "
                         "measure; list each file in one of them")
    return image_files(cfg, {split: [(file, index[label]) for file, label in listed]
                              for split, listed in rows.items()}, names, notes=notes)


def hold_out(labels: torch.Tensor, fraction: float, dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A training split's indices divided into train and val: round(`fraction` x N) examples held out, each
    class's share in proportion to its size (stratified; the largest remainders round up) but never its
    last example, which training needs; drawn with the split's own seed: every run, --seed and process
    holds out the same ones."""
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


# ---------------------------------------------------------------- files and statistics

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
        shown, folder = named(path), Path(path).parent.name
        raise UnreadableImage(f"cannot read image {shown} (class folder {folder!r}): {reason}") from None


def named(path) -> str:  # a path in a one-line message: repr'd if it holds a control character
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
            return skipped.setdefault(reason, []).append(named(path.relative_to(split)))
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


def image_files(cfg: Config, splits: dict[str, list], names: list[str], notes=()) -> Source:
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
    listed = {split: "\n".join(f"{os.path.relpath(path, cfg.data_dir)}\t{label}" for path, label in items)
              for split, items in splits.items()}  # where a split's files moved (a row appended, say)
    listed = {split: hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]
              for split, text in listed.items()}
    return Source(files["train"], files["val"], names, pad=max(size // 8, 1), flip=True, stats=stats,
                  notes=list(notes), test=files.get("test"), files=listed)


def csv_rows(root: Path, name: str, notes: list[str], labels: bool = True) -> list[tuple[Path, str | None]]:
    """root/name's rows under its header: a file (relative to root), and with labels its label (next), each
    file once: a repeated row is dropped (else a copy of a training row could land in the held-out split),
    and said in `notes`; a file listed with two labels is refused. A first row that names a file under root
    is no header but data: kept, and said in `notes`."""
    try:  # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which is no part of a file name
        with open(root / name, newline="", encoding="utf-8-sig") as f:
            text = f.read()
        first = text.partition("\n")[0]
        separator = ";" if labels and ";" in first and "," not in first else ","  # Excel's, "," a decimal
        records = list(csv.reader(io.StringIO(text, newline=""), delimiter=separator))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"csv: cannot read {named(root / name)} as UTF-8 rows of file,label under a header "
                        f"({type(err).__name__})") from None
    if separator == ";":
        notes.append(f"csv: {named(root / name)} separates its fields with ';' (as Excel does in some "
                     "languages): read so")
    start = 0 if records and records[0] and (root / records[0][0].strip()).is_file() else 1
    if start == 0:
        notes.append(f"csv: {named(root / name)} has no header (its first row names a file): read as data")
    if labels and (empty := [i for i, row in enumerate(records, 1)  # numbered as a spreadsheet shows them
                             if i > start and row and (len(row) < 2 or not row[1].strip())]):
        shown = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise UserError(f"csv: {named(root / name)} has rows without a label: "
                        f"{'rows' if len(empty) > 1 else 'row'} {shown} (the header is row 1); give each its "
                        "class after the file (file,label)")
    rows = [(root / row[0].strip(), row[1].strip() if labels else None) for row in records[start:] if row]
    if not rows or (missing := next((file for file, _ in rows if not file.is_file()), None)):
        what = f"names {named(missing)}, which does not exist" if rows else "has no rows"
        raise UserError(f"csv: {named(root / name)} {what}")
    if not labels:  # --predict's list: every row as it is
        return rows
    known = {}  # each file's first row, in order
    for file, label in rows:
        if (first := known.setdefault(os.path.normpath(file), (file, label))[1]) != label:
            raise UserError(f"csv: {named(root / name)} lists {named(file)} with two labels ({first!r} and "
                            f"{label!r}); keep one row per file, with its class")
    if repeats := len(rows) - len(known):
        notes.append(f"csv: {named(root / name)} repeats rows: dropped {repeats} repeats of a file and its "
                     "label, each file is read once")
    return list(known.values())

