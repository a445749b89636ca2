"""CUDA paths: bf16/fp16 autocast, fused optimizers, device-resident data. Skipped without a GPU."""

import json

import pytest
import torch

import train
from configs import parse_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("amp", ["auto", "fp16"])
def test_train_on_cuda(tmp_path, amp):
    summary = train.train(parse_config([
        "--device", "cuda", "--amp", amp, "--dataset", "synthetic", "--synthetic-size", "1024",
        "--image-size", "16", "--epochs", "2", "--batch-size", "128", "--channels-last",
        "--out-dir", str(tmp_path)]))
    assert summary["device"].startswith("cuda") and summary["val_acc"] > 0.5
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 16


def test_lr_find_restores_on_cuda(tmp_path):
    from lr_find import lr_find
    from models import ResNetSmall

    model = ResNetSmall(3, 10, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [(torch.randn(16, 3, 8, 8, device="cuda"), torch.randint(0, 10, (16,), device="cuda"))]
    torch.cuda.reset_peak_memory_stats()
    lr_find(model, opt, torch.nn.functional.cross_entropy, data, num_iter=20, end_lr=100.0,
            autocast_dtype=torch.bfloat16)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
