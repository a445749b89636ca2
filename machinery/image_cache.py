"""Image files decoded once: a split's pixels as the per-file read gives them (ImageFiles.read), decoded in
parallel and kept in one file per split (--image-cache; by default --data-dir/.image-cache/), uint8 and
memory-mapped, which later runs, lr_find.py and evaluate.py read instead of the images.

A split's cache file is keyed by its files (each one's path, size and modification time), the size and
channels they are read at and the reader's version: a file changed, added or removed is decoded again, and
the others' pixels come from the file as it was. It is written whole (a temporary file, then a rename), so
a run stopped while writing leaves the old one. Under torchrun rank 0 decodes while the others wait, then
they read its file. A place that cannot be written (a read-only data folder, a full disk) keeps nothing:
the images are decoded into memory for this run, and a start-up line says why."""

from __future__ import annotations

import hashlib
import json
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

MAGIC = b"tt-img01"  # a cache file's first bytes, then the header's length and the header (JSON)
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
    header, old = _opened(path)
    if header and {k: v for k, v in header.items() if k != "digests"} == key:
        kept = header.get("digests")  # none (a file written before the digests), or not whole: hashed now
        whole = isinstance(kept, str) and len(kept) == 16 * len(old)
        hashed = torch.from_numpy(np.frombuffer(bytes.fromhex(kept), "<i8").copy()) if whole else digests(old)
        return Decoded(old, hashed, 0, time.perf_counter() - started, None)
    images = torch.empty(shape, dtype=torch.uint8)
    rows = {tuple(entry): row for row, entry in enumerate(header["files"])} if header and (
        header["shape"][1:] == list(shape[1:]) and header["reader"] == READER_VERSION) else {}
    kept = [(i, rows[tuple(entry)]) for i, entry in enumerate(key["files"]) if tuple(entry) in rows]
    if kept:  # the files that did not change: their pixels as they were
        new, was = (torch.tensor(column) for column in zip(*kept, strict=True))
        images[new] = old[was]
    missing = sorted(set(range(len(files))) - {i for i, _ in kept})
    _decode(files, missing, images, split)
    hashed = digests(images)
    kept = _kept(path, {**key, "digests": hashed.numpy().astype("<i8").tobytes().hex()}, images)
    return Decoded(images, hashed, len(missing), time.perf_counter() - started, kept)


def digests(images: torch.Tensor) -> torch.Tensor:
    """Each image's pixels hashed (64 bits of BLAKE2b): a copy of a file under another name has its
    digest, which a checkpoint keeps for its training images and evaluate.py counts (about 0.5 GB/s)."""
    rows = images.numpy()
    joined = b"".join(hashlib.blake2b(row, digest_size=8).digest() for row in rows)
    return torch.from_numpy(np.frombuffer(joined, "<i8").copy())


def _listed(files: ImageFiles) -> list[list]:
    """Each file as the key sees it: its path (relative to --data-dir), size and modification time."""
    entries = []
    for (path, _), relative in zip(files.items, files.relative(), strict=True):
        try:
            stat = os.stat(path)
            entries.append([relative, stat.st_size, stat.st_mtime_ns])
        except OSError:  # gone since the scan: decoding it says so in one line
            entries.append([relative, -1, -1])
    return entries


def _opened(path: Path | None) -> tuple[dict | None, torch.Tensor | None]:
    """A cache file's header and its pixels, mapped (copy on write: nothing a run does reaches the file);
    (None, None) where there is none or it is not one (cut short, another format)."""
    try:
        with open(path, "rb") as f:
            magic, length = f.read(len(MAGIC)), struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(length)) if magic == MAGIC else None
        start = _start(length)
        shape = tuple(header["shape"])
        if os.path.getsize(path) != start + int(np.prod(shape)):
            return None, None
        pixels = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=shape)
        return header, torch.from_numpy(pixels)
    except (OSError, TypeError, ValueError, KeyError, struct.error):  # none, or not ours
        return None, None


def _start(header_length: int) -> int:
    return -(-(len(MAGIC) + 8 + header_length) // PAGE) * PAGE


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
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.write(bytes(start - len(MAGIC) - 8 - len(header)))
        f.write(memoryview(images.numpy()).cast("B"))

    try:
        write_atomic(path, write, lambda: start + images.numel())
    except UserError as err:  # its first part: the file, why, the space it needed and the space left
        return f"not kept ({str(err).split(';')[0]}): decoded in memory for this run"
    return None


def describe(folder: Path | None, done: dict[str, Decoded]) -> str:
    """What the splits' decoding did, said at start-up: where the cache is, what was decoded."""
    parts = [f"{split} {d.decoded:,} of {len(d.images):,} decoded in {d.seconds:.1f} s" if d.decoded
             else f"{split} from the cache" for split, d in done.items()]
    why = next((d.kept for d in done.values() if d.kept), None)
    where = f"cache {printable(folder)}" if folder and not why else why
    return f"{', '.join(parts)}; {where}"
