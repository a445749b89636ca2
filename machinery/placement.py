"""Where a run's examples live while it trains, by what fits: on the device (tensors, and image files
decoded once: image_cache.py), in host memory with each batch gathered there and copied without blocking
(pinned, on CUDA), or read from files by DataLoader workers (a Dataset of a fork's, or image files too many
to hold). --loader forces one; start-up says which was taken, and why."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from configs import Config, UserError
from machinery import image_cache
from machinery.batches import DEVICE_MEMORY_SHARE
from machinery.files import shown_size
from machinery.image_files import ImageFiles
from machinery.inputs import total_bytes

HOST_MEMORY_SHARE = 0.5  # of the memory the machine has available, shared by its processes


@dataclass(frozen=True)
class Placement:
    where: str  # "device", "host" (CUDA: batches gathered in host memory) or "dataloader" (workers)
    why: str  # said at start-up


def held_bytes(splits: dict) -> int | None:
    """What the splits take held: tensors' bytes, or image files' once decoded (uint8); None where a
    split is a Dataset only workers can read."""
    total = 0
    for examples in splits.values():
        if isinstance(examples, tuple):
            total += total_bytes(examples[0]) + total_bytes(examples[1])
        elif isinstance(examples, ImageFiles):
            total += len(examples) * (examples.channels * examples.size ** 2 + 8)
        else:
            return None
    return total


def place(mode: str, device: torch.device, *, needed: int | None, decoded: bool) -> Placement:
    """Where the splits live: `mode` is --loader; `needed` held_bytes'; `decoded`: image files, which take
    host memory only once decoded (tensors a Source gives are there already)."""
    if needed is None:
        if mode in ("device", "host"):
            raise UserError(f"--loader {mode} holds tensors or image files, and this dataset's Dataset is "
                            "read by DataLoader workers; use --loader auto or dataloader")
        return Placement("dataloader", "a Dataset, read by workers")
    cuda = device.type == "cuda"
    if mode != "auto":
        return Placement(mode if cuda or mode == "dataloader" else "device", f"--loader {mode}")
    size, memory = shown_size(needed), available_memory()
    host_share = HOST_MEMORY_SHARE * memory / int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if memory else None
    fits_host = not decoded or host_share is None or needed <= host_share
    host_said = (f"{size} fit in {HOST_MEMORY_SHARE:.0%} of the {shown_size(memory)} of memory available"
                 if memory else f"{size}; the memory available is unknown here")
    if not fits_host:
        return Placement("dataloader", f"{size} decoded would not fit in {HOST_MEMORY_SHARE:.0%} of the "
                         f"{shown_size(memory)} of memory available")
    if not cuda:
        return Placement("device", host_said if decoded else "tensors in memory")
    free = torch.cuda.mem_get_info(device)[0]
    gpu = f"{DEVICE_MEMORY_SHARE:.0%} of the GPU's {shown_size(free)} free"
    if needed <= DEVICE_MEMORY_SHARE * free:
        return Placement("device", f"{size} fit in {gpu}")
    return Placement("host", f"{size} exceed {gpu}: batches are gathered in host memory")


def held(cfg: Config, splits: dict, device: torch.device, notes: list[str]) -> tuple[dict, Placement, dict]:
    """Where the splits live (place), with image files that fit decoded once (image_cache.py) into
    (uint8 images, class ids) tensors, said in `notes`; and their images' digests (image_cache.digests)."""
    decodable = all(isinstance(examples, ImageFiles) for examples in splits.values())
    held = place(cfg.loader, device, needed=held_bytes(splits), decoded=decodable)
    where = {"device": f"on {device.type}", "host": "in host memory"}.get(held.where)
    if decodable and where:
        folder = image_cache.cache_folder(cfg.image_cache, cfg.data_dir)
        done = image_cache.decode_splits(splits, folder)
        said = image_cache.describe(folder, done)
        notes.append(f"image files decoded once, held {where} ({held.why}): {said}")
        held_splits = {split: (d.images, torch.tensor(splits[split].targets)) for split, d in done.items()}
        return held_splits, held, {split: d.digests for split, d in done.items()}
    if decodable:
        notes.append(f"image files read every epoch by DataLoader workers ({held.why})")
    elif held.where == "host":
        notes.append(f"tensors held in host memory ({held.why})")
    return splits, held, None


def available_memory() -> int | None:
    """The bytes this machine can still give (Linux's MemAvailable; elsewhere the free pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
