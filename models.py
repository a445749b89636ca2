"""Models and optimizers by name, and the precision they train in.

`resnet_small` is the default: a few residual blocks that train in seconds on 8-64 px images.
`resnet9` is the well-known fast CIFAR-10 network. Your own go into MODELS, one line each. Any
other name goes to torchvision's model registry, with its ImageNet weights under --pretrained.
A new run can also start from a checkpoint's weights (--init-from). OPTIMIZERS is the one list of
optimizers, each with its kind, which lr_find's rules read.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

import distributed
from checkpoints import downloading, load_checkpoint
from configs import Config, UserError


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels), conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def head_dropout(p: float) -> list[nn.Module]:
    """Dropout before the classifier, only when asked for: the layers' names (a checkpoint's keys) stay
    those of the model without it."""
    return [nn.Dropout(p)] if p > 0 else []


class ResNetSmall(nn.Sequential):
    """Three stages (width, 2x, 4x), halving resolution between them; fine from 8 px up."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        stages = [conv_bn(channels, width), Residual(width),
                  conv_bn(width, 2 * width, stride=2), Residual(2 * width),
                  conv_bn(2 * width, 4 * width, stride=2), Residual(4 * width)]
        head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), *head_dropout(dropout),
                nn.Linear(4 * width, num_outputs)]
        super().__init__(*stages, *head)


class ResNet9(nn.Sequential):
    """The DAWNBench-style ResNet-9 for 32 px images: four stages, two residual, max-pooling."""

    def __init__(self, channels: int, num_outputs: int, width: int = 64, dropout: float = 0.0):
        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(conv_bn(cin, cout), nn.MaxPool2d(2))

        stages = [conv_bn(channels, width), stage(width, 2 * width), Residual(2 * width),
                  stage(2 * width, 4 * width), stage(4 * width, 8 * width), Residual(8 * width)]
        head = [nn.AdaptiveMaxPool2d(1), nn.Flatten(), *head_dropout(dropout),
                nn.Linear(8 * width, num_outputs, bias=False)]
        super().__init__(*stages, *head)


# Our own models by name; `--model NAME` builds MODELS[NAME](channels, num_outputs, width, dropout),
# where channels is the size of the inputs' first dimension ([C, H, W] images, [C, L] signals).
# To add one, write its class above and add its line here.
MODELS = {
    "resnet_small": ResNetSmall,
    "resnet9": ResNet9,
}


@dataclass
class InputNeeds:
    """What a model asks of its inputs; data.py resizes and normalizes batches to match."""

    size: int = 0  # 0: any size
    exact: bool = False  # ViTs take exactly `size`; other models at least `size`
    crop: int = 0  # --pretrained: the size the weights were trained at (ImageFolder default)
    mean: tuple[float, ...] | None = None  # --pretrained: the normalization the weights expect
    std: tuple[float, ...] | None = None
    weights: str = ""  # --pretrained: torchvision's name for them


@functools.lru_cache
def input_needs(model: str, pretrained: bool) -> InputNeeds:
    """The input size a torchvision model needs (its weights' min_size, or a ViT's image_size)
    and, with --pretrained, the size and mean/std its weights' transforms() use."""
    if model in MODELS:
        if pretrained:
            raise UserError(f"--pretrained applies to torchvision models; {model} has no pretrained "
                            "weights (start from a checkpoint of yours with --init-from PATH)")
        return InputNeeds()
    import torchvision

    if model not in (known := torchvision.models.list_models(module=torchvision.models)):
        close = difflib.get_close_matches(model, [*MODELS, *known], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown model {model!r}{hint} ({', '.join(MODELS)}, or a torchvision "
                        "classification model such as resnet18)")
    weights = torchvision.models.get_model_weights(model).DEFAULT
    with torch.device("meta"):  # the architecture alone: no memory, no initialization
        fixed = getattr(torchvision.models.get_model(model, weights=None), "image_size", 0)
    size = weights.meta["min_size"][0]
    if not pretrained:
        return InputNeeds(fixed or size, exact=bool(fixed))
    transforms = weights.transforms()
    return InputNeeds(size, bool(fixed), crop=transforms.crop_size[0], mean=tuple(transforms.mean),
                      std=tuple(transforms.std), weights=f"{type(weights).__name__}.{weights.name}")


def fit_images(cfg: Config, channels: int, size: int, mean: torch.Tensor, std: torch.Tensor,
               notes: list[str]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The side images of `size` px are resized to for cfg.model (0: none), and the mean and std they
    are normalized with (--pretrained: its weights'); what changed goes into `notes`."""
    needs, resize = input_needs(cfg.model, cfg.pretrained), 0
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


def build_model(cfg: Config, channels: int, num_outputs: int,
                device: torch.device | str = "cpu") -> nn.Module:
    """The model named by cfg.model, on `device`, in channels_last memory if cfg asks for it. A new run
    starts from --pretrained or --init-from weights; a resumed, evaluated or predicting one gets every
    weight from its own checkpoint, so they are not loaded then."""
    starting = not (cfg.resume or cfg.evaluate or cfg.predict)
    model = _architecture(cfg, channels, num_outputs, pretrained=cfg.pretrained and starting)
    if cfg.init_from and starting:
        if not Path(cfg.init_from).is_file():
            raise UserError(f"--init-from {cfg.init_from}: no such file (a best.pt, last.pt or state_dict)")
        state = load_checkpoint(cfg.init_from)
        saved = state.get("config")  # ours says what it was trained as
        hint = f"it holds {saved.get('model')} width {saved.get('width')}" if isinstance(saved, dict) else ""
        head = load_weights(model, state, num_outputs, f"--init-from {cfg.init_from}", hint)
        _say(f"weights from {cfg.init_from}" + (f"; {head}" if head else ""))
    memory = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return model.to(device, memory_format=memory)


def load_trained(path: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict]:
    """The model in a train.py checkpoint, for your own code: built as it was trained, its weights
    loaded, in eval mode on `device`; and the checkpoint, whose "data" names the outputs ("names") and
    whose "inputs" says what the model takes ("shape", "dtype", and for images how they were read)."""
    ckpt = load_checkpoint(path)
    if not (isinstance(ckpt.get("config"), dict) and isinstance(ckpt.get("inputs"), dict)):
        raise UserError(f"{path} is not a checkpoint of this train.py (it records no config or inputs)")
    saved = {k: v for k, v in ckpt["config"].items() if k in Config.__dataclass_fields__}
    cfg = Config(**{**saved, "evaluate": str(path)})  # evaluate: every weight comes from the checkpoint
    names = ckpt["data"]["names"]
    model = build_model(cfg, ckpt["inputs"]["shape"][0], len(names), device)
    load_weights(model, ckpt, len(names), str(path), new_head=False)
    return model.eval(), ckpt


def weights_of(state: dict) -> dict:
    """The state_dict in a checkpoint of ours (the --ema average where it holds one, else "model"), a
    Lightning-style one ("state_dict") or a plain one, without the `module.` and `_orig_mod.` prefixes
    DDP and torch.compile add."""
    weights = state.get("ema") or state.get("model", state.get("state_dict", state))
    if not isinstance(weights, dict):
        raise UserError("the checkpoint holds no state_dict (a dict of tensors)")
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", key): value for key, value in weights.items()}


def load_weights(model: nn.Module, state: dict, num_outputs: int, source: str,
                 hint: str = "", new_head: bool = True) -> str:
    """Copy the weights in `state` (a checkpoint or a state_dict: weights_of) into `model`. A classifier
    head for another number of classes (tensors whose first dimension alone differs, num_outputs
    here) keeps its fresh initialization when `new_head`; any other difference is one UserError
    line. Returns what happened to the head."""
    own, weights = model.state_dict(), weights_of(state)
    head = [k for k in own.keys() & weights.keys() if isinstance(weights[k], torch.Tensor)
            and own[k].shape != weights[k].shape and own[k].shape[0] == num_outputs
            and own[k].shape[1:] == weights[k].shape[1:]]
    old = {weights[k].shape[0] for k in head}
    if not new_head or len(old) != 1:
        head = []
    problems = [f"missing {k}" for k in own.keys() - weights.keys()]
    problems += [f"unexpected {k}" for k in weights.keys() - own.keys()]
    problems += [f"{k} {_shape(weights[k])} there, {_shape(own[k])} here"
                 for k in own.keys() & weights.keys() if k not in head
                 and (not isinstance(weights[k], torch.Tensor) or weights[k].shape != own[k].shape)]
    if problems:
        more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
        raise UserError(f"{source} does not fit the model built here ({'; '.join(sorted(problems)[:4])}"
                        f"{more}){'; ' + hint if hint else ''}; build the model it was saved from "
                        "(--model, --width, --channels)")
    model.load_state_dict({k: own[k] if k in head else weights[k] for k in own})  # the head keeps its own
    if not head:
        return ""
    layers = sorted({k.rsplit(".", 1)[0] for k in head})
    return f"classifier head {', '.join(layers)} re-initialised for {num_outputs} classes (was {old.pop()})"


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _say(text: str) -> None:
    """Said once at start-up, by one process under torchrun."""
    if distributed.rank() == 0:
        print(text)


def _architecture(cfg: Config, channels: int, num_outputs: int, pretrained: bool) -> nn.Module:
    needs = input_needs(cfg.model, cfg.pretrained)
    if cfg.model in MODELS:
        return MODELS[cfg.model](channels, num_outputs, cfg.width, cfg.dropout)
    if cfg.dropout:  # torchvision builders differ: some take `dropout`, some silently ignore it
        raise UserError(f"--dropout applies to {', '.join(MODELS)}; {cfg.model} keeps "
                        "torchvision's own dropout (set it in models.py)")
    import torchvision

    options = {"image_size": needs.size} if needs.exact else {}  # a ViT is built for one size
    model = torchvision.models.get_model(cfg.model, weights=None, num_classes=num_outputs, **options)
    if pretrained:
        head = load_weights(model, _pretrained_weights(cfg.model), num_outputs,
                            f"--pretrained {needs.weights}")
        _say(f"pretrained weights: torchvision's {needs.weights}" + (f"; {head}" if head else ""))
    if channels != 3:  # torchvision models expect RGB: a learned 1x1 conv maps channels to 3
        return nn.Sequential(nn.Conv2d(channels, 3, 1), model)
    return model


def _pretrained_weights(name: str) -> dict:
    """torchvision's default weights for `name`, from $TORCH_HOME/hub/checkpoints as torchvision
    keeps them (downloaded there first if missing), loaded with weights_only=True."""
    import torchvision

    weights = torchvision.models.get_model_weights(name).DEFAULT
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    file = folder / weights.url.split("/")[-1]  # torchvision's URLs end in the file's name
    if not file.is_file():
        failed = (f"--pretrained needs {file.name} and could not download it ({{reason}}); without network, "
                  f"copy it from {weights.url} into {folder} ($TORCH_HOME/hub/checkpoints)")
        with downloading(folder, failed):
            folder.mkdir(parents=True, exist_ok=True)
            digest = torch.hub.HASH_REGEX.search(file.name)  # torchvision checks it too
            torch.hub.download_url_to_file(weights.url, str(file), digest and digest.group(1), progress=False)
    return weights_of(load_checkpoint(file))


@dataclass(frozen=True)
class OptimizerEntry:
    """How to build one optimizer from the config, and its kind: "sgd" or "adaptive" (Adam-like),
    which picks lr_find's suggestion rules. `settings`: the config fields it reads besides lr and
    weight_decay (--lr auto compares them only between sweeps of optimizers that read them)."""

    build: Callable[[list[dict], float, Config, dict], torch.optim.Optimizer]
    kind: str
    settings: tuple[str, ...] = ()


def _sgd(groups: list[dict], lr: float, cfg: Config, options: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                           **options)


def _adamw(groups: list[dict], lr: float, cfg: Config, options: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, **options)


# The one list of optimizers: --optimizer, --help, lr_find's rules and the tests read it.
OPTIMIZERS = {
    "sgd": OptimizerEntry(_sgd, "sgd", ("momentum", "nesterov")),
    "adamw": OptimizerEntry(_adamw, "adaptive"),
}


def build_optimizer(model: nn.Module, cfg: Config, lr: float,
                    fused: bool | None = None) -> torch.optim.Optimizer:
    """OPTIMIZERS[cfg.optimizer], with no weight decay on biases and norm layers' weights: two param groups,
    decayed (matrices, conv kernels) and not (anything 1-D). `fused` None decides by `fused_by_default`;
    True or False forces it (fused kernels exist on CPU too)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if fused is None:
        fused = bool(params) and fused_by_default(cfg, params[0].device)
    options = {"fused": True} if fused else {}  # else torch's default (foreach where it helps)
    return OPTIMIZERS[cfg.optimizer].build(groups, lr, cfg, options)


def fused_by_default(cfg: Config, device: torch.device) -> bool:
    """Fused kernels on CUDA, except SGD with momentum where an fp16 GradScaler may skip steps. A
    GradScaler skips a step whose gradients overflow, routinely the first ones at its initial scale. Fused
    SGD creates its momentum buffers with empty_like for its first step's kernel to fill, and the kernel
    returns early on that skip, so the next step reads uninitialised memory (garbage weights); fused AdamW
    zero-initialises its state and undoes its step count."""
    if device.type != "cuda":
        return False
    sgd_momentum = cfg.optimizer == "sgd" and cfg.momentum > 0
    return not (sgd_momentum and amp_dtype(device, cfg.amp) == torch.float16)


# ---------------------------------------------------------------- --ema


class Ema:
    """--ema: an exponential moving average of a model's weights and BatchNorm statistics, kept on the device
    in a copy of the model (`average`, in eval mode, never trained), which evaluation, best.pt, --evaluate
    and --predict use. torch's AveragedModel reads its step count from the device twice a step; this keeps
    the count on the host and moves the average with torch's own get_ema_multi_avg_fn (one lerp for all)."""

    def __init__(self, model: nn.Module, decay: float):
        """The average of `model`, starting as a copy of it (its integer buffers, such as BatchNorm's
        batch count, stay the copy's: only floats are averaged)."""
        self.average, self.decay = copy.deepcopy(model).eval().requires_grad_(False), decay
        tensors = zip(self.average.state_dict().values(), model.state_dict().values(), strict=True)
        floats = [(a, m) for a, m in tensors if a.is_floating_point()]
        self.pairs = [a for a, _ in floats], [m for _, m in floats]  # the average's tensors, the model's

    def update(self, updates: int) -> None:
        """After an optimizer step that happened, the `updates`-th: the average moves toward the model,
        with the decay warmed up as timm's, min(decay, (1 + n) / (10 + n)), so early weights fade fast."""
        get_ema_multi_avg_fn(min(self.decay, (1 + updates) / (10 + updates)))(*self.pairs, None)


# ---------------------------------------------------------------- AMP


def amp_setup(device: torch.device, mode: str) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """Autocast dtype and GradScaler: bf16 where the device has it, else fp16 with a scaler."""
    dtype = amp_dtype(device, mode)
    return dtype, torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def amp_dtype(device: torch.device, mode: str) -> torch.dtype | None:
    """The autocast dtype `mode` means on `device`; None is off. "auto" is off on CPU and MPS, where
    autocast rarely pays; bf16 or fp16 can still be forced. On CUDA it is bf16 only where the GPU computes
    in it natively (Ampere and later): V100 and T4 emulate bf16 slowly, which torch counts as supported
    unless including_emulation=False."""
    if mode == "auto":
        if device.type != "cuda":
            return None
        mode = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def autocast(device: torch.device, dtype: torch.dtype | None, cache: bool = True):
    """torch.autocast, or nothing with AMP off: a disabled autocast still costs host time every step.
    cache False: CUDA graph capture, whose replays cannot reuse autocast's cached weight casts."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def check_graphs(cfg: Config, device: torch.device, amp_dtype: torch.dtype | None, world_size: int) -> None:
    """--cuda-graphs where it cannot run is one line, said before any work (a sweep for --lr find)."""
    for applies, why in (  # the first that applies is said
            (cfg.compile, "--compile captures graphs of its own (mode='reduce-overhead'); pass one of "
                          "the two"),
            (amp_dtype == torch.float16, "fp16's GradScaler is not supported with graphs yet; use --amp "
                                         "bf16 or --amp off"),
            (world_size > 1, "DDP's gradient all-reduce is not captured; train on one GPU"),
            (device.type != "cuda", f"they need a CUDA device, and this run is on {device.type}")):
        if cfg.cuda_graphs and applies:
            raise UserError(f"--cuda-graphs: {why}")


def runnable(model: nn.Module, cfg: Config, device: torch.device, amp_dtype: torch.dtype | None,
             world_size: int, batches) -> nn.Module:
    """What train.py's loop calls: the model, torch.compile'd under --compile, or under --cuda-graphs with
    its training forward and backward captured once as CUDA graphs for the batches' static shape (the
    optimizer and schedule stay eager; in eval mode it runs eagerly, so evaluation does)."""
    if not cfg.cuda_graphs:
        return torch.compile(model) if cfg.compile else model
    check_graphs(cfg, device, amp_dtype, world_size)
    sample = next(iter(batches))[0].clone()  # the training batches' shape, dtype and memory format
    buffers = [b.clone() for b in model.buffers()]  # capture's warm-up passes move BatchNorm's statistics
    with autocast(device, amp_dtype, cache=False):
        graphed = torch.cuda.make_graphed_callables(model, (sample,), allow_unused_input=True)
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    return graphed
