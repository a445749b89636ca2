"""Image files decoded once: a split's pixels as the per-file read gives them (ImageFiles.read), decoded in
parallel and kept in one file per split (--image-cache; by default --data-dir/.image-cache/), uint8 and
memory-mapped, which later runs, lr_find.py and evaluate.py read instead of the images.

A split's cache file is keyed by its files (each one's path, size, modification time, status-change time
and inode: what one stat gives, so a file replaced in place with its old size and modification time, as
`rsync -a` or an archive with fixed times leaves it, has a new ctime or inode), the size and channels they
are read at and the reader's version: a file changed, added or removed is decoded again, and the others'
pixels come from the file as it was; an entry that lacks a field (a file written by another version) keys
nothing. It is written whole (a temporary file, then a rename), so a run stopped while writing leaves the
old one; its header carries its own checksum, so a damaged, cut-short or unreadable file is no cache: the
images are decoded again and the start-up line says so. (The pixels are not checked: that would hash them
all every run.) Under torchrun rank 0 decodes while the others wait, then they read its file. A place that
cannot be written (a read-only data folder, a full disk) keeps nothing: the images are decoded into memory
for this run, and a start-up line says why."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from configs import UserError
from machinery import processes
from machinery.files import barrier, write_atomic
from machinery.image_files import READER_VERSION, ImageFiles, printable
from machinery.logs import progress_bar
from machinery.workers import starting, worker_init

MAGIC = b"tt-img02"  # a cache file's first bytes; then the header's length, its BLAKE2b and the header (JSON)
PAGE = 4096  # the pixels start at a page boundary, so that they map
WORKERS_FROM = 256  # files to decode from which workers pay for their start


@dataclass
class Decoded:
    """A split's pixels, and how they came: `decoded` files read now (0: all from the cache)."""

    images: torch.Tensor  # uint8 [N, C, S, S]: mapped from the cache file, or in memory
    digests: torch.Tensor  # int64 [N]: each image's pixels hashed, whatever its file's name (digests())
    decoded: int
    seconds: float
    kept: str | None  # None: in the cache; else why not (a line's end)
    unusable: str | None = None  # why the cache file there could not serve (damaged, cut short, ...)


@dataclass
class _Old:
    """A cache file as read: its key (the header less the digests), the row of each file's entry, its
    pixels (mapped) and their digests (None: not in the file)."""

    key: dict
    rows: dict[tuple, int]
    pixels: torch.Tensor
    digests: torch.Tensor | None


def cache_folder(setting: str, data_dir: str) -> Path | None:
    """Where --image-cache keeps decoded images: auto --data-dir/.image-cache, off none."""
    if setting == "off":
        return None
    return Path(data_dir) / ".image-cache" if setting == "auto" else Path(setting)


def decode_splits(files: dict[str, ImageFiles], folder: Path | None) -> dict[str, Decoded]:
    """Each split's images, from its cache file in `folder` where that holds them, else decoded now (and
    kept there). Under torchrun rank 0 decodes first; the others then read what it kept."""
    first = processes.rank() == 0
    if not first:
        barrier()  # rank 0 decodes
    try:
        return {split: decoded(images, folder, split) for split, images in files.items()}
    finally:
        if first:
            barrier()  # the others read its files now (or decode themselves: it kept none)


def decoded(files: ImageFiles, folder: Path | None, split: str) -> Decoded:
    """One split's pixels: the cache file's where its key matches, else decoded (the unchanged files'
    rows taken from the old file) and written whole."""
    started = time.perf_counter()
    shape = (len(files), files.channels, files.size, files.size)
    key = {"reader": READER_VERSION, "shape": list(shape), "files": _listed(files)}
    path = folder / f"{split}-{files.size}px-{files.mode.lower()}.u8" if folder else None
    old, unusable = _opened(path)
    if old and old.key == key:  # digests not in the file (written before them): hashed now
        hashed = old.digests if old.digests is not None else digests(old.pixels)
        return Decoded(old.pixels, hashed, 0, time.perf_counter() - started, None)
    images = torch.empty(shape, dtype=torch.uint8)
    same_read = old and old.key["shape"][1:] == key["shape"][1:] and old.key["reader"] == READER_VERSION
    rows = old.rows if same_read else {}
    kept = [(i, rows[tuple(entry)]) for i, entry in enumerate(key["files"]) if tuple(entry) in rows]
    if kept:  # the files that did not change: their pixels as they were
        new, was = (torch.tensor(column) for column in zip(*kept, strict=True))
        images[new] = old.pixels[was]
    missing = sorted(set(range(len(files))) - {i for i, _ in kept})
    _decode(files, missing, images, split)
    hashed = digests(images)
    kept = _kept(path, {**key, "digests": hashed.numpy().astype("<i8").tobytes().hex()}, images)
    said = f"the cache file {path.name} {unusable}: decoded again" if unusable else None
    return Decoded(images, hashed, len(missing), time.perf_counter() - started, kept, said)


def digests(images: torch.Tensor) -> torch.Tensor:
    """Each image's pixels hashed (64 bits of BLAKE2b): a copy of a file under another name has its
    digest, which a checkpoint keeps for its training images and evaluate.py counts (about 0.5 GB/s)."""
    rows = images.numpy()
    joined = b"".join(hashlib.blake2b(row, digest_size=8).digest() for row in rows)
    return torch.from_numpy(np.frombuffer(joined, "<i8").copy())


def _listed(files: ImageFiles) -> list[list]:
    """Each file as the key sees it: its path (relative to --data-dir), size, modification time, status-change
    time and inode (a file rewritten in place, or renamed over, with its old size and mtime has new ones)."""
    entries = []
    for (path, _), relative in zip(files.items, files.relative(), strict=True):
        try:
            stat = os.stat(path)
            entries.append([relative, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
        except OSError:  # gone since the scan: decoding it says so in one line
            entries.append([relative, -1, -1, -1, -1])
    return entries


def _opened(path: Path | None) -> tuple[_Old | None, str | None]:
    """A cache file, its pixels mapped (copy on write: nothing a run does reaches the file), or why it cannot
    serve: (None, None) where there is none, (None, why) where it is cut short, damaged, unreadable or not
    one. Its length is checked against the file before it is read, its header against its checksum."""
    if path is None:
        return None, None
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC) + 16:
                return None, "is cut short"
            if f.read(len(MAGIC)) != MAGIC:
                return None, "is of another format (another version's, or no cache file)"
            length, checksum = struct.unpack("<Q8s", f.read(16))
            if _start(length) > size:  # a damaged length: not read (it may ask for exabytes)
                return None, "is cut short or has a damaged header"
            text = f.read(length)
        if hashlib.blake2b(text, digest_size=8).digest() != checksum:
            return None, "has a damaged header"
        header = json.loads(text)
        shape = tuple(header["shape"])
        if size != _start(length) + math.prod(shape):
            return None, "is cut short"
        listed = header.pop("digests", None)  # none: a file written before the digests
        hashed = None if listed is None else torch.from_numpy(np.frombuffer(bytearray.fromhex(listed), "<i8"))
        rows = {tuple(entry): row for row, entry in enumerate(header["files"])}
        if (hashed is not None and len(hashed) != shape[0]) or len(rows) != shape[0]:
            return None, "has a damaged header"
        pixels = np.memmap(path, dtype=np.uint8, mode="c", offset=_start(length), shape=shape)
        return _Old(header, rows, torch.from_numpy(pixels), hashed), None
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"cannot be read ({err.strerror or type(err).__name__})"
    except (TypeError, ValueError, KeyError, AttributeError, struct.error):
        return None, "has a damaged header"


def _start(header_length: int) -> int:
    """Where the pixels start: the page after the header."""
    return -(-(len(MAGIC) + 16 + header_length) // PAGE) * PAGE


def _decode(files: ImageFiles, missing: list[int], into: torch.Tensor, split: str) -> None:
    """The `missing` files read into their rows, in parallel: DataLoader workers, one per CPU core this
    process may use (rank 0 decodes alone), from WORKERS_FROM files; each worker's batches as large as
    give it about four (a batch handed over costs more than its files), 32 to 512 files."""
    if not missing:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cores, 16) if len(missing) >= WORKERS_FROM else 0
    batch = max(32, min(512, len(missing) // (4 * max(workers, 1))))
    # its own generator: the global one, which seeds the model, must not depend on whether a cache existed
    loader = torch.utils.data.DataLoader(_Reads(files, missing), batch_size=batch, num_workers=workers,
                                         worker_init_fn=worker_init, generator=torch.Generator())
    done = 0
    try:
        with progress_bar(len(missing), 0, f"decoding {split} images") as bar:
            with starting():  # the workers start
                batches = iter(loader)
            for batch in batches:
                into[torch.tensor(missing[done:done + len(batch)])] = batch
                done += len(batch)
                bar.update(len(batch))
    except BaseException as err:  # an unreadable file, a signal: the workers go now, not with the frames
        traceback.clear_frames(err.__traceback__)
        raise


class _Reads(torch.utils.data.Dataset):
    """The files at `indices`, read: what the decoding workers run."""

    def __init__(self, files: ImageFiles, indices: list[int]):
        self.files, self.indices = files, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.files.read(self.indices[k])


def _kept(path: Path | None, key: dict, images: torch.Tensor) -> str | None:
    """`images` written whole to the cache file at `path`; None, or why nothing was kept."""
    if path is None:
        return "not kept (--image-cache off)"
    header = json.dumps(key).encode()
    start = _start(len(header))

    def write(f) -> None:
        f.write(MAGIC + struct.pack("<Q8s", len(header), hashlib.blake2b(header, digest_size=8).digest()))
        f.write(header)
        f.write(bytes(start - len(MAGIC) - 16 - len(header)))
        f.write(memoryview(images.numpy()).cast("B"))

    try:
        write_atomic(path, write, lambda: start + images.numel())
    except UserError as err:  # its first part: the file, why, the space it needed and the space left
        return f"not kept ({str(err).split(';')[0]}): decoded in memory for this run"
    return None


def describe(folder: Path | None, done: dict[str, Decoded]) -> str:
    """What the splits' decoding did, said at start-up: where the cache is, what was decoded."""
    parts = [f"{split} {d.decoded:,} of {len(d.images):,} decoded in {d.seconds:.1f} s"
             f"{f' ({d.unusable})' if d.unusable else ''}" if d.decoded else f"{split} from the cache"
             for split, d in done.items()]
    why = next((d.kept for d in done.values() if d.kept), None)
    where = f"cache {printable(folder)}" if folder and not why else why
    return f"{', '.join(parts)}; {where}"
