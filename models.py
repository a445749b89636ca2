"""Models by name and the one optimizer builder both scripts use.

`resnet_small` is the default: a few residual blocks that train in seconds on 8-64 px images.
`resnet9` is the well-known fast CIFAR-10 network. Any other name goes to torchvision's model
registry, without pretrained weights (nothing is downloaded).
"""

from __future__ import annotations

import difflib

import torch
from torch import nn

import runtime
from configs import Config, UserError

OWN_MODELS = ("resnet_small", "resnet9")


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
    """Dropout before the classifier, only when asked for: without it the state_dict keys stay as
    they were, so checkpoints from before the option still load."""
    return [nn.Dropout(p)] if p > 0 else []


class ResNetSmall(nn.Sequential):
    """Three stages (width, 2x, 4x), halving resolution between them; fine from 8 px up."""

    def __init__(self, channels: int, num_classes: int, width: int = 32, dropout: float = 0.0):
        super().__init__(
            conv_bn(channels, width), Residual(width),
            conv_bn(width, 2 * width, stride=2), Residual(2 * width),
            conv_bn(2 * width, 4 * width, stride=2), Residual(4 * width),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), *head_dropout(dropout),
            nn.Linear(4 * width, num_classes),
        )


class ResNet9(nn.Sequential):
    """The DAWNBench-style ResNet-9 for 32 px images: four stages, two residual, max-pooling."""

    def __init__(self, channels: int, num_classes: int, width: int = 64, dropout: float = 0.0):
        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(conv_bn(cin, cout), nn.MaxPool2d(2))

        super().__init__(
            conv_bn(channels, width),
            stage(width, 2 * width), Residual(2 * width),
            stage(2 * width, 4 * width),
            stage(4 * width, 8 * width), Residual(8 * width),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(), *head_dropout(dropout),
            nn.Linear(8 * width, num_classes, bias=False),
        )


def torchvision_models() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_model_name(name: str) -> None:
    if name in OWN_MODELS:
        return
    known = torchvision_models()
    if name not in known:
        close = difflib.get_close_matches(name, [*OWN_MODELS, *known], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown model {name!r}{hint} (resnet_small, resnet9, or a torchvision "
                        "classification model such as resnet18)")


def build_model(cfg: Config, channels: int, num_classes: int,
                device: torch.device | str = "cpu") -> nn.Module:
    """The model named by cfg.model, on `device`, in channels_last memory if cfg asks for it."""
    memory = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return _architecture(cfg, channels, num_classes).to(device, memory_format=memory)


def _architecture(cfg: Config, channels: int, num_classes: int) -> nn.Module:
    check_model_name(cfg.model)
    if cfg.model == "resnet_small":
        return ResNetSmall(channels, num_classes, cfg.width, cfg.dropout)
    if cfg.model == "resnet9":
        return ResNet9(channels, num_classes, cfg.width, cfg.dropout)
    if cfg.dropout:  # torchvision builders differ: some take `dropout`, some silently ignore it
        raise UserError(f"--dropout applies to resnet_small and resnet9; {cfg.model} keeps "
                        "torchvision's own dropout (set it in models.py)")
    import torchvision

    model = torchvision.models.get_model(cfg.model, weights=None, num_classes=num_classes)
    if channels != 3:  # torchvision models expect RGB: a learned 1x1 conv maps channels to 3
        return nn.Sequential(nn.Conv2d(channels, 3, 1), model)
    return model


def build_optimizer(model: nn.Module, cfg: Config, lr: float,
                    fused: bool | None = None) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov) or AdamW; no weight decay on biases and norm layers' weights.

    Two param groups: decayed (matrices, conv kernels) and not (anything 1-D). `fused` None
    decides by `fused_by_default`; True or False forces it (fused kernels exist on CPU too).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if fused is None:
        fused = bool(params) and fused_by_default(cfg, params[0].device)
    options = {"fused": True} if fused else {}  # else torch's default (foreach where it helps)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **options)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov and cfg.momentum > 0, **options)


def fused_by_default(cfg: Config, device: torch.device) -> bool:
    """Fused kernels on CUDA, except SGD with momentum where an fp16 GradScaler may skip steps.

    A GradScaler skips a step whose gradients overflow, routinely the first ones at its initial
    scale. Fused SGD creates its momentum buffers with empty_like for its first step's kernel to
    fill, and the kernel returns early on that skip, so the next step reads uninitialised memory
    (garbage weights); fused AdamW zero-initialises its state and undoes its step count.
    """
    if device.type != "cuda":
        return False
    sgd_momentum = cfg.optimizer == "sgd" and cfg.momentum > 0
    return not (sgd_momentum and runtime.amp_dtype(device, cfg.amp) == torch.float16)
