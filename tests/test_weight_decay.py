"""build_optimizer's promise: no weight decay on biases and normalization weights (every 1-D
parameter), --weight-decay on every other, each parameter in exactly one group."""

import pytest
import torch

from configs import parse_config
from models import build_model, build_optimizer


@pytest.mark.parametrize("model", ["resnet_small", "mobilenet_v3_small"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_decay_on_weights_only(model, optimizer):
    cfg = parse_config(["--model", model, "--optimizer", optimizer, "--weight-decay", "0.03", "--width", "8"])
    net = build_model(cfg, 3, 10)
    opt = build_optimizer(net, cfg, 0.1)
    decay_of = {id(p): group["weight_decay"] for group in opt.param_groups for p in group["params"]}
    grouped = sum(len(group["params"]) for group in opt.param_groups)
    params = dict(net.named_parameters())
    assert grouped == len(decay_of) == len(params), "each parameter in exactly one group"
    flat = [name for name, p in params.items() if p.ndim <= 1]
    assert flat and len(flat) < len(params)
    for name, p in params.items():
        assert decay_of[id(p)] == (0.0 if p.ndim <= 1 else 0.03), name
    if model == "mobilenet_v3_small":  # torchvision's BatchNorm weights and biases are among them
        assert {"features.0.1.weight", "features.0.1.bias", "classifier.3.bias"} <= set(flat)


def test_a_step_with_zero_gradients_shrinks_only_the_weights():
    """The groups act: SGD's decay moves a parameter with no gradient only where decay is on."""
    cfg = parse_config(["--weight-decay", "0.1", "--momentum", "0", "--width", "4"])
    net = build_model(cfg, 1, 10)
    opt = build_optimizer(net, cfg, 0.5)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in net.named_parameters():
        expected = before[name] if p.ndim <= 1 else before[name] * (1 - 0.5 * 0.1)
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-7), name
