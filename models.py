"""Models and optimizers by name: what a fork edits. `resnet_small` (the default) trains in seconds on 8-64 px
images, `resnet9` is the fast CIFAR-10 network; yours go into MODELS, one line each. Any other name is a
torchvision model (--pretrained: its ImageNet weights). OPTIMIZERS is the one list of optimizers, each with
its kind, which lr_find's rules read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from configs import Config, UserError
from machinery.batches import InputNeeds
from machinery.processes import amp_dtype


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
    """Dropout before the classifier, only where asked for: a checkpoint's keys stay those without it."""
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


def input_needs(model: str, pretrained: bool) -> InputNeeds:
    """What the model takes: ours any size; a torchvision model its size (machinery/torchvision_models.py)."""
    if model not in MODELS:
        from machinery.torchvision_models import input_needs as torchvision_needs

        return torchvision_needs(model, pretrained, tuple(MODELS))
    if pretrained:
        raise UserError(f"--pretrained applies to torchvision models; {model} has no pretrained weights "
                        "(start from a checkpoint of yours with --init-from PATH)")
    return InputNeeds()


def build_model(cfg: Config, channels: int, num_outputs: int, device: torch.device | str = "cpu", *,
                fresh: bool = True, notes: list[str] | None = None) -> nn.Module:
    """cfg.model on `device`; a `fresh` one (not resumed) from --pretrained or --init-from weights."""
    if cfg.model in MODELS:
        model = MODELS[cfg.model](channels, num_outputs, cfg.width, cfg.dropout)
    else:
        from machinery.torchvision_models import architecture

        needs = input_needs(cfg.model, cfg.pretrained)
        model = architecture(cfg, channels, num_outputs, needs, tuple(MODELS))
    if fresh and (cfg.pretrained or cfg.init_from):  # a new run from weights of elsewhere
        from machinery.weights import starting_weights

        said = starting_weights(model, cfg, channels, num_outputs)
        if notes is not None:
            notes += said
    memory = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return model.to(device, memory_format=memory)


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
    """OPTIMIZERS[cfg.optimizer] with two param groups, decayed (matrices, kernels) and not (anything 1-D:
    biases, norm weights); `fused`: None decides by fused_by_default, True or False forces it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if fused is None:
        fused = bool(params) and params[0].device.type == "cuda" and fused_by_default(cfg, params[0].device)
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
