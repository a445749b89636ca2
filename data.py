"""Datasets by name, served as batches of normalized (inputs, targets) on the training device.

Images stay uint8 until the last moment. Small datasets live on the device and are cropped,
flipped and normalized there in whole batches (airbench-style); ImageFolder and anything too
large goes through a DataLoader with workers, then gets the same batched device-side treatment.
Each epoch's order and augmentation come from a generator seeded by (seed, epoch), so a resumed
run or a DDP rank sees exactly the batches it would have seen.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from configs import Config, UserError
from models import input_needs

TORCHVISION_SETS = {
    "mnist": ("MNIST", 10),
    "fashion_mnist": ("FashionMNIST", 10),
    "cifar10": ("CIFAR10", 10),
    "cifar100": ("CIFAR100", 100),
}
PADDING = {"digits": 1, "mnist": 2, "fashion_mnist": 2, "cifar10": 4, "cifar100": 4, "synthetic": 0}
FLIPS = {"cifar10", "cifar100", "imagefolder"}  # left-right flips keep these labels
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
DEVICE_MEMORY_SHARE = 0.25  # auto mode keeps data on a GPU only if it takes at most this share


@dataclass
class DataInfo:
    num_classes: int
    channels: int
    image_size: int
    train_size: int
    val_size: int
    loader: str  # what serves the batches, said once at start-up
    class_names: list[str] = field(default_factory=list)  # the dataset's, or the class numbers
    notes: list[str] = field(default_factory=list)  # resizing and normalization, said once at start-up


def _epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch


def epoch_plan(n: int, seed: int, epoch: int, *, shuffle: bool, pad: int = 0, flip: bool = False,
               rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's example order, crop offsets and flip flags for one epoch (CPU tensors).

    Everything is drawn for the whole dataset from one (seed, epoch) generator and then sharded,
    so results depend on neither the device nor where in the epoch a resumed run starts.
    """
    g = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    if shuffle:
        order = torch.randperm(n, generator=g)
        usable = n // world_size * world_size  # equal shards, as DistributedSampler(drop_last)
    else:
        order = torch.arange(n)
        usable = n
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n,), generator=g, dtype=torch.bool) & flip
    shard = slice(rank, usable, world_size)
    return order[shard], offsets[shard], flips[shard]


def augment(images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, pad: int) -> torch.Tensor:
    """Random crop after zero padding, then horizontal flip, for a whole uint8 batch at once.

    One gather does both: each output pixel's flat index into its padded image, with flipped
    images reading their columns backwards. About 5x faster on CPU than 4-D fancy indexing.
    Nothing here reads from the device (that would sync every batch), so the caller, who knows
    whether there is a pad or any flipping, skips the call when there is neither.
    """
    n, c, h, w = images.shape
    padded_h, padded_w = h + 2 * pad, w + 2 * pad
    padded = F.pad(images, (pad, pad, pad, pad)).reshape(n, -1)
    span = torch.arange(w, device=images.device)
    cols = offsets[:, 1, None] + torch.where(flips[:, None], span.flip(0), span)
    rows = (offsets[:, 0, None] + torch.arange(h, device=images.device)) * padded_w
    planes = torch.arange(c, device=images.device) * (padded_h * padded_w)
    index = planes[None, :, None, None] + rows[:, None, :, None] + cols[:, None, None, :]
    return padded.gather(1, index.reshape(n, -1)).reshape(n, c, h, w)


class _Indices(torch.utils.data.Sampler):
    """The sampler of a DataLoader that lives across epochs: each epoch sets its own order."""

    def __init__(self):
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Batches:
    """Batches for one split, from device-resident tensors or from a DataLoader.

    `epoch(e, start)` yields this rank's batches of epoch e from batch `start` on; iterating the
    object itself replays epoch 0 (enough for lr_find). Training drops the last partial batch,
    evaluation never does.
    """

    def __init__(self, source, labels: torch.Tensor | None, *, batch_size: int, train: bool,
                 mean: torch.Tensor, std: torch.Tensor, pad: int, flip: bool, seed: int,
                 device: torch.device, rank: int = 0, world_size: int = 1,
                 channels_last: bool = False, num_workers: int = 0, resize: int = 0):
        self.source, self.labels = source, labels
        self.on_device = isinstance(source, torch.Tensor)
        self.batch_size, self.train, self.pad, self.flip = batch_size, train, pad, flip
        self.seed, self.device, self.rank, self.world_size = seed, device, rank, world_size
        self.channels_last, self.num_workers = channels_last, num_workers
        self.resize = resize  # square size a model needs (a ViT, say); 0 keeps the images' own
        self._loader = None
        self.scale = (1 / (255 * std)).view(1, -1, 1, 1).to(device)
        self.shift = (mean / std).view(1, -1, 1, 1).to(device)

    @property
    def num_examples(self) -> int:
        return len(self.source)

    def __len__(self) -> int:
        n = self.num_examples
        if self.train:
            return n // self.world_size // self.batch_size
        return math.ceil(len(range(self.rank, n, self.world_size)) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.epoch(0)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pad = self.pad if self.train else 0
        order, offsets, flips = epoch_plan(
            self.num_examples, self.seed, epoch, shuffle=self.train, pad=pad,
            flip=self.flip and self.train, rank=self.rank, world_size=self.world_size)
        count, bs = len(self), self.batch_size
        order, offsets, flips = (t[: count * bs] for t in (order, offsets, flips))
        offsets, flips = offsets.to(self.device), flips.to(self.device)
        if self.on_device:
            order = order.to(self.device)
            raw = ((self.source[order[i * bs:(i + 1) * bs]], self.labels[order[i * bs:(i + 1) * bs]])
                   for i in range(start, count))
        else:
            raw = self._from_workers(order[start * bs:].tolist())
        for i, (images, targets) in enumerate(raw, start):
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if self.train and (pad or self.flip):
                window = slice(i * bs, i * bs + len(images))
                images = augment(images, offsets[window], flips[window], pad)
            yield self._normalize(images), targets

    def _from_workers(self, indices: list[int]):
        """One DataLoader for all epochs: its workers start once, not at every epoch and evaluation.

        Its sampler's indices are swapped before each pass, so one pass at a time per Batches.
        It has a generator of its own: each pass would otherwise draw its workers' seed from the
        global RNG, which dropout also draws from, and a resumed run (or one after --lr find)
        would start its passes at other points of that stream than an uninterrupted one.
        """
        if self._loader is None:
            self._sampler = _Indices()
            self._loader = torch.utils.data.DataLoader(
                self.source, batch_size=self.batch_size, sampler=self._sampler,
                num_workers=self.num_workers, pin_memory=self.device.type == "cuda",
                persistent_workers=self.num_workers > 0,
                generator=torch.Generator().manual_seed(self.seed))
        self._sampler.indices = indices
        return iter(self._loader)

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        memory = torch.channels_last if self.channels_last else torch.contiguous_format
        x = images.to(dtype=torch.float32, memory_format=memory)
        if self.resize:
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear",
                              align_corners=False).contiguous(memory_format=memory)
        return x.mul_(self.scale).sub_(self.shift)

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        """Batches as the model receives them back to pixel values in [0, 1], to look at."""
        return ((inputs.float() + self.shift) / self.scale / 255).clamp_(0, 1)


def _digits() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images * (255 / 16)).round().to(torch.uint8).unsqueeze(1)
    labels = torch.from_numpy(bunch.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1797))
    val, train = order[:360], order[360:]
    return images[train], labels[train], images[val], labels[val]


def _synthetic(cfg: Config) -> tuple[torch.Tensor, ...]:
    """Class templates (smooth random patterns) plus noise: learnable, deterministic, any shape."""
    size = cfg.image_size or 16
    g = torch.Generator().manual_seed(12345)
    coarse = torch.rand(cfg.num_classes, cfg.channels, 4, 4, generator=g)
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
        noise = torch.randn(n, cfg.channels, size, size, generator=g) * 0.25
        images = ((templates[labels] + noise).clamp(0, 1) * 255).round().to(torch.uint8)
        return images, labels

    train, val = draw(cfg.synthetic_size), draw(cfg.synthetic_val_size or max(cfg.synthetic_size // 4, 1))
    return *train, *val


def _torchvision_set(cfg: Config) -> tuple:
    """Train images, labels, val images, labels, and the class names."""
    import torchvision

    class_name, _ = TORCHVISION_SETS[cfg.dataset]
    cls = getattr(torchvision.datasets, class_name)
    root = Path(cfg.data_dir)
    # Under torchrun, rank 0 alone downloads while the others wait at a barrier: several
    # processes writing the same archive at once would corrupt it.
    distributed = dist.is_available() and dist.is_initialized()
    downloader = not distributed or dist.get_rank() == 0
    if not downloader:
        dist.barrier()
    try:
        splits = [cls(str(root), train=t, download=False) for t in (True, False)]
    except RuntimeError:
        # Folders a failed download would leave empty behind it, deepest first.
        absolute = root.absolute()
        created = [d for d in (absolute / class_name / "raw", absolute / class_name, absolute,
                               *absolute.parents) if not d.exists()]
        try:
            if not downloader:
                raise RuntimeError("rank 0 could not download it")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                splits = [cls(str(root), train=t, download=True) for t in (True, False)]
        except Exception as err:
            for folder in created if downloader else ():
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if still empty
            raise UserError(
                f"dataset {cfg.dataset} is not in {root.resolve()} and could not be downloaded "
                f"({type(err).__name__}); run once with network access, or copy the "
                f"torchvision {class_name} files there and pass --data-dir"
            ) from None
    finally:
        if downloader and distributed:
            dist.barrier()
    out = []
    for ds in splits:
        images = torch.as_tensor(ds.data)
        images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
        out += [images.contiguous(), torch.as_tensor(ds.targets).long()]
    return *out, getattr(splits[0], "classes", None)


class UnreadableImage(UserError):
    """An image file that cannot be decoded; the message names the file and its class folder.

    A DataLoader worker's exception reaches the main process as its type called with the whole
    worker traceback as text; keeping only the traceback's last line (ours) keeps one line.
    """

    def __init__(self, message: str):
        if "Original Traceback" in message:
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


def read_image(path: str, mode: str = "RGB"):
    """torchvision's PIL loader, failing with one line that says which file and class it was.
    `mode` is PIL's: "RGB", or "L" for grayscale."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert(mode)
    except Exception as err:  # decoders raise OSError, SyntaxError, ValueError, struct.error, ...
        reason = "not an image format PIL can read" if isinstance(err, UnidentifiedImageError) else (
            str(err).strip().splitlines()[0][:100] if str(err).strip() else type(err).__name__)
        raise UnreadableImage(f"cannot read image {path} (class folder {Path(path).parent.name!r}): "
                              f"{reason}") from None


def _image_folder(cfg: Config, size: int):
    from torchvision import datasets, transforms

    root = Path(cfg.data_dir)
    if cfg.channels not in (1, 3):
        raise UserError(f"imagefolder loads images as RGB (--channels 3) or grayscale (--channels 1), "
                        f"not with {cfg.channels} channels")
    layout = f"expected {root}/train/<class>/*.png|jpg and {root}/val/<class>/*"
    loader = functools.partial(read_image, mode="L" if cfg.channels == 1 else "RGB")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UserError(f"imagefolder: {root / split} is missing; {layout}")
    tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                             transforms.PILToTensor()])
    try:
        train, val = (datasets.ImageFolder(str(root / s), transform=tf, loader=loader)
                      for s in ("train", "val"))
    except (FileNotFoundError, RuntimeError) as err:
        raise UserError(f"imagefolder: {str(err).splitlines()[0]}; {layout}") from None
    if train.classes != val.classes:
        raise UserError(f"imagefolder: train classes {train.classes} differ from val {val.classes}")
    return train, val, len(train.classes)


def _stats(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = images.float().div_(255).transpose(0, 1).reshape(images.shape[1], -1)
    return x.mean(1), x.std(1).clamp_min(1e-3)


def _fits_on(device: torch.device, nbytes: int) -> bool:
    if device.type != "cuda":
        return True  # the tensors are already in host memory
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= DEVICE_MEMORY_SHARE * free


def build_loaders(cfg: Config, device: torch.device, rank: int = 0,
                  world_size: int = 1) -> tuple[Batches, Batches, DataInfo]:
    """Train and val batches for `cfg.dataset` on `device`, sharded for this rank."""
    if cfg.batch_size % world_size:
        raise UserError(f"batch_size {cfg.batch_size} must divide evenly over {world_size} processes")
    per_rank = cfg.batch_size // world_size
    needs = input_needs(cfg.model, cfg.pretrained)  # its input size; --pretrained: its normalization
    if cfg.dataset == "imagefolder":
        size = cfg.image_size or needs.crop or max(needs.size, 32)
        train, val, num_classes = _image_folder(cfg, size)
        channels, names = cfg.channels, train.classes
        mean, std = (torch.tensor(s) for s in IMAGENET_STATS)
        if channels == 1:  # grayscale: the average of ImageNet's channel statistics
            mean, std = mean.mean().view(1), std.mean().view(1)
        sources, mode = ((train, None), (val, None)), "dataloader"
        if cfg.loader == "device":
            raise UserError("imagefolder reads files through workers; use --loader dataloader")
    else:
        if cfg.dataset == "digits":
            tensors, num_classes, names = _digits(), 10, [str(d) for d in range(10)]
        elif cfg.dataset == "synthetic":
            tensors, num_classes, names = _synthetic(cfg), cfg.num_classes, None
        else:
            *tensors, names = _torchvision_set(cfg)
            num_classes = TORCHVISION_SETS[cfg.dataset][1]
        x_train, y_train, x_val, y_val = tensors
        channels, size = x_train.shape[1], x_train.shape[-1]
        mean, std = _stats(x_train)
        mode = cfg.loader
        if mode == "auto":
            fits = _fits_on(device, x_train.numel() + x_val.numel())
            mode = "device" if fits else "dataloader"
        if mode == "device":
            sources = ((x_train.to(device), y_train.to(device)), (x_val.to(device), y_val.to(device)))
        else:
            ds = torch.utils.data.TensorDataset
            sources = ((ds(x_train, y_train), None), (ds(x_val, y_val), None))
    notes, resize = [], 0
    if needs.size and (size != needs.size if needs.exact else size < needs.size):
        want = f"{'exactly' if needs.exact else 'at least'} {needs.size}x{needs.size} px"
        if cfg.image_size and cfg.dataset in ("imagefolder", "synthetic"):
            raise UserError(f"{cfg.model} takes inputs of {want}; pass --image-size {needs.size} "
                            "(or leave it out)")
        resize = needs.size
        notes.append(f"{cfg.model} takes inputs of {want}: the {size}x{size} images are resized to "
                     f"{resize}x{resize} on the device")
    if needs.mean:  # --pretrained: the normalization the weights were trained with
        mean, std = torch.tensor(needs.mean), torch.tensor(needs.std)
        if channels != 3:
            mean, std = mean.mean().repeat(channels), std.mean().repeat(channels)
        notes.append(f"inputs normalized with {needs.weights}'s mean and std")
    common = dict(mean=mean, std=std, pad=PADDING.get(cfg.dataset, max(size // 8, 1)),
                  flip=cfg.flip and cfg.dataset in FLIPS, seed=cfg.seed, device=device, rank=rank,
                  world_size=world_size, channels_last=cfg.channels_last,
                  num_workers=cfg.num_workers, resize=resize)
    if not cfg.augment:
        common.update(pad=0, flip=False)
    (train_src, train_lab), (val_src, val_lab) = sources
    train_batches = Batches(train_src, train_lab, batch_size=per_rank, train=True, **common)
    val_batches = Batches(val_src, val_lab, batch_size=per_rank, train=False, **common)
    if len(train_batches) == 0:
        raise UserError(f"batch_size {cfg.batch_size} is larger than the {cfg.dataset} training "
                        f"set ({train_batches.num_examples}); lower --batch-size")
    loader = (f"device-resident uint8 tensors on {device.type}" if mode == "device"
              else f"DataLoader with {cfg.num_workers} workers")
    names = list(names) if names else [str(i) for i in range(num_classes)]
    info = DataInfo(num_classes, channels, resize or size, train_batches.num_examples,
                    val_batches.num_examples, loader, names, notes)
    return train_batches, val_batches, info
