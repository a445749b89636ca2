"""Gradient accumulation: k micro-batches of b make the step that one batch of k*b makes, and N
processes the step of one with N times their batch.

Checked for train.py (a final, partial window included) and for lr_find, with a plain mean and with a
class-weighted one (tests/forks/weighted.py), whose normalizer is the batch's weights: each step divides
its summed losses once by the normalizers of all its micro-batches and processes. The models here have
no BatchNorm: its batch statistics differ between a micro-batch and the whole batch by design.
"""

import copy
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import LAUNCH, ROOT, add_entries, build_loaders
from forks import weighted
from torch import nn

import train
from configs import parse_config
from lr_find import lr_find
from machinery import checkpoints
from models import build_optimizer

CPU = torch.device("cpu")
RUN = ["--dataset", "synthetic", "--image-size", "8", "--num-classes", "4", "--device", "cpu",
       "--epochs", "2", "--schedule", "onecycle", "--pct-start", "0.3", "--lr", "0.1", "--log-every", "1"]


def bn_free_net(channels: int, num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


@pytest.fixture
def trained(monkeypatch):
    """train.train on a BN-free model; records the model's initial weights and the optimizer steps."""
    seen = {"initial": None, "optimizer_steps": 0}

    def build_model(cfg, channels, num_classes, device="cpu", **options):
        model = bn_free_net(channels, num_classes)
        seen["initial"] = copy.deepcopy(model.state_dict())
        return model

    def counting_optimizer(model, cfg, lr):
        optimizer = build_optimizer(model, cfg, lr)
        optimizer.register_step_post_hook(lambda *_: seen.update(optimizer_steps=seen["optimizer_steps"] + 1))
        return optimizer

    monkeypatch.setattr(train, "build_model", build_model)
    monkeypatch.setattr(train, "build_optimizer", counting_optimizer)

    def run(out_dir, *argv, task=None):
        cfg = parse_config([*RUN, "--out-dir", str(out_dir), *argv])
        seen.update(initial=None, optimizer_steps=0)
        summary = train.train(cfg, None, *([task] if task else []))
        return cfg, summary, checkpoints.load_checkpoint(out_dir / "last.pt"), dict(seen)

    return run


def assert_same_weights(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_train_windows_of_micro_batches_equal_one_batch_each(tmp_path, trained):
    """7 batches with accum 3: windows of 3, 3 and 1; each must step like one concatenated batch."""
    cfg, summary, ckpt, seen = trained(tmp_path, "--synthetic-size", "56", "--batch-size", "8",
                                       "--accum-steps", "3")
    batches, _, _, info = build_loaders(cfg, CPU)
    assert len(batches) == 7
    model = bn_free_net(info.input_shape[0], len(info.names))
    model.load_state_dict(seen["initial"])
    optimizer = build_optimizer(model, cfg, float(cfg.lr))
    scheduler, _ = train.make_scheduler(cfg, optimizer, len(batches))
    windows = []
    for epoch in range(cfg.epochs):
        micro = list(batches.epoch(epoch))
        for start in range(0, len(micro), cfg.accum_steps):
            window = micro[start:start + cfg.accum_steps]
            windows.append(len(window))
            inputs, targets = (torch.cat(parts) for parts in zip(*window, strict=True))
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    assert windows == [3, 3, 1] * 2
    assert seen["optimizer_steps"] == summary["steps"] == ckpt["scheduler"]["last_epoch"] == 6
    assert ckpt["scheduler"]["last_epoch"] == scheduler.last_epoch
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]
    assert_same_weights(ckpt["model"], model.state_dict())


def test_train_accumulating_k_batches_of_b_equals_batches_of_k_b(tmp_path, trained):
    """The same run configured two ways: --batch-size 24, or --batch-size 8 --accum-steps 3."""
    _, whole, whole_ckpt, whole_seen = trained(tmp_path / "whole", "--synthetic-size", "48",
                                               "--batch-size", "24")
    _, micro, micro_ckpt, micro_seen = trained(tmp_path / "micro", "--synthetic-size", "48",
                                               "--batch-size", "8", "--accum-steps", "3")
    assert_same_weights(micro_seen["initial"], whole_seen["initial"])
    assert micro_seen["optimizer_steps"] == whole_seen["optimizer_steps"] == 4
    assert micro["steps"] == whole["steps"] == 4
    assert micro_ckpt["scheduler"]["last_epoch"] == whole_ckpt["scheduler"]["last_epoch"] == 4
    assert_same_weights(micro_ckpt["model"], whole_ckpt["model"])


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")  # 12 steps: no bottom to read
def test_lr_find_accumulation_equals_one_batch_per_step():
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 4, (4,), generator=g))
             for _ in range(3 * 12)]
    whole = [tuple(torch.cat(parts) for parts in zip(*micro[i:i + 3], strict=True))
             for i in range(0, len(micro), 3)]
    runs = []
    for loader, accum_steps in ((micro, 3), (whole, 1)):
        torch.manual_seed(0)
        model = bn_free_net(3, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        after_each_step = []
        optimizer.register_step_post_hook(
            lambda *_, model=model, out=after_each_step: out.append(copy.deepcopy(model.state_dict())))
        result = lr_find(model, optimizer, F.cross_entropy, loader, start_lr=1e-3, end_lr=0.3,
                         num_iter=12, accum_steps=accum_steps)
        runs.append((result, after_each_step))
    (accumulated, accumulated_weights), (single, single_weights) = runs
    assert len(accumulated.lrs) == len(single.lrs) == 12, (accumulated.stop_reason, single.stop_reason)
    assert len(accumulated_weights) == len(single_weights) == 12
    assert accumulated.lrs == single.lrs
    assert accumulated.losses == pytest.approx(single.losses, rel=1e-5)
    for step, (a, b) in enumerate(zip(accumulated_weights, single_weights, strict=True)):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"{name} after {step}")


def test_a_class_weighted_loss_accumulates_as_one_batch(tmp_path, trained, monkeypatch):
    """Weights 0.5 to 3 on imbalanced classes: a mean over each micro-batch's own weights would give
    another gradient than the whole batch's (2.90 against 2.52 on a fork's batch); one over the step's
    weights gives the same, to rounding."""
    add_entries(monkeypatch, "imbalanced_data")
    flags = ["--dataset", "imbalanced", "--synthetic-size", "48"]
    _, whole, whole_ckpt, _ = trained(tmp_path / "whole", *flags, "--batch-size", "24", task=weighted)
    _, micro, micro_ckpt, _ = trained(tmp_path / "micro", *flags, "--batch-size", "8", "--accum-steps", "3",
                                      task=weighted)
    assert micro["steps"] == whole["steps"] == 4
    assert max((micro_ckpt["model"][k] - whole_ckpt["model"][k]).abs().max().item()
               for k in whole_ckpt["model"]) <= 1e-5
    assert micro["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)


def test_two_processes_step_as_one_with_a_class_weighted_loss(tmp_path):
    """torchrun with 2 gloo processes of 12 examples each against one process of 24: each process's
    weights are summed over both on the device (an all-reduce, no host read) before the division."""
    argv = ["--task", "weighted", "--entries", "imbalanced_data,pooled_model", "train.py", "--dataset",
            "imbalanced", "--synthetic-size", "96", "--image-size", "8", "--model", "pooledmlp", "--width",
            "8", "--batch-size", "24", "--epochs", "2", "--lr", "0.1", "--device", "cpu",
            "--num-workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([*LAUNCH, *argv, "--out-dir", str(tmp_path / "one")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([*LAUNCH[:1], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          *LAUNCH[1:], *argv, "--out-dir", str(tmp_path / "two")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (checkpoints.load_checkpoint(tmp_path / run / "last.pt")["model"] for run in ("one", "two"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")  # 12 steps: no bottom to read
def test_lr_find_accumulates_a_class_weighted_loss_as_one_batch():
    """lr_find with a normalizer: the loss a sum, divided once by the step's weights."""
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 4, (4,), generator=g))
             for _ in range(3 * 12)]
    whole = [tuple(torch.cat(parts) for parts in zip(*micro[i:i + 3], strict=True))
             for i in range(0, len(micro), 3)]
    weights = torch.tensor([0.5, 1.0, 2.0, 3.0])

    def summed(outputs, targets):
        return F.cross_entropy(outputs, targets, weight=weights, reduction="sum")

    def normalizer(batch):
        return weights[batch[1]].sum()

    runs = []
    for loader, accum_steps in ((micro, 3), (whole, 1)):
        torch.manual_seed(0)
        model = bn_free_net(3, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        after_each_step = []
        optimizer.register_step_post_hook(
            lambda *_, model=model, out=after_each_step: out.append(copy.deepcopy(model.state_dict())))
        result = lr_find(model, optimizer, summed, loader, start_lr=1e-3, end_lr=0.3, num_iter=12,
                         accum_steps=accum_steps, normalizer=normalizer)
        runs.append((result, after_each_step))
    (accumulated, accumulated_weights), (single, single_weights) = runs
    assert accumulated.losses == pytest.approx(single.losses, rel=1e-5)
    for a, b in zip(accumulated_weights, single_weights, strict=True):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
