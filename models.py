"""Models and optimizers by name: what a fork edits (AMP, --compile and --ema are machinery/precision.py's).

`resnet_small` is the default: a few residual blocks that train in seconds on 8-64 px images.
`resnet9` is the well-known fast CIFAR-10 network. Your own go into MODELS, one line each. Any
other name goes to torchvision's model registry, with its ImageNet weights under --pretrained.
A new run can also start from a checkpoint's weights (--init-from). OPTIMIZERS is the one list of
optimizers, each with its kind, which lr_find's rules read.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from configs import Config, UserError
from machinery import weights
from machinery.precision import amp_dtype


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


class GlobalMax(nn.Module):
    """Each channel's largest value, [N, C, 1, 1]: AdaptiveMaxPool2d(1)'s, whose backward has no
    deterministic CUDA kernel (--deterministic); AdaptiveAvgPool2d(1) already runs as a mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.amax((2, 3), keepdim=True)


class ResNet9(nn.Sequential):
    """The DAWNBench-style ResNet-9 for 32 px images: four stages, two residual, max-pooling."""

    def __init__(self, channels: int, num_outputs: int, width: int = 64, dropout: float = 0.0):
        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(conv_bn(cin, cout), nn.MaxPool2d(2))

        stages = [conv_bn(channels, width), stage(width, 2 * width), Residual(2 * width),
                  stage(2 * width, 4 * width), stage(4 * width, 8 * width), Residual(8 * width)]
        head = [GlobalMax(), nn.Flatten(), *head_dropout(dropout),
                nn.Linear(8 * width, num_outputs, bias=False)]
        super().__init__(*stages, *head)


# Our own models by name; `--model NAME` builds MODELS[NAME](channels, num_outputs, width, dropout),
# where channels is the size of the inputs' first dimension ([C, H, W] images, [C, L] signals; of several
# inputs, a tuple or dict the model unpacks, the first one's). To add one, write its class above and its
# line here.
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


def build_model(cfg: Config, channels: int, num_outputs: int, device: torch.device | str = "cpu", *,
                fresh: bool = True, notes: list[str] | None = None) -> nn.Module:
    """The model named by cfg.model, on `device`, in channels_last memory if cfg asks for it. A `fresh` run
    starts from --pretrained or --init-from weights (said in `notes`); a resumed or evaluated one gets every
    weight from its own checkpoint, so they are not loaded then."""
    model, said = _architecture(cfg, channels, num_outputs), []
    if fresh and cfg.pretrained:  # torchvision's weights, into its model inside any channel adapter
        said.append(weights.pretrained(model[-1] if channels != 3 else model, cfg.model, num_outputs))
    if fresh and cfg.init_from:
        said.append(weights.init_from(model, cfg.init_from, num_outputs))
    if notes is not None:
        notes += said
    memory = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return model.to(device, memory_format=memory)


def _architecture(cfg: Config, channels: int, num_outputs: int) -> nn.Module:
    needs = input_needs(cfg.model, cfg.pretrained)
    if cfg.model in MODELS:
        return MODELS[cfg.model](channels, num_outputs, cfg.width, cfg.dropout)
    if cfg.dropout:  # torchvision builders differ: some take `dropout`, some silently ignore it
        raise UserError(f"--dropout applies to {', '.join(MODELS)}; {cfg.model} keeps "
                        "torchvision's own dropout (set it in models.py)")
    import torchvision

    options = {"image_size": needs.size} if needs.exact else {}  # a ViT is built for one size
    model = torchvision.models.get_model(cfg.model, weights=None, num_classes=num_outputs, **options)
    if channels != 3:  # torchvision models expect RGB: a learned 1x1 conv maps channels to 3
        return nn.Sequential(nn.Conv2d(channels, 3, 1), model)
    return model


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
