"""--throughput: what bounds a run. Each epoch's line and summary.json add the share of the epoch the loop
waited for its next batch (host time: a large share means the data bounds the run), the achieved TFLOP/s
(the FLOPs of one training example, forward and backward, counted once at setup) and, where the device's
peak is known (a GPU of the table below, or --peak-tflops), MFU: achieved over peak. Nothing here reads the
device during an epoch; the epoch's end already waits for it (logs.Speed)."""

from __future__ import annotations

import contextlib
import copy
import re
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from machinery.inputs import rows
from machinery.logs import Speed
from machinery.processes import autocast, say

# Peak dense TFLOP/s per GPU and the dtype its matmuls run in, from the vendors' datasheets: each datasheet's
# figure without sparsity (its starred tensor-core figures assume 2:4 sparsity and are twice these); "fp32" is
# the non-tensor FP32 figure, "tf32" the TF32 tensor-core one. RTX 4090: the Ada whitepaper's figures with
# FP32 accumulate, which autocast's matmuls use (FP16 accumulate is twice as fast).
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM and PCIe alike
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},  # 1,979 / 989 with sparsity
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},  # 1,513 / 756 with sparsity
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},  # 1,671 / 835 with sparsity
    "H200": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},  # H200 SXM, as the H100 SXM
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},  # 733 / 366 with sparsity
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},  # 242 / 120 with sparsity
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
}
# torch.cuda.get_device_name's words for each: the first pattern that matches names the row ("NVIDIA H100 80GB
# HBM3" is the SXM board; "L4" is a whole word, not L40S's start; GH200 and RTX 4090 D are other chips).
GPU_NAMES = ((r"\bH100\b.*\b(PCIe|HBM2e)\b", "H100 PCIe"), (r"\bH100\b.*\bNVL\b", "H100 NVL"),
             (r"\bH100\b", "H100 SXM"), (r"\bH200\b.*\bNVL\b", "H200 NVL"), (r"\bH200\b", "H200"),
             (r"\bA100\b", "A100"), (r"\bL40S\b", "L40S"), (r"\bL4\b", "L4"),
             (r"\bRTX 4090\b(?! D)", "RTX 4090"))


def peak_tflops(device_name: str, dtype: str) -> tuple[float, str] | None:
    """The table's peak for a GPU named as torch.cuda.get_device_name names it, computing in `dtype` (bf16,
    fp16, tf32, fp32), and the row it came from; None for a GPU the table does not hold."""
    for pattern, gpu in GPU_NAMES:
        if re.search(pattern, device_name, re.IGNORECASE):
            return PEAK_TFLOPS[gpu][dtype], gpu
    return None


def compute_dtype(amp_dtype: torch.dtype | None) -> str:
    """The dtype the step's matmuls run in: AMP's, else TF32 where torch may use it (processes.py turns it on
    unless --deterministic), else fp32."""
    if amp_dtype is not None:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def train_flops(model: torch.nn.Module, inputs, loss, precision=contextlib.nullcontext) -> tuple[int, int]:
    """The FLOPs of one training step on `inputs`, forward and backward (a multiply-add is 2), counted by
    torch's FlopCounterMode on a copy of the model (its BatchNorm statistics and gradients stay as they are,
    and the random numbers too: dropout draws from a forked generator); and the examples in the batch: the
    inputs' rows, not the outputs' (a GAN's hold 2N). `loss(outputs)` is the step's loss; `precision()` the
    forward's context (AMP's autocast)."""
    copied = copy.deepcopy(model).train()
    device = next(model.parameters()).device
    devices = [] if device.type == "cpu" else [device.index or 0]
    with torch.random.fork_rng(devices, device_type=device.type), FlopCounterMode(display=False) as counter:
        with precision():
            outputs = copied(inputs)
            value = loss(outputs)
        value.backward()
    return counter.get_total_flops(), rows(inputs)


def measured(model: torch.nn.Module, batches, task, cfg, info, amp_dtype, world_size: int) -> Throughput:
    """The meter for this run: one micro-batch's FLOPs counted on the first training examples (as the loop
    runs them: AMP's autocast, the task's loss), the peak from --peak-tflops or the table; said in a line."""
    device = next(model.parameters()).device
    inputs, targets = batches.first(max(cfg.batch_size // world_size, 2))  # BatchNorm needs 2
    flops, examples = train_flops(model, inputs, lambda outputs: task.loss(outputs, targets, cfg, info),
                                  lambda: autocast(device, amp_dtype))
    dtype = compute_dtype(amp_dtype)
    found = (cfg.peak_tflops, "--peak-tflops") if cfg.peak_tflops else (
        peak_tflops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None)
    peak = None if found is None else found[0]
    said = f"MFU against {peak:g} TFLOP/s ({found[1]}, {dtype} dense)" if found else (
        "no MFU: no peak known for this device (--peak-tflops gives one)")
    say(f"--throughput: {flops / examples / 1e9:.3g} GFLOP a training example (forward and backward); {said}")
    return Throughput(flops / examples, peak, world_size)


class Throughput(Speed):
    """logs.Speed, and for each epoch its TFLOP/s a device, MFU (with a peak), and the share of its time spent
    waiting for the next batch."""

    def __init__(self, flops_per_example: float, peak: float | None, world_size: int = 1):
        super().__init__()
        self.flops_per_example, self.peak, self.world_size = flops_per_example, peak, world_size
        self.tflops, self.waits, self.waited = [], [], 0.0

    def start(self, stream, batch: int):
        """Speed's, and the epoch's batches each timed on the host as the loop waits for it."""
        self.waited = 0.0
        return timed(super().start(stream, batch), self)

    def end(self, batches: int, batch_size: int, device, images: bool) -> str:
        """Speed's figure, then TFLOP/s, MFU and the data wait."""
        pace = super().end(batches, batch_size, device, images)
        if not pace:
            return pace
        seconds = max(time.perf_counter() - self.began, 1e-9)
        self.tflops.append(self.flops_per_example * self.rates[-1] / self.world_size / 1e12)
        self.waits.append(min(self.waited / seconds, 1.0))
        mfu = f", MFU {self.tflops[-1] / self.peak:.1%}" if self.peak else ""
        return f"{pace[:-1]}, {self.tflops[-1]:.3g} TFLOP/s{mfu}, waiting for data {self.waits[-1]:.0%})"

    def facts(self) -> dict:
        """summary.json's: Speed's, and the steady epochs' means (the first epoch left out, as Speed does);
        "mfu" only where a peak is known."""
        facts = super().facts()
        if not self.tflops:
            return facts
        tflops, waits = steady(self.tflops), steady(self.waits)
        facts |= {"tflops_per_device": tflops, "data_wait_share": waits,
                  "train_flops_per_example": self.flops_per_example}
        return facts | ({"peak_tflops": self.peak, "mfu": tflops / self.peak} if self.peak else {})


def steady(values: list[float]) -> float:
    """The mean leaving out the first epoch (warm-up), where there is another."""
    kept = values[1:] or values
    return sum(kept) / len(kept)


def timed(stream, meter: Throughput):
    """The batches of `stream`, the wait for each (host time only) added to the meter's `waited`."""
    while True:
        began = time.perf_counter()
        batch = next(stream, None)
        meter.waited += time.perf_counter() - began
        if batch is None:
            return
        yield batch
