"""Image files as a dataset: the folder scan (torchvision's ImageFolder layout), CSV lists of files, and
the per-file read every path shares (training, evaluation, --predict and the decoded-image cache): PIL,
resized on the short side and center-cropped to one size, uint8 [C, S, S], RGB or grayscale."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from pathlib import Path

import numpy as np
import torch

from configs import UserError, first_line
from machinery.stops import UnreadableImage

IMAGE_SUFFIXES = tuple(".jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp .gif".split())  # ImageFolder's, GIF
READER_VERSION = 1  # of read_image and ImageFiles.read: a change to their pixels bumps it (the cache's key)


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
        shown, folder = printable(path), Path(path).parent.name
        raise UnreadableImage(f"cannot read image {shown} (class folder {folder!r}): {reason}") from None


class ImageFiles(torch.utils.data.Dataset):
    """(path, class index) pairs read as images at `size` (resized on the short side, center-cropped), with
    `channels` 3 (RGB) or 1 (grayscale), as ImageFolder reads its folders. `root`: what the paths are
    relative to in a checkpoint's record and the cache's key (--data-dir)."""

    def __init__(self, items: list[tuple[Path, int]], size: int, channels: int, root: str | Path):
        self.items, self.size, self.channels, self.root = items, size, channels, Path(root)
        self.mode = "L" if channels == 1 else "RGB"
        self.targets = [label for _, label in items]  # read without the images, as ImageFolder's

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.read(i), self.items[i][1]

    def read(self, i: int) -> torch.Tensor:
        """The i-th file's pixels, uint8 [C, size, size]: the one read every path shares."""
        return fitted(read_image(str(self.items[i][0]), self.mode), self.size)

    def relative(self) -> list[str]:
        """Each file's path relative to `root`, as the checkpoint and the cache record it."""
        return [os.path.relpath(path, self.root) for path, _ in self.items]

    def fingerprint(self) -> str:
        """A hash of the list (file and class), which a checkpoint keeps: a resume and evaluate.py tell
        other files of the same count from the run's own."""
        pairs = zip(self.relative(), self.targets, strict=True)
        text = "\n".join(f"{file}\t{label}" for file, label in pairs)
        return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def fitted(image, size: int) -> torch.Tensor:
    """A PIL image resized on its short side to `size` (PIL's bilinear, which antialiases) and cropped to
    size x size at its center, as uint8 [C, size, size]: what torchvision's Resize(size), CenterCrop(size)
    and PILToTensor() give, step for step (tests compare them), without importing torchvision: 2 s of
    every run's start-up, most of a cached run's."""
    from PIL import Image

    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    scaled = (size, int(size * long / short))  # the short side, the long side
    resized = scaled if width <= height else scaled[::-1]
    if resized != (width, height):
        image = image.resize(resized, Image.BILINEAR)
    left, top = (int(round((side - size) / 2.0)) for side in resized)
    pixels = np.array(image.crop((left, top, left + size, top + size)), copy=True)
    return torch.from_numpy(pixels).view(size, size, -1).permute(2, 0, 1)


def printable(path) -> str:
    """A path in a one-line message: repr'd if it holds a control character (a newline in a name)."""
    return str(path) if str(path).isprintable() else repr(str(path))


# ---------------------------------------------------------------- an image folder


def folder_splits(root: Path) -> tuple[dict[str, list[tuple[Path, int]]], list[str], list[str]]:
    """root/{train,val}/<class>/<image> (and an optional test/): each split's sorted (path, class index)
    pairs, the class names (the sorted folder names, as ImageFolder's find_classes), and the notes of what
    was skipped; a layout that cannot train is one line."""
    splits = ("train", "val", "test") if (root / "test").is_dir() else ("train", "val")
    layout = f"expected {printable(root)}/train/<class>/*.png|jpg and {printable(root)}/val/<class>/*"
    if missing := [root / split for split in splits if not (root / split).is_dir()]:
        raise UserError(f"imagefolder: {printable(missing[0])} is missing; {layout}")
    names, *held_names = (sorted(d.name for d in (root / split).iterdir() if d.is_dir()) for split in splits)
    for split, found in zip(splits, (names, *held_names), strict=True):
        if not found and split != "train":
            raise UserError(f"imagefolder: {printable(root / split)} is empty; give it a folder per class as "
                            f"train/ has ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                            f"{', or remove it: a test split is optional' if split == 'test' else ''}")
        if len(found) < 2:  # one level too high: train/ holds one folder that holds the classes
            raise UserError(f"imagefolder: {printable(root / split)} holds {len(found)} class folder"
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
            raise UserError(f"imagefolder: {printable(root / split)} holds no images{_skipped(skipped)}; the "
                            f"{split} split needs some {', '.join(IMAGE_SUFFIXES)} files (convert others, "
                            "HEIC say, to JPEG)")
    notes = [note for _, said in scanned.values() for note in said]
    return {at: items for at, (items, _) in scanned.items()}, names, notes


def _skipped(notes: list[str]) -> str:  # _scan's note of a split, in a message about that split
    return "".join(f" ({note.removeprefix('imagefolder: ')})" for note in notes)


def _scan(split: Path, names: list[str], classes: dict[str, str]) -> tuple[list[tuple[Path, int]], list[str]]:
    """Each class folder's images as sorted (path, class index) pairs, and a note of what was skipped. Links
    are followed once, after the real entries: what is reached twice is read once; a link into another
    class's folder (`classes`: their real paths; either split) is skipped, as its images are that class's.
    (torchvision's make_dataset follows a link loop for ever, and names nothing it skips.)"""
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
            return skipped.setdefault(reason, []).append(printable(path.relative_to(split)))
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


# ---------------------------------------------------------------- a CSV of files


def csv_rows(root: Path, name: str, notes: list[str], labels: bool = True) -> list[tuple[Path, str | None]]:
    """root/name's rows under its header: a file (relative to root), and with labels its label (next), each
    file once: a repeated row is dropped (else a copy of a training row could land in the held-out split),
    and said in `notes`; a file listed with two labels is refused. A first row that names a file under root
    is no header but data: kept, and said in `notes`."""
    shown = printable(root / name)
    try:  # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which is no part of a file name
        with open(root / name, newline="", encoding="utf-8-sig") as f:
            text = f.read()
        first = text.partition("\n")[0]
        separator = ";" if labels and ";" in first and "," not in first else ","  # Excel's, "," a decimal
        records = list(csv.reader(io.StringIO(text, newline=""), delimiter=separator))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"csv: cannot read {shown} as UTF-8 rows of file,label under a header "
                        f"({type(err).__name__})") from None
    if separator == ";":
        notes.append(f"csv: {shown} separates its fields with ';' (as Excel does in some languages): read so")
    start = 0 if records and records[0] and (root / records[0][0].strip()).is_file() else 1
    if start == 0:
        notes.append(f"csv: {shown} has no header (its first row names a file): read as data")
    if labels and (empty := [i for i, row in enumerate(records, 1)  # numbered as a spreadsheet shows them
                             if i > start and row and (len(row) < 2 or not row[1].strip())]):
        listed = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise UserError(f"csv: {shown} has rows without a label: {'rows' if len(empty) > 1 else 'row'} "
                        f"{listed} (the header is row 1); give each its class after the file (file,label)")
    rows = [(root / row[0].strip(), row[1].strip() if labels else None) for row in records[start:] if row]
    if not rows or (missing := next((file for file, _ in rows if not file.is_file()), None)):
        what = f"names {printable(missing)}, which does not exist" if rows else "has no rows"
        raise UserError(f"csv: {shown} {what}")
    if not labels:  # --predict's list: every row as it is
        return rows
    known = {}  # each file's first row, in order
    for file, label in rows:
        if (first := known.setdefault(os.path.normpath(file), (file, label))[1]) != label:
            raise UserError(f"csv: {shown} lists {printable(file)} with two labels ({first!r} and "
                            f"{label!r}); keep one row per file, with its class")
    if repeats := len(rows) - len(known):
        notes.append(f"csv: {shown} repeats rows: dropped {repeats} repeats of a file and its label, each "
                     "file is read once")
    return list(known.values())
