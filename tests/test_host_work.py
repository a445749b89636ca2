"""Ops per optimizer step that train.py's loop runs beyond a bare loop (lr_find's: tests/test_lr_find.py).

On a GPU each aten op is a kernel launch, a few microseconds of host time, and a small model's step
is launch-bound (docs/speed.md): whatever the loop runs beside forward, backward and the optimizer
step shows there, even where CPU compute hides it. A TorchDispatchMode counts every aten op; each
figure is the marginal count between N and 3N optimizer steps (as in tests/test_sync.py), so setup,
the first step's picture, the one log point, evaluation and saving cancel. The bare loop is the
same model, data, loss (task.loss) and optimizer: forward, backward, optimizer step, zero_grad.
The helpers take a device, so tests/test_cuda.py can run the same counts on a GPU.
"""

import collections
import contextlib
import io

import pytest
import torch
from conftest import Ops, build_loaders
from test_sync import ALL_LOGS, offline_trackers

import task
import train
from configs import parse_config
from machinery.processes import amp_setup, autocast
from models import build_model, build_optimizer

STEPS = 4  # N; the second run has 3N (counts are exact: a few steps suffice)
# What the loop may add per micro-batch: the loss kept for the log point's mean, loss.detach(). A
# loop with no waste needs that one op or none; the division by the micro-batches is the bare loop's
# too (where there are several), and the rate is a host float.
LOOP_OPS_PER_MICRO_BATCH = 1


def per_step(run) -> collections.Counter:
    """Marginal ops per optimizer step, by name: run(steps) for N and 3N steps."""
    counts = []
    for steps in (STEPS, 3 * STEPS):
        with Ops() as ops:
            run(steps)
        counts.append(ops.counts)
    return collections.Counter({op: (counts[1][op] - counts[0][op]) / (2 * STEPS)
                                for op in counts[0].keys() | counts[1].keys()})


def config(steps: int, flags: list[str], out_dir, device: str):
    """`steps` optimizer steps in one epoch, one validation batch, one log point (at the end)."""
    accum = int(flags[flags.index("--accum-steps") + 1]) if "--accum-steps" in flags else 1
    return parse_config(["--device", device, "--dataset", "synthetic", "--image-size", "8", "--width", "4",
                         "--batch-size", "8", "--synthetic-size", str(8 * accum * steps),
                         "--synthetic-val-size", "8", "--epochs", "1", "--log-every", "1000",
                         "--out-dir", str(out_dir), *flags])


def bare_loop(cfg) -> None:
    """One epoch of forward, task.loss, backward and optimizer step, nothing else, on data, model,
    optimizer and AMP built as train.py builds them."""
    device, k = torch.device(cfg.device), cfg.accum_steps
    torch.manual_seed(cfg.seed)
    batches, _, _, info = build_loaders(cfg, device)
    model = build_model(cfg, info.input_shape[0], len(info.names), device)
    optimizer = build_optimizer(model, cfg, float(cfg.lr))
    amp_dtype, scaler = amp_setup(device, cfg.amp)
    stream = batches.epoch(0)
    model.train()
    for _ in range(len(batches) // k):
        for _ in range(k):
            inputs, targets = next(stream)
            with autocast(device, amp_dtype):
                loss = task.loss(model(inputs), targets, cfg, info) / task.normalizer(targets, cfg, info)
            loss = loss / k if k > 1 else loss
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)


def loop_ops(tmp_path, flags: list[str], device: str = "cpu") -> tuple[collections.Counter, ...]:
    """Ops per optimizer step of train.train and of the bare loop on the same setup."""
    def trained(steps: int) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            summary = train.train(config(steps, flags, tmp_path / f"train{steps}", device))
        assert summary["steps"] == steps

    return per_step(trained), per_step(lambda steps: bare_loop(config(steps, flags, tmp_path, device)))


def added(ops: collections.Counter, bare: collections.Counter) -> dict[str, float]:
    return {op: ops[op] - bare[op] for op in sorted(ops.keys() | bare.keys()) if ops[op] != bare[op]}


@pytest.mark.parametrize("flags", [[], ["--amp", "fp16"], ["--accum-steps", "2"], ALL_LOGS],
                         ids=["fp32", "fp16", "accum2", "all-trackers"])
def test_loop_adds_at_most_the_kept_loss_per_micro_batch(tmp_path, flags, monkeypatch):
    if flags == ALL_LOGS:
        offline_trackers(monkeypatch)
    ops, bare = loop_ops(tmp_path, flags)
    extra = added(ops, bare)
    micro_batches = flags[flags.index("--accum-steps") + 1] if "--accum-steps" in flags else 1
    print(f"train.py {' '.join(flags) or 'fp32'}: {ops.total():.2f} ops per step, bare loop "
          f"{bare.total():.2f}, added {extra}")
    assert bare.total() > 100  # the forward, backward and step are all counted
    assert ops.total() - bare.total() <= LOOP_OPS_PER_MICRO_BATCH * int(micro_batches), extra
