"""Host reads per optimizer step: none in fp32/bf16 between log points, one under fp16 + GradScaler.

A read is aten._local_scalar_dense, what .item(), float(t) and bool(t) become; on a GPU each one
waits for the device to drain. Each figure is the marginal count between a run of N optimizer
steps and one of 3N, so the reads at start-up, at the log point and in evaluation cancel out.
The helpers take a device so tests/test_cuda.py runs the same counts on a GPU.
"""

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import train
from configs import parse_config
from lr_find import lr_find
from models import ResNetSmall
from schedules import build_scheduler, optimizer_step

STEPS = 10  # N; the second run has 3N (lr_find needs 10 or more)


class HostReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense calls made while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def per_step(run) -> float:
    """Marginal host reads per optimizer step: run(steps) for N and 3N steps."""
    counts = []
    for steps in (STEPS, 3 * STEPS):
        with HostReads() as reads:
            run(steps)
        counts.append(reads.count)
    return (counts[1] - counts[0]) / (2 * STEPS)


def train_reads_per_step(tmp_path, flags: list[str], device: str = "cpu") -> float:
    """train.train on synthetic data (pad 0), one epoch of `steps` steps, one log point at its end."""
    def run(steps: int) -> None:
        cfg = parse_config(["--device", device, "--dataset", "synthetic", "--image-size", "8",
                            "--width", "4", "--batch-size", "8", "--synthetic-size", str(8 * steps),
                            "--epochs", "1", "--log-every", "1000",
                            "--out-dir", str(tmp_path / str(steps)), *flags])
        with contextlib.redirect_stdout(io.StringIO()):
            summary = train.train(cfg)
        assert summary["steps"] == steps

    return per_step(run)


ALL_LOGS = ["--log-to", "tensorboard,csv,wandb,mlflow"]  # issue 43: the trackers add no per-step work


def offline_trackers(monkeypatch) -> None:
    """W&B offline and MLflow on SQLite beside the runs, for tests that log to all of --log-to's trackers."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.parametrize("flags", [[], ["--no-augment"], ["--amp", "bf16"], ["--loader", "dataloader"],
                                   ["--ema", "0.99"], ALL_LOGS, ["--throughput"]],
                         ids=["fp32", "no-augment", "bf16", "dataloader", "ema", "all-trackers",
                              "throughput"])  # issue 55: its meter times the batches on the host only
def test_no_host_reads_between_log_points(tmp_path, flags, monkeypatch):
    if flags == ALL_LOGS:
        offline_trackers(monkeypatch)
    reads = train_reads_per_step(tmp_path, flags)
    print(f"train.py {' '.join(flags) or 'fp32'}: {reads:.3f} host reads per step")
    assert reads <= 0.05


def test_fp16_grad_scaler_reads_once_per_step(tmp_path):
    reads = train_reads_per_step(tmp_path, ["--amp", "fp16"])
    print(f"train.py --amp fp16: {reads:.3f} host reads per step")
    assert reads <= 1.05


def fused_step_reads_per_step(device: str = "cpu") -> float:
    """optimizer_step with fused AdamW, which skips on the device: the scale is its one read."""
    def run(steps: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sched = build_scheduler(opt, "cosine", steps)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**8)
        x, y = torch.randn(8, 4, device=device), torch.randint(0, 3, (8,), device=device)
        for _ in range(steps):
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            optimizer_step(opt, sched, scaler)
            opt.zero_grad(set_to_none=True)

    return per_step(run)


def test_fused_optimizer_under_grad_scaler_reads_once_per_step():
    reads = fused_step_reads_per_step()
    print(f"optimizer_step, fused AdamW, fp16: {reads:.3f} host reads per step")
    assert reads <= 1.05


def sweep_reads_per_step(amp: torch.dtype | None, fused: bool, device: str = "cpu") -> float:
    """lr_find's sweep; it stays in a trainable range so it runs every step."""
    def run(steps: int) -> None:
        torch.manual_seed(0)
        model = ResNetSmall(3, 10, 4).to(device)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if fused
               else torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9))
        scaler = torch.amp.GradScaler(device, init_scale=2.0**8) if amp == torch.float16 else None
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 3, 8, 8, generator=g).to(device),
                 torch.randint(0, 10, (8,), generator=g).to(device)) for _ in range(4)]
        result = lr_find(model, opt, F.cross_entropy, data, start_lr=1e-5, end_lr=1e-3,
                         num_iter=steps, diverge=1e9, autocast_dtype=amp, scaler=scaler)
        assert len(result.lrs) == steps, result.stop_reason

    return per_step(run)


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
@pytest.mark.parametrize(("amp", "fused", "limit"), [
    (None, False, 1.05),  # the loss it records, nothing else
    (torch.float16, False, 2.05),  # plus GradScaler's own inf check before a plain optimizer step
    (torch.float16, True, 1.05),  # a fused optimizer skips on the device: no inf check read
], ids=["fp32", "fp16-sgd", "fp16-fused-adamw"])
def test_lr_find_sweep_reads_per_step(amp, fused, limit):
    reads = sweep_reads_per_step(amp, fused)
    kind = f"{'fp16' if amp else 'fp32'} {'fused AdamW' if fused else 'SGD'}"
    print(f"lr_find sweep {kind}: {reads:.3f} host reads per step")
    assert reads <= limit
