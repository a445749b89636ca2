"""Batches on the training device, in the common case: one input tensor and one target tensor a split, held on
the device and served in whole batches (airbench-style), images (uint8 [N, C, H, W]) cropped, flipped and
normalized there. Each epoch's order and crops come from a (seed, epoch) generator: a resumed run or a
torchrun rank sees what it would have. Other data is served by served.py (train.build_loaders chooses)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from configs import Config, UserError
from machinery import contract


@dataclass
class DataInfo:
    input_shape: tuple[int, ...]  # one example as the model gets it, (1, 8, 8) or (1, 256): [0] are channels
    input_dtype: torch.dtype  # as the model gets it: float32 for images (several inputs: the first one's)
    names: list[str]  # one per model output: len(names) outputs
    class_counts: torch.Tensor | None  # training examples (pixels) per class on the device; None: not classes
    train_size: int
    val_size: int
    loader: str  # what serves the batches, said once at start-up
    images: bool  # whether the image steps apply
    test_size: int | None = None  # None: the data has no test split
    notes: list[str] = field(default_factory=list)  # resizing, normalization: said once at start-up
    reading: dict | None = None  # images: how they were read (size, resize, channels, mean, std)
    batches: int = 0  # this process's training batches per epoch
    files: dict[str, str] | None = None  # file datasets: each split's list, hashed (data.Source.files)
    digests: dict[str, torch.Tensor] | None = None  # image files decoded: each image's pixels, hashed
    members: str | None = None  # several inputs: each one's shape and dtype ("[3, 8, 8] uint8 + [12] int64")

    def sizes(self) -> dict:
        return {"train_size": self.train_size, "val_size": self.val_size, "test_size": self.test_size}

    def data_record(self) -> dict:
        """What a checkpoint keeps of the data: what a resume checks, and the digests evaluate.py reads."""
        return {**self.sizes(), "batches": self.batches, "names": self.names, "files": self.files,
                "train_digests": (self.digests or {}).get("train")}

    def inputs_record(self) -> dict:
        """What a checkpoint keeps of the inputs, for evaluate.py (--predict, load_trained)."""
        dtype = str(self.input_dtype).removeprefix("torch.")
        return {"shape": list(self.input_shape), "dtype": dtype, "reading": self.reading,
                **({"members": self.members} if self.members else {})}


@dataclass
class InputNeeds:
    """What a model asks of its inputs (models.input_needs); the image steps resize and normalize to it."""

    size: int = 0  # 0: any size
    exact: bool = False  # ViTs take exactly `size`; other models at least `size`
    crop: int = 0  # --pretrained: the size the weights were trained at (ImageFolder default)
    mean: tuple[float, ...] | None = None  # --pretrained: the normalization the weights expect
    std: tuple[float, ...] | None = None
    weights: str = ""  # --pretrained: torchvision's name for them


@dataclass
class ImageSteps:
    """What image batches get on the device: crop and flip (training only), resizing, normalization."""

    mean: torch.Tensor  # per channel, in [0, 1]
    std: torch.Tensor
    pad: int = 0
    flip: bool = False
    channels_last: bool = False
    resize: int = 0  # the square size a model needs (a ViT, say); 0 keeps the images' own

    def scale_shift(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """x * scale - shift normalizes 0..255 pixels, per channel."""
        scale, shift = 1 / (255 * self.std), self.mean / self.std
        return scale.view(1, -1, 1, 1).to(device), shift.view(1, -1, 1, 1).to(device)


@dataclass(frozen=True)
class Serving:
    """How a split's batches are served: the same for the training and the validation split."""

    batch_size: int  # this process's share of the global batch
    device: torch.device
    seed: int = 0  # of the training order and augmentation (epoch_plan), and of the workers
    rank: int = 0  # under torchrun, this process's shard of each epoch
    world_size: int = 1
    num_workers: int = 0  # DataLoader workers, where the data is not on the device (served.py)
    collate: object = None  # a Dataset's examples as one batch (data.Source's); None: inputs.stacked


def epoch_plan(n: int, seed: int, epoch: int, *, pad: int = 0, flip: bool = False,
               shard: tuple[int, int] = (0, 1), class_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's training order, crop offsets and flips for an epoch, drawn for all from one (seed, epoch)
    generator, then sharded as DistributedSampler does; `class_ids` (--balance-classes): classes as likely."""
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
    """Crop after padding with `fill`, then flip, [N, C, H, W] images or [N, H, W] targets: one gather."""
    if images.ndim == 3:
        return augment(images[:, None], offsets, flips, pad, fill)[:, 0]
    n, c, h, w = images.shape
    padded_h, padded_w = h + 2 * pad, w + 2 * pad
    padded = F.pad(images, (pad, pad, pad, pad), value=fill).reshape(n, -1)
    span = torch.arange(w, device=images.device)
    cols = offsets[:, 1, None] + torch.where(flips[:, None], span.flip(0), span)  # a flip reads backwards
    rows = (offsets[:, 0, None] + torch.arange(h, device=images.device)) * padded_w
    planes = torch.arange(c, device=images.device) * (padded_h * padded_w)
    index = planes[None, :, None, None] + rows[:, None, :, None] + cols[:, None, None, :]
    return padded.gather(1, index.reshape(n, -1)).reshape(n, c, h, w)


class DeviceBatches:
    """A split on the device, one input tensor and one target tensor: `epoch(e, start)` yields this rank's
    batches of epoch e from `start` (training drops a partial last one). `image`: None for no images;
    `dense`: per-pixel targets, cropped and flipped with their images."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, serving: Serving, *, train: bool,
                 image: ImageSteps | None = None, class_ids: torch.Tensor | None = None, dense: bool = False):
        self.inputs, self.targets, self.serving, self.train = inputs, targets, serving, train
        self.image, self.class_ids, self.dense, self.device = image, class_ids, dense, serving.device
        self.num_examples = len(targets)
        if image is not None:
            self.scale, self.shift = image.scale_shift(self.device)
            self.memory = torch.channels_last if image.channels_last else torch.contiguous_format

    def __len__(self) -> int:
        n, size, ranks = self.num_examples, self.serving.batch_size, self.serving.world_size
        return n // ranks // size if self.train else -(-len(range(self.serving.rank, n, ranks)) // size)

    def __iter__(self):
        return self.epoch(0)

    def epoch(self, epoch: int, start: int = 0):
        s, size = self.serving, self.serving.batch_size
        if not self.train:  # in order, each rank its shard
            shard = torch.arange(s.rank, self.num_examples, s.world_size, device=self.device)
            for rows in shard.split(size)[start:]:
                yield self.prepared(self.inputs[rows]), self.targets[rows]
            return
        pad, flip = (self.image.pad, self.image.flip) if self.image else (0, False)
        order, offsets, flips = epoch_plan(self.num_examples, s.seed, epoch, pad=pad, flip=flip,
                                           shard=(s.rank, s.world_size), class_ids=self.class_ids)
        order, offsets, flips = order.to(self.device), offsets.to(self.device), flips.to(self.device)
        for i in range(start, len(self)):
            window = slice(i * size, (i + 1) * size)
            rows = order[window]
            inputs, targets = self.inputs[rows], self.targets[rows]
            if pad or flip:
                inputs = augment(inputs, offsets[window], flips[window], pad)
            if self.dense and (pad or flip):  # each pixel's target moves with it; the padding counts for none
                targets = augment(targets, offsets[window], flips[window], pad, fill=contract.IGNORE_INDEX)
            yield self.prepared(inputs), targets

    def prepared(self, inputs: torch.Tensor) -> torch.Tensor:
        """A batch as the model takes it: images float32 (resized to the model's size), normalized."""
        if self.image is None:
            return inputs.float() if inputs.is_floating_point() else inputs
        inputs = inputs.to(dtype=torch.float32, memory_format=self.memory)
        if self.image.resize:
            inputs = F.interpolate(inputs, (self.image.resize,) * 2, mode="bilinear")
            inputs = inputs.contiguous(memory_format=self.memory)
        return inputs.mul_(self.scale).sub_(self.shift)

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n examples as the model gets them, unaugmented: the start-up check's batch."""
        return self.prepared(self.inputs[:n]), self.targets[:n]

    @property
    def to_pixels(self):  # a batch as the model gets it, back to images in [0, 1] to look at; None: no images
        return self.denormalize if self.image else None

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        return ((inputs.float() + self.shift) / self.scale / 255).clamp_(0, 1)

    def image_steps(self) -> dict:
        """{None: (steps, scale, shift)} where the input is an image: what --export puts inside."""
        return {None: (self.image, self.scale, self.shift)} if self.image else {}

    def raw(self, n: int) -> torch.Tensor:
        """The first n examples' inputs as held, before any step, on the CPU (what --export takes)."""
        return self.inputs[:n].cpu()

    def close(self) -> None:  # no workers to stop
        return


@dataclass
class Splits:
    """Each split's batches (test: None where there is none); closing them stops any workers."""

    train: DeviceBatches
    val: DeviceBatches
    test: DeviceBatches | None = None

    def __enter__(self) -> Splits:
        return self

    def __exit__(self, *_) -> None:
        for batches in (self.train, self.val, self.test):
            if batches is not None:
                batches.close()


def plain(cfg: Config, source, device: torch.device, follow) -> bool:
    """Whether DeviceBatches serves this data: one input and one target tensor a split, kept on the device."""
    pairs = [pair for pair in (source.train, source.val, source.test) if pair is not None]
    return follow is None and all(isinstance(pair, tuple) and len(pair) == 2 and all(
        isinstance(t, torch.Tensor) for t in pair) for pair in pairs) and on_device(cfg.loader, pairs, device)


def build_plain(cfg: Config, source, device: torch.device, *, targets: str, needs,
                shard: tuple[int, int] = (0, 1), moves: bool | None = None) -> tuple[Splits, DataInfo]:
    """This process's (`shard`) train, val and test batches of `source`, their targets checked as the task
    takes them (`targets`: task.TARGETS), images fitted to what the model `needs`."""
    splits = contract.checked_sizes(cfg, source, shard[1])
    example = splits["train"][0][0]
    image = example.dtype == torch.uint8 and example.ndim == 3
    size = example.shape[-2:] if image else None  # per-pixel targets have the images' (H, W)
    spec, said = contract.check_splits(splits, list(source.names), targets, size, None, moves)
    notes = list(source.notes)
    steps = image_steps(cfg, source, splits["train"][0], needs, notes) if image else None
    note = contract.image_steps_note(steps, spec, cfg) if image else contract.plain_inputs(cfg, source, needs,
                                                                                           example)
    notes += [note, said]
    contract.check_balance(cfg, spec)
    serving = Serving(cfg.batch_size // shard[1], device, cfg.seed, *shard)
    served = {split: DeviceBatches(inputs.to(device), labels.to(device), serving, train=split == "train",
                                   image=steps, class_ids=spec.class_ids if cfg.balance_classes else None,
                                   dense=spec.dense) for split, (inputs, labels) in splits.items()}
    notes += contract.epoch_checks(cfg, served["train"], shard[1])
    reading = steps and {"size": example.shape[-1], "resize": steps.resize, "channels": example.shape[0],
                         "mean": steps.mean.tolist(), "std": steps.std.tolist()}
    shape = (example.shape[0], steps.resize, steps.resize) if steps and steps.resize else tuple(example.shape)
    info = DataInfo(input_shape=shape, input_dtype=torch.float32 if image or example.is_floating_point() else
                    example.dtype, names=list(source.names), images=image, notes=notes, reading=reading,
                    class_counts=None if spec.class_counts is None else spec.class_counts.to(device),
                    loader=f"device-resident tensors on {device.type}", batches=len(served["train"]),
                    **{f"{split}_size": batches.num_examples for split, batches in served.items()})
    return Splits(served["train"], served["val"], served.get("test")), info


DEVICE_MEMORY_SHARE = 0.25  # of a GPU's free memory: the rest is the model's and its activations'


def on_device(loader: str, pairs: list, device: torch.device) -> bool:
    """Whether the tensors stay on the training device: always on a CPU (or MPS); on a GPU where they fit
    DEVICE_MEMORY_SHARE of its free memory (else served.py gathers batches in host memory)."""
    if loader not in ("auto", "device", "host") or (loader == "host" and device.type == "cuda"):
        return False
    if device.type != "cuda" or loader == "device":
        return True
    needed = sum(t.nbytes for pair in pairs for t in pair)
    return needed <= DEVICE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]


def image_steps(cfg: Config, source, images: torch.Tensor, needs, notes: list[str], key=None) -> ImageSteps:
    """The steps of the training split's uint8 [N, C, H, W] `images` (`key`: which of several inputs):
    normalized by the Source's stats or their own, fitted to what the model `needs`, said in `notes`."""
    channels, stats = images.shape[1], source.stats
    if stats is None:  # the training images' own statistics
        x = images.float().div_(255).transpose(0, 1).reshape(channels, -1)
        stats = x.mean(1), x.std(1).clamp_min(1e-3)
    elif len(stats[0]) != channels:
        which = "inputs" if key is None else f"inputs[{key!r}]"
        raise UserError(f"{cfg.dataset}'s Source gives stats for {len(stats[0])} channels, and {which} has "
                        f"{channels}: give one mean and std per channel, or stats=None")
    resize, (mean, std) = 0, stats
    if needs.size or needs.mean:  # a torchvision model's input size, --pretrained weights' normalization
        resize, mean, std = fit_images(cfg, needs, (channels, images.shape[-1]), stats, notes)
    return ImageSteps(torch.as_tensor(mean), torch.as_tensor(std), source.pad if cfg.augment else 0,
                      source.flip and cfg.flip and cfg.augment, cfg.channels_last, resize)


def fit_images(cfg: Config, needs, shape: tuple[int, int], stats: tuple, notes: list[str]
               ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The side images of shape (channels, size) are resized to for a torchvision cfg.model (0: none), and
    the mean and std they are normalized with (`stats`, or --pretrained weights'), said in `notes`."""
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
