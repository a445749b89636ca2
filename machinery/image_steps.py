"""What image batches get on the device, in whole batches: crop and flip (training only), resizing to a
model's size, channels_last and normalization from 0..255; and the start-up lines that say which."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from configs import Config, UserError
from machinery.contract import Targets
from machinery.inputs import members, named


@dataclass
class ImageSteps:
    """What image batches get on the device: crop and flip (training only), then normalization."""

    mean: torch.Tensor  # per channel, in [0, 1]
    std: torch.Tensor
    pad: int = 0
    flip: bool = False
    channels_last: bool = False
    resize: int = 0  # square size a model needs (a ViT, say); 0 keeps the images' own


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


def image_steps_note(image: ImageSteps, targets: Targets, cfg: Config, which: str = "") -> str:
    """Which image steps the training batches get, and how the targets follow them, said at start-up; a
    crop or flip that targets cannot follow is refused."""
    if targets.dense and image.resize:
        raise UserError(f"{cfg.model} takes {image.resize}x{image.resize} px inputs, and the per-pixel "
                        "targets cannot be resized with the images: give the dataset images of that size, or "
                        "use a model that takes these")
    if targets.dense and image.pad and targets.kind == "values" and not targets.follow:
        raise UserError("a random crop pads the images, and per-pixel values have none that counts for "
                        "nothing (class ids get IGNORE_INDEX): pass --no-augment, or set pad=0 in the "
                        "dataset's Source")
    if (image.pad or image.flip) and not (targets.follow or targets.dense or targets.per_example):
        what = ('TARGETS = "any" targets' if targets.kind == "any" else
                f"{targets.kind} targets that are neither one per example nor one per pixel")
        raise UserError(f"{cfg.dataset}'s images get crops and flips (pad={image.pad}, flip={image.flip}), "
                        f"and the template cannot move {what} with them: define augmented_targets(targets, "
                        "shifts, flips, size) in task.py (docs/your_data.md), set pad=0 and flip=False in "
                        "the dataset's Source, or pass --no-augment")
    steps = ([f"a random crop after {image.pad} px of zero padding"] if image.pad else []) + (
        ["random left-right flips (--no-flip where a mirror changes the class: digits, text)"] if image.flip
        else [])
    if not steps:
        why = "--no-augment" if not cfg.augment else f"none for {cfg.dataset}"
        return f"images{which}: no crop or flip ({why})"
    moved = ("; the targets follow them by task.py's augmented_targets" if targets.follow else
             "; the per-pixel targets move with them" if targets.dense else "")  # one per example: they stay
    return f"images{which}: {' and '.join(steps)} on training batches{moved}"


def fit_images(cfg: Config, needs, shape: tuple[int, int], stats: tuple, notes: list[str]
                ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The side images of shape (channels, size) are resized to for cfg.model (0: none), and the mean and
    std they are normalized with (`stats`, or --pretrained weights'); what changed goes into `notes`."""
    (channels, size), (mean, std), resize = shape, stats, 0
    if needs.size and (size != needs.size if needs.exact else size < needs.size):
        want = f"{'exactly' if needs.exact else 'at least'} {needs.size}x{needs.size} px"
        if cfg.image_size and cfg.dataset in ("imagefolder", "csv", "synthetic"):
            raise UserError(f"{cfg.model} takes inputs of {want}; pass --image-size {needs.size} or none")
        resize = needs.size
        notes.append(f"{cfg.model} takes inputs of {want}: the {size}x{size} images are resized to {resize}x"
                     f"{resize} on the device")
    if needs.mean:  # --pretrained: the normalization the weights were trained with
        mean, std = torch.tensor(needs.mean), torch.tensor(needs.std)
        if channels != 3:
            mean, std = mean.mean().repeat(channels), std.mean().repeat(channels)
        notes.append(f"inputs normalized with {needs.weights}'s mean and std")
    return resize, mean, std


STATS_SAMPLE = 256  # training examples a Dataset's image statistics are read from, spread over it


def sampled_stats(dataset, key, channels: int, notes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and std, in [0, 1], of the uint8 image input `key` (machinery/inputs.py) of
    STATS_SAMPLE examples spread evenly over a Dataset's (all of them, if fewer), read in this process, and
    said in `notes`. torch's RNG is left as it was, in case the Dataset draws from it."""
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
