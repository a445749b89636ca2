"""Any torchvision classification model by name (`--model resnet18`): the input size it needs and, with
--pretrained, the size and normalization its weights were trained with; its architecture, with a learned
1x1 convolution in front where the inputs are not RGB. models.py comes here for names not in MODELS."""

from __future__ import annotations

import difflib
import functools

import torch
from torch import nn

from configs import UserError
from machinery.batches import InputNeeds


@functools.lru_cache
def input_needs(model: str, pretrained: bool, ours: tuple[str, ...]) -> InputNeeds:
    """The input size torchvision's `model` needs (its weights' min_size, or a ViT's image_size) and, with
    `pretrained`, the size and mean/std its weights' transforms() use; `ours`: models.MODELS' names."""
    import torchvision

    if model not in (known := torchvision.models.list_models(module=torchvision.models)):
        close = difflib.get_close_matches(model, [*ours, *known], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown model {model!r}{hint} ({', '.join(ours)}, or a torchvision "
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


def architecture(cfg, channels: int, num_outputs: int, needs: InputNeeds, ours: tuple[str, ...]) -> nn.Module:
    """torchvision's cfg.model for `num_outputs` classes (a ViT built for its one size), its own dropout."""
    if cfg.dropout:  # torchvision builders differ: some take `dropout`, some silently ignore it
        raise UserError(f"--dropout applies to {', '.join(ours)}; {cfg.model} keeps torchvision's own "
                        "dropout (set it in models.py)")
    import torchvision

    options = {"image_size": needs.size} if needs.exact else {}
    model = torchvision.models.get_model(cfg.model, weights=None, num_classes=num_outputs, **options)
    if channels != 3:  # torchvision models expect RGB: a learned 1x1 conv maps channels to 3
        return nn.Sequential(nn.Conv2d(channels, 3, 1), model)
    return model
