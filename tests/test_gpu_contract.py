"""What the CUDA path promises, checked on CPU wherever a CPU can show it.

Fused optimizers under an fp16 GradScaler that skips steps, the AMP choice on GPUs without native
bf16, channels_last and the autocast dtype, the DataLoader path's workers, a checkpoint round trip,
and torchrun's download and device rules. The `check_*` helpers take a device: tests/test_cuda.py
runs them again on a GPU.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, build_loaders
from torch import nn

import train
from configs import UserError, parse_config
from machinery import batches, checkpoints, precision, processes, served
from models import build_model, build_optimizer, fused_by_default
from schedules import build_scheduler, optimizer_step

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named, never used for computation here
OPTIMIZERS = {"sgd": ["--optimizer", "sgd"], "sgd-no-momentum": ["--optimizer", "sgd", "--momentum", "0"],
              "adamw": ["--optimizer", "adamw", "--lr", "0.01"]}
TINY = ["--dataset", "synthetic", "--image-size", "8", "--width", "4", "--batch-size", "16",
        "--synthetic-size", "128", "--log-every", "1000"]


# ---------------------------------------------------------------- fused optimizers under fp16

def fp16_with_skips(cfg, fused: bool, device: torch.device, skipped: int = 2, steps: int = 6):
    """`steps` fp16 steps through optimizer_step; the first `skipped` get an inf gradient."""
    torch.manual_seed(0)
    model = build_model(cfg, 3, 10, device)
    optimizer = build_optimizer(model, cfg, float(cfg.lr), fused=fused)
    scheduler = build_scheduler(optimizer, "cosine", steps, warmup_steps=1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)  # high enough for no overflow of its own
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(16, 3, 8, 8, generator=g).to(device)
    targets = torch.randint(0, 10, (16,), generator=g).to(device)
    stepped = []
    for i in range(steps):
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        if i < skipped:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        stepped.append(optimizer_step(optimizer, scheduler, scaler))
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scheduler, stepped


def check_fused_fp16_matches_unfused(name: str, device: torch.device, decide_on: torch.device) -> bool:
    """The fused choice build_optimizer makes on `decide_on`, run on `device`, against no fusing.

    Returns the choice, so callers can see that the fused kernels were really exercised.
    """
    cfg = parse_config([*TINY, *OPTIMIZERS[name], "--amp", "fp16"])
    fused = fused_by_default(cfg, decide_on)
    # processes.pick_device (run by earlier tests) turns on TF32 and cuDNN autotuning, whose rounding
    # Adam's normalised steps amplify past any bound; the kernels are compared without them.
    flags = (torch.backends.cudnn, "allow_tf32", False), (torch.backends.cudnn, "benchmark", False), (
        torch.backends.cuda.matmul, "allow_tf32", False)
    saved = [getattr(owner, name) for owner, name, _ in flags]
    try:
        for owner, name, value in flags:
            setattr(owner, name, value)
        model, optimizer, scheduler, stepped = fp16_with_skips(cfg, fused, device)
        ref_model, ref_optimizer, ref_scheduler, _ = fp16_with_skips(cfg, False, device)
    finally:
        for (owner, name, _), value in zip(flags, saved, strict=True):
            setattr(owner, name, value)
    assert stepped == [False, False, True, True, True, True]
    assert scheduler.last_epoch == ref_scheduler.last_epoch == 4
    assert optimizer.param_groups[0]["lr"] == ref_scheduler.get_last_lr()[0]
    # CUDA's fused AdamW rounds differently from its foreach kernel where a gradient is near eps: on
    # an H200, by up to 7e-4 in a weight after 6 steps at lr 0.01, with or without skipped steps (each
    # kernel alone is deterministic). A step wrongly taken moves a weight by about lr, so lr / 5 still
    # catches one; the moments get a bound as loose, the step count none.
    loose = bool(fused) and cfg.optimizer == "adamw" and device.type == "cuda"
    for (key, p), q in zip(model.state_dict().items(), ref_model.state_dict().values(), strict=True):
        assert torch.isfinite(p.float()).all(), key
        torch.testing.assert_close(p, q, msg=key, **({"atol": float(cfg.lr) / 5, "rtol": 0} if loose else {}))
    state, ref_state = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for index, entry in state.items():
        assert entry.keys() == ref_state[index].keys()
        for key, value in entry.items():
            ref = ref_state[index][key].cpu()
            assert torch.isfinite(value.float()).all(), (index, key)
            close = {"rtol": 0.1, "atol": 0.1 * float(ref.abs().max())} if loose and key != "step" else {}
            torch.testing.assert_close(value.cpu(), ref, msg=f"{index}.{key}", **close)
    return fused


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_choice_survives_skipped_fp16_steps(name):
    """The choice made for a CUDA device, run with CPU's fused kernels.

    Fused SGD with momentum after a skipped first step leaves garbage (even NaN) in the weights,
    so choosing it there fails this test; AdamW and momentum-free SGD stay fused and must match.
    """
    fused = check_fused_fp16_matches_unfused(name, CPU, decide_on=CUDA)
    assert fused == (name != "sgd")


def fake_bf16_support(native: bool):
    """torch.cuda.is_bf16_supported for a GPU that has bf16 natively (A100) or only emulated (T4)."""
    return lambda including_emulation=True: native or including_emulation


@pytest.mark.parametrize("native", [True, False], ids=["ampere", "t4-v100"])
def test_auto_amp_and_fused_choice_on_cuda(monkeypatch, native):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake_bf16_support(native))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a GradScaler("cuda") without CUDA warns that it is disabled
        dtype, scaler = processes.amp_setup(CUDA, "auto")
    assert dtype == (torch.bfloat16 if native else torch.float16)
    assert (scaler is None) == native
    sgd, adamw = (parse_config(OPTIMIZERS[name]) for name in ("sgd", "adamw"))
    assert fused_by_default(sgd, CUDA) == native  # fused SGD with momentum only without a scaler
    assert fused_by_default(adamw, CUDA)
    assert not fused_by_default(sgd, CPU) and not fused_by_default(adamw, CPU)


# ---------------------------------------------------------------- what the loop feeds the model

def check_channels_last_and_autocast(tmp_path, monkeypatch, device: str, amp: str, dtype: torch.dtype):
    """Through train.train: the first conv gets channels_last input, every conv weight is
    channels_last, and its output has the autocast dtype."""
    seen = []
    real_build = train.build_model

    def build_and_watch(*args, **kwargs):
        model = real_build(*args, **kwargs)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]

        def watch(module, inputs, output):
            if module.training:
                seen.append((inputs[0].is_contiguous(memory_format=torch.channels_last),
                             all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs),
                             output.dtype))

        convs[0].register_forward_hook(watch)
        return model

    monkeypatch.setattr(train, "build_model", build_and_watch)
    train.train(parse_config([*TINY, "--device", device, "--amp", amp, "--channels-last",
                              "--epochs", "1", "--out-dir", str(tmp_path)]))
    assert len(seen) == 8
    assert all(seen_input and seen_weights for seen_input, seen_weights, _ in seen), seen
    assert {seen_dtype for _, _, seen_dtype in seen} == {dtype}


def test_channels_last_and_autocast_dtype(tmp_path, monkeypatch):
    check_channels_last_and_autocast(tmp_path, monkeypatch, "cpu", "bf16", torch.bfloat16)


@pytest.mark.parametrize("mode, device, accum, kept", [
    ("reduce-overhead", "cuda", 2, True), ("reduce-overhead", "cuda", 1, False),
    ("reduce-overhead", "cpu", 2, False), ("default", "cuda", 2, False)])
def test_cuda_graphs_under_accumulation_add_to_gradients_that_exist(mode, device, accum, kept):
    """--compile reduce-overhead with --accum-steps > 1 (pytorch#169545): gradients exist before the first
    micro-batch, so autograd adds to them instead of taking a graph's reused buffer, and the loop zeroes
    rather than frees them. Checked on CUDA end to end by tests/test_cuda.py."""
    model = build_model(parse_config(["--model", "resnet_small", "--width", "4"]), channels=1, num_outputs=3)
    model.fc = nn.Linear(2, 2).requires_grad_(False)  # frozen: no gradient made
    precision.compile_model(model, model, mode, torch.device(device), accum_steps=accum)  # lazy: no CUDA
    assert precision.keeps_gradients(mode, torch.device(device), accum) == kept
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all((p.grad is not None and not p.grad.any()) == kept for p in trained)
    assert model.fc.weight.grad is None


def check_dataloader_path(monkeypatch, device: str):
    """One DataLoader with persistent workers for every epoch, pinned batches on CUDA, and the
    very batches the device-resident path serves, augmentation included."""
    made, pinned = [], []

    class Recording(torch.utils.data.DataLoader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def __iter__(self):
            for images, targets in super().__iter__():
                pinned.append(images.is_pinned())
                yield images, targets

    cfg = parse_config(["--dataset", "digits", "--batch-size", "256", "--device", device])
    on_device, _, _, _ = build_loaders(cfg, torch.device(device))
    monkeypatch.setattr(torch.utils.data, "DataLoader", Recording)
    cfg.loader = "dataloader"
    workers, _, _, info = build_loaders(cfg, torch.device(device))
    assert "DataLoader" in info.loader
    for epoch in (0, 1):
        pairs = list(zip(on_device.epoch(epoch), workers.epoch(epoch), strict=True))
        assert len(pairs) == 1293 // 256
        for (xa, ya), (xb, yb) in pairs:
            assert xb.device == xa.device and torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(made) == 1 and made[0].persistent_workers and made[0].num_workers == 2
    assert made[0].pin_memory == (torch.device(device).type == "cuda")
    assert len(pinned) == 2 * (1293 // 256) and all(p == made[0].pin_memory for p in pinned)
    made.clear()  # the class's closure holds `made`: a cycle, which would leave the workers to the collector


def test_dataloader_path_keeps_one_loader(monkeypatch):
    check_dataloader_path(monkeypatch, "cpu")


class WorkerPids(torch.utils.data.Dataset):
    """Tiny images labelled with the id of the process that loaded them."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.full((1, 2, 2), i, dtype=torch.uint8), os.getpid()


def test_dataloader_workers_survive_epochs_and_evaluations():
    serving, image = batches.Serving(4, CPU, num_workers=2), batches.ImageSteps(torch.zeros(1), torch.ones(1))
    for split in (served.Batches(WorkerPids(), None, serving, train=True, image=image),
                  served.Batches(WorkerPids(), None, serving, train=False, image=image)):
        pids = [set(torch.cat([y for _, y in split.epoch(e)]).tolist()) for e in range(3)]
        assert len(pids[0]) == 2 and os.getpid() not in pids[0]
        assert pids[0] == pids[1] == pids[2], "workers were restarted between passes"


# ---------------------------------------------------------------- checkpoints

def check_checkpoint_round_trip(tmp_path, monkeypatch, device: str, flags: list[str]) -> dict:
    """Train one epoch, rebuild everything as a resume does, load last.pt: model, optimizer
    (fused or not, state on the same devices) and GradScaler come back equal. Then resume for a
    second epoch. Returns the live optimizer's defaults, to see whether it was fused."""
    live = {}
    real_model, real_optimizer, real_amp = train.build_model, train.build_optimizer, train.amp_setup

    def keep(name, build):
        def wrapper(*args, **kwargs):
            live[name] = build(*args, **kwargs)
            return live[name]
        return wrapper

    monkeypatch.setattr(train, "build_model", keep("model", real_model))
    monkeypatch.setattr(train, "build_optimizer", keep("optimizer", real_optimizer))
    monkeypatch.setattr(train, "amp_setup", keep("amp", real_amp))
    argv = [*TINY, "--device", device, "--schedule", "constant", "--out-dir", str(tmp_path), *flags]
    cfg = parse_config([*argv, "--epochs", "1"])
    train.train(cfg)
    model, optimizer, (_, scaler) = live["model"], live["optimizer"], live["amp"]

    ckpt = checkpoints.load_checkpoint(tmp_path / "last.pt")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    fresh_model = real_model(cfg, 3, 10, dev)
    fresh_optimizer = real_optimizer(fresh_model, cfg, float(cfg.lr))
    _, fresh_scaler = real_amp(dev, cfg.amp)
    fresh_model.load_state_dict(ckpt["model"])
    fresh_optimizer.load_state_dict(ckpt["optimizer"])
    assert (scaler is None) == (fresh_scaler is None) == (ckpt["scaler"] is None)
    if scaler is not None:
        fresh_scaler.load_state_dict(ckpt["scaler"])
        assert fresh_scaler.state_dict() == scaler.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[key], value), key
    assert fresh_optimizer.defaults.get("fused") == optimizer.defaults.get("fused")
    state, fresh_state = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert state.keys() == fresh_state.keys() and state
    for index, entry in state.items():
        for key, value in entry.items():
            other = fresh_state[index][key]
            assert other.device == value.device and other.dtype == value.dtype, (index, key)
            assert torch.equal(other, value), (index, key)

    summary = train.train(parse_config([*argv, "--epochs", "2", "--allow-more-epochs", "--resume"]))
    assert summary["steps"] == 16 and summary["val_loss"] == summary["val_loss"]  # not NaN
    return optimizer.defaults


def test_checkpoint_round_trip_fp16(tmp_path, monkeypatch):
    flags = ["--amp", "fp16", *OPTIMIZERS["adamw"]]
    defaults = check_checkpoint_round_trip(tmp_path, monkeypatch, "cpu", flags)
    assert not defaults.get("fused")  # never fused by default on CPU


# ---------------------------------------------------------------- torchrun

def test_explicit_gpu_index_under_torchrun_is_refused(monkeypatch, script):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="one GPU.*--device cuda"):
        processes.pick_device("cuda:0")
    assert processes.pick_device("cpu") == CPU
    result = script("train.py", "--device", "cuda:1", "--epochs", "1", env={"WORLD_SIZE": "2"}, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "torchrun" in result.stderr


RANK_SCRIPT = r'''
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision

import data
from configs import parse_config

root, rank = sys.argv[1], int(sys.argv[2])


def note(line):
    with open(Path(root) / "log.txt", "a") as log:
        log.write(line + "\n")


class FakeCIFAR10:
    """torchvision's CIFAR10 as far as data.py uses it; its download takes a moment and is noted."""

    def __init__(self, root, train=True, download=False):
        done = Path(root) / "downloaded"
        if not done.exists():
            if not download:
                raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
            note(f"download starts on rank {rank}")
            time.sleep(0.5)
            done.touch()
            note(f"download ends on rank {rank}")
        note(f"rank {rank} reads")
        g = torch.Generator().manual_seed(int(train))
        self.data = torch.randint(0, 256, (12, 32, 32, 3), generator=g, dtype=torch.uint8)
        self.classes = [str(c) for c in range(10)]
        self.targets = torch.randint(0, 10, (12,), generator=g).tolist()


torchvision.datasets.CIFAR10 = FakeCIFAR10
dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
dist.barrier()  # both ranks reach the dataset at the same moment
cfg = parse_config(["--dataset", "cifar10", "--data-dir", root])
source = data.torchvision_set("CIFAR10", cfg)
images, labels = source.train  # and one of the 12 held out for val; train=False is the test split
assert images.shape == (11, 3, 32, 32) and len(labels) == 11 and len(source.val[1]) == 1
assert source.test[0].shape == (12, 3, 32, 32)
dist.destroy_process_group()
'''


def test_under_torchrun_rank_0_downloads_alone(tmp_path):
    """Two gloo processes reach a missing dataset together; a fake CIFAR10 notes who downloads."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rank)], env=env,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for rank in ranks:
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-2000:]
    log = (tmp_path / "log.txt").read_text().splitlines()
    assert [line for line in log if "download" in line] == ["download starts on rank 0",
                                                             "download ends on rank 0"]
    assert log.index("download ends on rank 0") < log.index("rank 1 reads")
