"""Tests for lr_find.py: exact restoration, the lr schedule, smoothing, stopping, suggestions."""

from __future__ import annotations

import builtins
import collections
import copy
import errno
import io
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Ops
from PIL import Image
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lr_find as lf  # noqa: E402

F = nn.functional
# Schedule names as save_sweep and plot_lr_find are told of them (python lr_find.py tells schedules.SCHEDULES)
NAMES = ("onecycle", "constant", "step", "cosine", "warmup")


def make_convnet(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        nn.Linear(4, 3),
    )


def make_batches(n: int = 4, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, 6, 6, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        head = list(model[-1].parameters())
        head_ids = {id(p) for p in head}
        body = [p for p in model.parameters() if id(p) not in head_ids]
        return torch.optim.SGD(
            [{"params": body}, {"params": head, "lr": 0.02}],
            lr=0.01,
            momentum=0.9,
            weight_decay=1e-4,
        )
    return torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.95))


def train_steps(model, optimizer, batches, scaler=None, autocast_dtype=None) -> None:
    model.train()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)
        with ctx:
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def snapshot(model, optimizer, scaler=None) -> dict:
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "param_ids": [id(p) for p in model.parameters()],
        "opt_state": {
            id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in optimizer.state.items()
        },
        "opt_state_ids": {
            (id(p), k): id(v) for p, s in optimizer.state.items() for k, v in s.items()
        },
        "groups": [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups
        ],
        "scaler": None if scaler is None else scaler.state_dict(),
        "modes": [m.training for m in model.modules()],
        "attributes": [sorted(vars(m)) for m in model.modules()],
    }


def assert_restored(before: dict, model, optimizer, scaler=None) -> None:
    after = snapshot(model, optimizer, scaler)
    assert after["param_ids"] == before["param_ids"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, t in before["tensors"].items():
        now = after["tensors"][name]
        assert now.dtype == t.dtype and now.device == t.device, name
        assert torch.equal(now, t), name
    assert after["opt_state"].keys() == before["opt_state"].keys()
    for pid, state in before["opt_state"].items():
        assert after["opt_state"][pid].keys() == state.keys()
        for k, v in state.items():
            now = after["opt_state"][pid][k]
            if torch.is_tensor(v):
                assert now.dtype == v.dtype and now.device == v.device, k
                assert torch.equal(now, v), k
            else:
                assert now == v, k
    assert after["opt_state_ids"] == before["opt_state_ids"]
    assert after["groups"] == before["groups"]
    assert after["scaler"] == before["scaler"]
    assert after["modes"] == before["modes"]
    assert after["attributes"] == before["attributes"]
    assert all(p.grad is None for p in model.parameters())


def draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist()


@pytest.mark.parametrize("use_scaler", [False, True], ids=["fp32", "bf16-scaler"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_diverging_sweep_restores_everything_bit_for_bit(opt_name, use_scaler):
    model = make_convnet()
    optimizer = make_optimizer(opt_name, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if use_scaler else None
    dtype = torch.bfloat16 if use_scaler else None
    batches = make_batches()
    train_steps(model, optimizer, batches[:2], scaler, dtype)
    model[1].eval()
    model[3].eval()
    before = snapshot(model, optimizer, scaler)

    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    control = draws()  # what each RNG gives next, then each put back
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])

    first_weight = model[0].weight
    seen = {"changed": False, "train": []}

    def progress(i, lr, loss):
        seen["changed"] |= not torch.equal(first_weight, before["tensors"]["0.weight"])
        seen["train"].append(all(m.training for m in model.modules()))
        draws()  # the sweep moves every RNG, not only torch's (dropout): each must come back

    result = lf.lr_find(
        model, optimizer, F.cross_entropy, batches,
        start_lr=1e-4, end_lr=1e6, num_iter=30, scaler=scaler, autocast_dtype=dtype,
        progress=progress,
    )  # fmt: skip

    assert draws() == control
    assert result.stop_reason in ("diverged", "non-finite loss"), result.stop_reason
    assert seen["changed"] and all(seen["train"])
    assert_restored(before, model, optimizer, scaler)


def test_training_after_lr_find_matches_training_without_it():
    """Same seed, same data order: a run with a sweep first must equal a run without one."""
    ds = torch.utils.data.TensorDataset(*map(torch.cat, zip(*make_batches(6), strict=True)))

    def run(sweep: bool) -> tuple:
        model = make_convnet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        torch.manual_seed(123)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)
        if sweep:
            lf.lr_find(
                model, optimizer, F.cross_entropy, loader, num_iter=12, end_lr=1e3,
                scaler=scaler, autocast_dtype=torch.bfloat16,
            )  # fmt: skip
        train_steps(model, optimizer, loader, scaler, torch.bfloat16)
        return model.state_dict(), optimizer.state_dict()["state"], scaler.state_dict()

    (m1, o1, s1), (m2, o2, s2) = run(True), run(False)
    assert all(torch.equal(m1[k], m2[k]) for k in m2)
    assert all(torch.equal(o1[i][k], o2[i][k]) for i in o2 for k in o2[i])
    assert s1 == s2


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_exception_inside_sweep_restores_and_propagates(exc):
    model = make_convnet()
    optimizer = make_optimizer("adam", model)
    batches = make_batches()
    train_steps(model, optimizer, batches[:2])
    model[3].eval()
    before = snapshot(model, optimizer)
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        if len(calls) == 6:
            raise exc("stop here")
        return F.cross_entropy(out, y)

    with pytest.raises(exc):
        lf.lr_find(model, optimizer, loss_fn, batches, num_iter=20, start_lr=1e-2, end_lr=1e3)
    assert len(calls) == 6
    assert_restored(before, model, optimizer)


def test_interrupt_inside_scaler_step_leaves_training_unchanged():
    """Interrupted between scaler.step() and scaler.update(), the scaler would otherwise
    remember the optimizer as already unscaled and skip unscaling on the next step."""

    def run(interrupt: bool) -> tuple:
        model = make_convnet()
        optimizer = make_optimizer("sgd", model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        batches = make_batches()
        torch.manual_seed(7)
        train_steps(model, optimizer, batches[:1], scaler)
        if interrupt:
            before = snapshot(model, optimizer, scaler)

            def hook(opt, args, kwargs):
                raise Boom("between scaler.step and scaler.update")

            handle = optimizer.register_step_post_hook(hook)
            with pytest.raises(Boom):
                lf.lr_find(model, optimizer, F.cross_entropy, batches, num_iter=10, scaler=scaler)
            handle.remove()
            assert_restored(before, model, optimizer, scaler)
        train_steps(model, optimizer, batches[1:3], scaler)
        return model.state_dict(), scaler.state_dict()

    (m1, s1), (m2, s2) = run(True), run(False)
    assert all(torch.equal(m1[k], m2[k]) for k in m2)
    assert s1 == s2


def test_lr_scheduler_bookkeeping_is_restored():
    """A scheduler notices optimizer.step() through a flag on the optimizer; a sweep must not
    leave it set, or the 'scheduler.step() before optimizer.step()' check goes silent."""
    model, optimizer, loader = probe_setup()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    before = snapshot(model, optimizer)
    lf.lr_find(model, optimizer, F.mse_loss, loader, num_iter=10, end_lr=1.0)
    assert_restored(before, model, optimizer)
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        scheduler.step()


def test_tensor_lr_is_swept_in_place_and_restored():
    model, _, loader = probe_setup()
    lr = torch.tensor(0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    seen = []

    def loss_fn(out, y):
        seen.append(float(optimizer.param_groups[0]["lr"]))
        return F.mse_loss(out, y)

    result = lf.lr_find(model, optimizer, loss_fn, loader, num_iter=10, end_lr=1.0, diverge=1e9)
    assert seen == pytest.approx(result.lrs, rel=1e-6)
    assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.01)


class CountingLoader:
    """A re-iterable custom loader that counts batches and passes (in a list: lr_find puts a
    loader's plain attributes back, counters included)."""

    def __init__(self, batches):
        self.batches, self.log = batches, []

    @property
    def served(self):
        return self.log.count("batch")

    @property
    def passes(self):
        return self.log.count("pass")

    def __iter__(self):
        self.log.append("pass")
        for b in self.batches:
            self.log.append("batch")
            yield b


def linear_setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight], "lr": 1e-3}, {"params": [model.bias], "lr": 3e-3}], lr=1e-3
    )
    x = torch.randn(3, 8, 4)
    y = x @ torch.randn(4, 1)
    return model, optimizer, CountingLoader(list(zip(x, y, strict=True)))


def test_lr_schedule_group_ratio_and_loader_cycling():
    model, optimizer, loader = linear_setup()
    seen = []

    def loss_fn(out, y):
        seen.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"]))
        return F.mse_loss(out, y)

    with torch.no_grad():
        result = lf.lr_find(
            model, optimizer, loss_fn, loader, start_lr=1e-4, end_lr=1e-1, num_iter=10,
            diverge=1e9,
        )  # fmt: skip
    assert result.stop_reason == "completed"
    assert result.lrs[0] == 1e-4 and result.lrs[-1] == 1e-1
    expected = [1e-4 * 1000 ** (i / 9) for i in range(10)]
    assert result.lrs == pytest.approx(expected, rel=1e-12)
    assert [a for a, _ in seen] == result.lrs
    assert all(b == pytest.approx(3 * a, rel=1e-12) for a, b in seen)
    assert loader.served == 10 and loader.passes == 4
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 3e-3]


def test_accumulation_changes_lr_once_per_optimizer_step():
    model, optimizer, loader = linear_setup()
    seen, values = [], []

    def loss_fn(out, y):
        seen.append(optimizer.param_groups[0]["lr"])
        loss = F.mse_loss(out, y)
        values.append(loss.item())
        return loss

    result = lf.lr_find(
        model, optimizer, loss_fn, loader, start_lr=1e-4, end_lr=1e-1, num_iter=10,
        accum_steps=2, diverge=1e9,
    )  # fmt: skip
    assert len(result.lrs) == 10 and len(seen) == 20 and loader.served == 20
    assert seen[0::2] == seen[1::2] == result.lrs
    assert len(set(result.lrs)) == 10
    means = [(a + b) / 2 for a, b in zip(values[0::2], values[1::2], strict=True)]
    assert result.losses == pytest.approx(means, rel=1e-6)


def scripted_loss(values, optimizer=None):
    """A loss_fn whose value is scripted (by call count or by the current lr) exactly, with the
    gradient of the outputs' sum, so that the weights move (a sweep whose weights stay put gives
    no suggestion)."""
    calls = []

    def loss_fn(out, y):
        i = len(calls)
        calls.append(i)
        v = values(optimizer.param_groups[0]["lr"]) if optimizer is not None else values[i]
        total = out.sum()
        return total - total.detach() + v

    return loss_fn


def probe_setup():
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, [(torch.ones(2, 1), torch.zeros(2, 1))]


def synthetic_curve(lr_star: float, k: float = 2.0, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)

    def f(lr: float) -> float:
        u = math.log10(lr) - math.log10(lr_star)
        clean = 1.1 - math.tanh(k * u) + max(0.0, u - 1.0) ** 2
        return clean * (1 + noise * rng.gauss(0, 1))

    return f


def sweep_of_synthetic_curve(lr_star: float, noise: float) -> lf.LRFindResult:
    """A default sweep over synthetic_curve (also read by the bench's rules in test_bench_rules.py)."""
    model, optimizer, loader = probe_setup()
    f = synthetic_curve(lr_star, noise=noise, seed=int(-math.log10(lr_star)))
    return lf.lr_find(model, optimizer, scripted_loss(f, optimizer), loader)


@pytest.mark.parametrize("lr_star", [3e-5, 1e-3, 3e-2])
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_min_over_10_is_a_tenth_of_the_sweeps_bottom(lr_star, noise):
    result = sweep_of_synthetic_curve(lr_star, noise)
    lowest = result.lrs[min(range(len(result.lrs)), key=result.losses.__getitem__)]
    assert lowest / 3 <= 10 * result.suggest("min/10") <= 3 * lowest


def test_suggest_lr_on_a_clean_curve():
    lrs = [10 ** (-7 + 8 * i / 99) for i in range(100)]
    losses = [synthetic_curve(1e-2, k=1.5)(lr) for lr in lrs]
    bottom = 0.1266  # of the clean curve, 1.1 decades above 1e-2 with k = 1.5
    assert bottom / 1.3 <= lf.suggest_lr(lrs, losses) <= bottom * 1.3
    with pytest.warns(UserWarning, match="usable"):
        assert lf.suggest_lr(lrs[:5], losses[:5]) is None
    with pytest.warns(UserWarning, match="never decreases"):
        assert lf.suggest_lr(lrs, [float(i) for i in range(100)]) is None
    with pytest.warns(UserWarning, match="usable"):
        assert lf.suggest_lr(lrs[:12], [math.nan] * 12) is None


def test_smoothing_is_a_bias_corrected_ema():
    values = [2.0 + math.sin(i) + 0.01 * i for i in range(20)]
    for smooth in (0.0, 0.7, 0.98):
        model, optimizer, loader = probe_setup()
        result = lf.lr_find(
            model, optimizer, scripted_loss(values), loader, num_iter=20, smooth=smooth,
            diverge=1e9,
        )  # fmt: skip
        assert result.losses == pytest.approx(values, rel=1e-6)
        assert result.smoothed[0] == result.losses[0]
        avg, ref = 0.0, []
        for i, v in enumerate(result.losses):
            avg = smooth * avg + (1 - smooth) * v
            ref.append(avg / (1 - smooth ** (i + 1)))
        assert result.smoothed == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_stops_at_once(bad):
    values = [2.0 - 0.1 * i for i in range(15)]
    values[12] = bad
    model, optimizer, loader = probe_setup()
    result = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=30)
    assert result.stop_reason == "non-finite loss"
    assert len(result.lrs) == len(result.losses) == len(result.smoothed) == 13
    assert not math.isfinite(result.losses[-1]) and math.isnan(result.smoothed[-1])
    assert all(math.isfinite(s) for s in result.smoothed[:-1])
    assert result.suggestion is None or math.isfinite(result.suggestion)
    assert result.suggestion in result.lrs


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_divergence_stops_but_not_before_min_iter():
    values = [1.0] * 12 + [100.0] * 20
    model, optimizer, loader = probe_setup()
    r = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=30)
    assert r.stop_reason == "diverged" and len(r.lrs) == 13
    values = [1.0] * 3 + [100.0] * 27
    model, optimizer, loader = probe_setup()
    r = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=30)
    assert r.stop_reason == "diverged" and len(r.lrs) == 11, "first check at step 10"
    r = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=30, diverge=1e9)
    assert r.stop_reason == "completed"


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
@pytest.mark.parametrize("values", [[1.0] * 12 + [1e3] * 8, [1.0] * 5 + [math.nan] * 15,
                                    [1.0] * 19 + [math.nan]])
def test_late_loss_reads_give_the_same_result(monkeypatch, values):
    """On CUDA losses are read one step late; the recorded sweep must not change, even when only the
    last step, read after the loop, stops it."""
    model, optimizer, loader = probe_setup()
    now = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=20)
    monkeypatch.setitem(lf._READ_LAG, "cpu", 1)
    late = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=20)
    assert now.stop_reason != "completed"
    assert (late.lrs, late.stop_reason) == (now.lrs, now.stop_reason)
    assert late.losses == pytest.approx(now.losses, nan_ok=True)


def test_one_shot_iterator_loader_is_an_error_that_still_restores():
    model, optimizer, _ = probe_setup()
    before = snapshot(model, optimizer)
    batches = iter([(torch.ones(2, 1), torch.zeros(2, 1))] * 3)
    with pytest.raises(ValueError) as info:
        lf.lr_find(model, optimizer, F.mse_loss, batches, num_iter=10)
    assert str(info.value) == ("loader is empty on re-iteration (a one-shot iterator?): lr_find needs a "
                               "loader it can iterate again when num_iter * accum_steps exceeds its length")
    assert_restored(before, model, optimizer)
    with pytest.raises(ValueError) as info:
        lf.lr_find(model, optimizer, F.mse_loss, [], num_iter=10)
    assert str(info.value) == "loader is empty: it yielded no batches"


def frozen_model():
    model = nn.Linear(1, 1)
    model.requires_grad_(False)
    return model


BAD_INPUTS = [
    ({"start_lr": 0.0}, "start_lr"),
    ({"start_lr": -1e-3}, "start_lr"),
    ({"start_lr": 1.0, "end_lr": 0.5}, "start_lr"),
    ({"start_lr": 1.0, "end_lr": 1.0}, "start_lr"),
    ({"end_lr": math.inf}, "start_lr"),
    ({"num_iter": 5}, "num_iter"),
    ({"accum_steps": 0}, "accum_steps"),
    ({"smooth": 1.0}, "smooth"),
    ({"smooth": -0.1}, "smooth"),
    ({"diverge": 1.0}, "diverge"),
    ({"method": "fastest"}, "method"),
    ({"schedule": None}, "schedule"),
    ({"min_iter_before_stop": -1}, "min_iter_before_stop"),
    ({"step_mode": "cubic"}, "^step_mode must be 'exp' or 'linear', got 'cubic'$"),
    ({"optimizer_kind": "adam"},
     "^optimizer_kind must be None, 'sgd' or 'adaptive', got 'adam'$"),
    ({"loader": []}, "loader"),
    ({"model": "frozen"}, "^model has no trainable parameters$"),
    ({"optimizer": "empty"}, "^optimizer has no parameters$"),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_INPUTS, ids=[n.strip("^$") for _, n in BAD_INPUTS])
def test_bad_input_names_the_parameter(kwargs, name):
    model, optimizer, loader = probe_setup()
    kwargs = dict(kwargs)
    if kwargs.get("model") == "frozen":
        model = kwargs["model"] = frozen_model()
    if kwargs.get("optimizer") == "empty":
        kwargs["optimizer"] = torch.optim.SGD([{"params": []}], lr=0.1)
    args = {"model": model, "optimizer": optimizer, "loss_fn": F.mse_loss, "loader": loader}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        lf.lr_find(**args)


def test_suggest_lr_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        lf.suggest_lr([1e-3] * 20, [1.0] * 20, "best")


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    model, optimizer, loader = probe_setup()
    values = [2.0 - 0.05 * i for i in range(25)] + [math.nan]
    result = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=30)
    path = tmp_path / "lr_find.png"
    fig = lf.plot_lr_find(result)
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.axes and fig.axes[0].get_xscale() == "log"
    assert lf.plot_lr_find(result, ax=fig.axes[0]) is fig


def test_module_works_when_copied_alone(tmp_path):
    shutil.copy(ROOT / "lr_find.py", tmp_path / "lr_find.py")
    (tmp_path / "run.py").write_text(
        textwrap.dedent(
            f"""
            import sys
            import torch
            import lr_find
            assert lr_find.__file__.startswith({str(tmp_path)!r}), lr_find.__file__
            assert not any(p and {str(ROOT)!r} == p.rstrip("/") for p in sys.path), sys.path
            assert "matplotlib" not in sys.modules and "tensorboard" not in sys.modules
            torch.manual_seed(0)
            x = torch.randn(256, 8)
            y = x @ torch.randn(8, 1)
            loader = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            res = lr_find.lr_find(model, opt, torch.nn.functional.mse_loss, loader)
            print("suggestion", res.suggestion, res.stop_reason)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-E", "run.py"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[0] == "suggestion" and float(words[1]) > 0


def curve_lrs(n: int) -> list[float]:
    return [10 ** (-5 + 6 * i / (n - 1)) for i in range(n)]


def bowl(lr: float, lr_star: float = 1e-2) -> float:
    """Flat, a one-decade fall, a bottom 1.07 decades above lr_star, then a steep rise."""
    return synthetic_curve(lr_star)(lr)


def test_minimum_finds_the_bottom_between_points_whatever_the_density():
    bottom = 1e-2 * 10**1.07
    picks = {n: lf.suggest_lr(curve_lrs(n), [bowl(lr) for lr in curve_lrs(n)], "minimum")
             for n in (40, 50, 100)}
    assert all(bottom / 1.4 <= v <= bottom * 1.4 for v in picks.values()), picks
    assert max(picks.values()) / min(picks.values()) < 1.15, "the parabola, not the grid, places it"
    lrs = curve_lrs(50)
    losses = [bowl(lr) for lr in lrs]
    minimum = lf.suggest_lr(lrs, losses, "minimum")
    assert lf.suggest_lr(lrs, losses, "min/10") == pytest.approx(minimum / 10)
    assert lf.suggest_lr(lrs, losses, "min/3") == pytest.approx(minimum / 3)
    with pytest.warns(UserWarning, match="still falling"):
        assert lf.suggest_lr(lrs[:30], losses[:30], "minimum") is None
    exploded = losses[:30] + [math.inf]
    assert lf.suggest_lr(lrs[:31], exploded, "minimum") == lrs[29], "a blow-up ends the fall"


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.AdamW(params, lr=1e-3),
], ids=["sgd", "adamw"])
def test_each_schedule_gets_its_own_rule(make_optimizer):
    model = nn.Linear(1, 1)
    optimizer = make_optimizer(model.parameters())
    loader = [(torch.ones(2, 1), torch.zeros(2, 1))]
    loss_fn = scripted_loss(bowl, optimizer)
    kind = "adaptive" if isinstance(optimizer, torch.optim.AdamW) else "sgd"
    rules = lf.DEFAULT_RULES[kind]
    result = lf.lr_find(model, optimizer, loss_fn, loader, start_lr=1e-5, end_lr=10.0, diverge=1e9)
    assert result.optimizer_kind == kind and result.schedule == "onecycle"
    assert (result.suggestion, result.method) == (result.suggest(rules["peak"]), rules["peak"])
    for schedule in ("constant", "step", "cosine", "warmup"):
        assert result.for_schedule(schedule) == result.suggest(rules["base"])
    assert result.for_schedule("onecycle") == result.suggestion
    assert rules["peak"] != rules["base"] and result.for_schedule("cosine") != result.suggestion
    other = lf.lr_find(model, optimizer, loss_fn, loader, start_lr=1e-5, end_lr=10.0, diverge=1e9,
                       schedule="cosine", method="minimum")
    assert (other.suggestion, other.method) == (result.suggest("minimum"), "minimum")
    assert other.suggestions["peak"] == result.suggestions["peak"]


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_raw_blow_up_stops_the_sweep_as_diverged(scale):
    """The moving average lags: here it never reaches 4x its best, but the raw losses explode.
    The rule is relative: a loss ten times smaller behaves the same."""
    falling = [(2.3 - 0.05 * i) * scale for i in range(26)]
    model, optimizer, loader = probe_setup()
    blown = lf.lr_find(model, optimizer, scripted_loss(falling + [v * scale for v in [1.5, 8.0, 9.0, 1.2]]
                                                       + [1.1 * scale] * 10), loader, num_iter=40)
    assert blown.stop_reason == "diverged" and blown.losses[-2:] == pytest.approx([8.0 * scale, 9.0 * scale])
    assert max(blown.smoothed) < 4 * min(blown.smoothed), "the old rule alone would not have stopped"
    spike = lf.lr_find(model, optimizer, scripted_loss(falling + [v * scale for v in [1.0, 9.0, 1.0]]
                                                       + [1.0 * scale] * 11), loader, num_iter=40)
    assert spike.stop_reason == "completed", "one spike is noise, not a blow-up"


def test_plot_draws_the_curve_the_rules_read_and_marks_every_schedule():
    pytest.importorskip("matplotlib")
    model, optimizer, loader = probe_setup()
    result = lf.lr_find(model, optimizer, scripted_loss(bowl, optimizer), loader, start_lr=1e-5,
                        diverge=1e9, schedule="cosine")
    ax = lf.plot_lr_find(result, schedules=NAMES).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    curve = lf.suggestion_curve(result.lrs, result.losses)
    drawn = lines["smoothed: what the rules read"]
    assert list(drawn.get_xdata()) == curve.lrs and list(drawn.get_ydata()) == curve.loss
    marks = {label: line for label, line in lines.items() if label.startswith(("onecycle", "constant"))}
    assert len(marks) == 2
    chosen = [line for line in marks.values() if line.get_color() == "tab:red"]
    assert len(chosen) == 1 and chosen[0].get_xdata()[0] == result.for_schedule("cosine")
    assert any(line.get_xdata()[0] == result.for_schedule("onecycle") for line in marks.values())


# --- the stop rule, the sweep loop and the restore, at their edges --------------------------------


def test_defaults_sweep_50_steps_from_1e_7_to_10_and_stop_above_4x():
    model, optimizer, loader = probe_setup()
    flat = lf.lr_find(model, optimizer, scripted_loss([1.0] * 50), loader)
    assert len(flat.lrs) == 50 and (flat.lrs[0], flat.lrs[-1]) == (1e-7, 10.0)
    assert flat.stop_reason == "completed"
    raised = lf.lr_find(model, optimizer, scripted_loss([1.0] * 20 + [4.5] * 30), loader)
    assert raised.stop_reason == "diverged" and len(raised.lrs) == 22, "two raw losses above 4x"


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_stop_rule_edges():
    """Strictly above diverge x the yardstick; a yardstick of zero stops nothing; diverge may be
    any value above 1 and min_iter_before_stop may be 0."""
    model, optimizer, loader = probe_setup()

    def sweep(values, **kwargs):
        return lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=len(values), **kwargs)

    assert sweep([1.0] * 12 + [4.0] * 8, smooth=0.0).stop_reason == "completed", "exactly 4x is not above"
    assert sweep([0.0] * 12 + [1.0] * 8).stop_reason == "completed"
    early = sweep([1.0, 1.0] + [100.0] * 10, min_iter_before_stop=0)
    assert (early.stop_reason, len(early.lrs)) == ("diverged", 3)
    assert sweep([1.0] * 12 + [1.6] * 8, diverge=1.5).stop_reason == "diverged"


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_raw_yardstick_is_the_lowest_running_median_of_five():
    """A loss falling by 0.8 a step has a median of five two steps back: a jump to 4.6x that
    median is a blow-up, one to 3.6x is not (a median of six, or of all, or a lower quantile of
    five would judge these differently)."""
    falling = [0.8**i for i in range(20)]
    model, optimizer, loader = probe_setup()
    for jump, reason in ((4.6, "diverged"), (3.6, "completed")):
        values = falling + [jump * falling[-3]] * 2 + [falling[-1]] * 6
        result = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=len(values))
        assert result.stop_reason == reason, jump


def test_progress_sees_each_step_index_lr_and_loss():
    values = [2.0 - 0.01 * i for i in range(12)]
    model, optimizer, loader = probe_setup()
    seen = []
    result = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=12, diverge=1e9,
                        progress=lambda *args: seen.append(args))
    assert seen == list(zip(range(12), result.lrs, result.losses, strict=True))
    assert result.losses == pytest.approx(values)


def ops_per_step(run) -> collections.Counter:
    """Marginal ops per step between run(10) and run(30): what is paid once cancels."""
    counts = []
    for steps in (10, 30):
        with Ops() as ops:
            run(steps)
        counts.append(ops.counts)
    return collections.Counter({op: (counts[1][op] - counts[0][op]) / 20 for op in counts[0] | counts[1]})


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_a_sweep_step_adds_three_ops_to_a_bare_step(accum_steps):
    """A GPU launches a kernel per op, and a small model's step is launch-bound: beyond a bare step
    (forward, loss, backward, optimizer step) a sweep's runs only the training loss detached, stacked
    with the curve's value and copied to the host buffer it is read from; each further micro-batch
    adds its detached loss to the window's. No division when there is nothing to divide."""
    def sweep(steps: int) -> None:
        model, batches = make_convnet(), make_batches(accum_steps * steps)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        result = lf.lr_find(model, optimizer, F.cross_entropy, batches, start_lr=1e-5, end_lr=1e-3,
                            num_iter=steps, diverge=1e9, accum_steps=accum_steps)
        assert len(result.lrs) == steps, result.stop_reason

    def bare(steps: int) -> None:
        model, batches = make_convnet(), iter(make_batches(accum_steps * steps))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        for _ in range(steps):
            for _ in range(accum_steps):
                inputs, targets = next(batches)
                loss = F.cross_entropy(model(inputs), targets)
                (loss / accum_steps if accum_steps > 1 else loss).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    ops, plain = ops_per_step(sweep), ops_per_step(bare)
    added = {op: ops[op] - plain[op] for op in sorted(ops | plain) if ops[op] != plain[op]}
    print(f"lr_find sweep, accum_steps {accum_steps}: {ops.total():.2f} ops per step, bare "
          f"{plain.total():.2f}, added {added}")
    assert plain.total() > 30  # forward, backward and the step are counted
    assert ops.total() - plain.total() <= 3 + 2 * (accum_steps - 1), added


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_progress_sees_each_step_before_the_next():
    """Off CUDA a loss is read as soon as its step ends: progress(i) runs before step i + 1's loss."""
    seen = []

    def loss_fn(out, y):
        seen.append("loss")
        return F.mse_loss(out, y)

    model, optimizer, loader = probe_setup()
    lf.lr_find(model, optimizer, loss_fn, loader, num_iter=10, start_lr=1e-4, end_lr=1e-2, diverge=1e9,
               progress=lambda i, lr, loss: seen.append(i))
    assert seen == [x for i in range(10) for x in ("loss", i)]


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_late_reads_of_a_sweep_that_completes(monkeypatch):
    """With losses read one step late (CUDA), the last step is read after the loop."""
    values, order = [2.0 - 0.01 * i for i in range(12)], []
    monkeypatch.setitem(lf._READ_LAG, "cpu", 1)
    model, optimizer, loader = probe_setup()
    scripted = scripted_loss(values)

    def loss_fn(out, y):
        order.append("loss")
        return scripted(out, y)

    late = lf.lr_find(model, optimizer, loss_fn, loader, num_iter=12, diverge=1e9,
                      progress=lambda i, lr, loss: order.append(i))
    assert late.stop_reason == "completed" and late.losses == pytest.approx(values)
    assert order[:4] == ["loss", "loss", 0, "loss"] and order[-2:] == [10, 11]  # the patch is what ran
    monkeypatch.undo()
    assert lf._READ_LAG == {"cuda": 1}  # and off CUDA none: see test_progress_sees_each_step_before_the_next


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_a_snapshot_takes_no_accelerator_memory():
    """What a sweep keeps to put back is kept on the CPU: when its first step's loss is computed, the GPU
    holds the weights (4 MiB) and Adam's moments (8 MiB) once, as before the sweep, and no copy of them."""
    model = nn.Linear(1024, 1024).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.ones(2, 1024, device="cuda"), torch.zeros(2, 1024, device="cuda"))
    F.mse_loss(model(batch[0]), batch[1]).backward()  # cuBLAS sets up for this shape; the step, the moments
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before, grown = torch.cuda.memory_allocated(), []

    def loss_fn(out, y):
        grown.append(torch.cuda.memory_allocated() - before)
        return F.mse_loss(out, y)

    lf.lr_find(model, optimizer, loss_fn, [batch], num_iter=10, end_lr=1e-2)
    assert 0 < grown[0] < 2**20, grown  # the first step's output alone


def test_optimizer_at_lr_zero_sweeps_every_group_at_the_sweep_lr():
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.0)
    seen = []

    def loss_fn(out, y):
        seen.append([g["lr"] for g in optimizer.param_groups])
        return F.mse_loss(out, y)

    result = lf.lr_find(model, optimizer, loss_fn, [(torch.ones(2, 1), torch.zeros(2, 1))], num_iter=10,
                        end_lr=1e-2)
    assert seen == [[lr, lr] for lr in result.lrs] and (result.lrs[0], result.lrs[-1]) == (1e-7, 1e-2)


def test_tensor_lrs_of_two_groups_keep_their_ratio():
    model = nn.Linear(1, 1)
    lrs = torch.tensor(0.01), torch.tensor(0.03)
    optimizer = torch.optim.Adam([{"params": [model.weight], "lr": lrs[0]},
                                  {"params": [model.bias], "lr": lrs[1]}], foreach=False)
    seen = []

    def loss_fn(out, y):
        seen.append([float(g["lr"]) for g in optimizer.param_groups])
        return F.mse_loss(out, y)

    result = lf.lr_find(model, optimizer, loss_fn, [(torch.ones(2, 1), torch.zeros(2, 1))], num_iter=10,
                        end_lr=1e-2, diverge=1e9)
    assert seen == [pytest.approx([lr, 3 * lr], rel=1e-6) for lr in result.lrs]
    assert [g["lr"] for g in optimizer.param_groups] == list(lrs)


def test_a_parameter_without_a_gradient_in_a_step_is_left_alone():
    """Gradients are set to None between steps (as train.py does), so a parameter that a step does
    not use gets no momentum or weight decay update in it."""
    model = nn.Linear(1, 1)
    extra = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=0.1, momentum=0.9, weight_decay=0.1)
    calls, after = [], []
    optimizer.register_step_post_hook(lambda *_: after.append(extra.detach().clone()))

    def loss_fn(out, y):
        calls.append(1)
        return F.mse_loss(out, y) + (extra.sum() if len(calls) == 1 else 0)

    lf.lr_find(model, optimizer, loss_fn, [(torch.ones(2, 1), torch.zeros(2, 1))], num_iter=10,
               end_lr=1e-2, diverge=1e9)
    assert not torch.equal(after[0], torch.ones(1)) and all(torch.equal(a, after[0]) for a in after)


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_autocast_dtype_and_scaler_are_used():
    model, optimizer, loader = probe_setup()
    dtypes, scaled = [], []

    class CountingScaler(torch.amp.GradScaler):
        def step(self, optimizer, *args, **kwargs):
            scaled.append(1)
            return super().step(optimizer, *args, **kwargs)

    def loss_fn(out, y):
        dtypes.append(out.dtype)
        return F.mse_loss(out.float(), y)

    lf.lr_find(model, optimizer, loss_fn, loader, num_iter=10, end_lr=1e-2,
               autocast_dtype=torch.float16, scaler=CountingScaler("cpu"))
    assert dtypes == [torch.float16] * 10 and len(scaled) == 10


def test_buffers_a_forward_rebinds_are_put_back():
    """`self.seen = self.seen + 1` in a forward re-binds the buffer; the restore binds the old one."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen = self.seen + 1
            return self.linear(x)

    model = Counting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = model.seen
    lf.lr_find(model, optimizer, F.mse_loss, [(torch.ones(2, 1), torch.zeros(2, 1))], num_iter=10,
               end_lr=1e-2)
    assert model.seen is seen and seen.item() == 0 and dict(model.named_buffers()) == {"seen": seen}


def test_tensors_inside_tuples_keep_their_identity():
    """Adam's betas may be a tuple of tensors: whoever holds them still sees the same tensors."""
    model = nn.Linear(1, 1)
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=betas)
    lf.lr_find(model, optimizer, F.mse_loss, [(torch.ones(2, 1), torch.zeros(2, 1))], num_iter=10,
               end_lr=1e-2)
    kept = optimizer.param_groups[0]["betas"]
    assert type(kept) is tuple and kept[0] is betas[0] and kept[1] is betas[1]


def test_an_explicit_device_is_taken():
    model, optimizer, loader = probe_setup()
    result = lf.lr_find(model, optimizer, scripted_loss(bowl, optimizer), loader, start_lr=1e-5,
                        diverge=1e9, device="cpu")
    assert len(result.lrs) == 50 and result.suggestion is not None


def test_a_nan_before_the_last_finite_point_is_no_blow_up():
    """Only a non-finite loss past the last finite one means the sweep ended exploding."""
    lrs = [10 ** (-4 + 4 * i / 39) for i in range(40)]
    losses = [2.0 - i / 40 for i in range(40)]
    losses[38] = math.nan
    with pytest.warns(UserWarning, match="still falling at the end"):
        assert lf.suggest_lr(lrs, losses) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lf.suggest_lr(lrs[:38] + lrs[39:] + [100.0], losses[:38] + losses[39:] + [math.nan]) == lrs[39]


def test_minimum_on_a_flat_bottom_is_the_lowest_point():
    curve = lf.SuggestionCurve([1e-3, 1e-2, 1e-1, 1.0, 10.0], [2.0, 1.0, 1.0, 1.0, 2.0], 2, 2, False, None)
    assert lf.minimum(curve) == pytest.approx(0.1)


def test_why_no_suggestion_names_the_cause():
    lrs = [10.0 ** (k / 4) for k in range(-20, 1)]
    for losses, why in (([1.0] * 4, "only 4 usable points"),
                        ([1.0 + 0.01 * i for i in range(21)], "the loss never decreases"),
                        ([2.0 - 0.01 * i for i in range(21)],
                         "the loss was still falling at the end of the sweep (raise end_lr)")):
        with pytest.warns(UserWarning) as caught:
            assert lf.suggest_lr(lrs[: len(losses)], losses) is None
        assert [str(w.message) for w in caught] == [f"lr_find: no suggestion, {why}"]


def test_batches_go_to_the_device_whole():
    """Nested lists, tuples and dicts of tensors move; anything else passes through."""
    t = torch.ones(2)
    moved = lf._to_device({"x": [t, (t, 3)], "name": "keep"}, torch.device("meta"))
    assert moved.keys() == {"x", "name"} and moved["name"] == "keep"
    assert type(moved["x"]) is list and type(moved["x"][1]) is tuple and moved["x"][1][1] == 3
    assert moved["x"][0].is_meta and moved["x"][1][0].is_meta and not t.is_meta


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_pairs_of_tensors_on_the_device_are_taken_as_they_come(monkeypatch):
    """python lr_find.py's batches, (inputs, targets) pairs of tensors already on the device: the first
    decides, once, that no batch is moved; after any other first batch, each batch is."""
    real, moved = lf._to_device, []
    monkeypatch.setattr(lf, "_to_device", lambda batch, device: moved.append(batch) or real(batch, device))
    model, optimizer, loader = probe_setup()
    stream = (batch for _ in range(12) for batch in loader)
    lf.lr_find(model, optimizer, F.mse_loss, stream, num_iter=12, end_lr=1e-2, diverge=1e9)
    assert moved == []
    dicts = [{"x": x, "y": y} for x, y in loader]
    lf.lr_find(model, optimizer, None, dicts, batch_loss=lambda m, b: F.mse_loss(m(b["x"]), b["y"]),
               num_iter=10, end_lr=1e-2, diverge=1e9)
    assert sum(isinstance(batch, dict) for batch in moved) == 10, "each step's batch, moved whole"


# --- results, warnings and messages ---------------------------------------------------------------


def test_result_api_defaults_and_messages():
    model, optimizer, loader = probe_setup()
    result = lf.lr_find(model, optimizer, scripted_loss(bowl, optimizer), loader, start_lr=1e-5,
                        diverge=1e9)
    assert result.suggest() == result.suggest("minimum") is not None
    assert result.for_schedule("linear") == result.for_schedule("cosine"), "one's own schedule: its start"


def test_no_suggestion_warning_points_at_the_caller():
    model, optimizer, loader = probe_setup()
    with pytest.warns(UserWarning) as caught:
        lf.lr_find(model, optimizer, scripted_loss([2.0 - 0.01 * i for i in range(12)]), loader,
                   num_iter=12, diverge=1e9)
    assert [str(w.message) for w in caught] == [
        "lr_find: no suggestion, the loss was still falling at the end of the sweep (raise end_lr)"]
    assert caught[0].filename == __file__
    stuck = lf.LRFindResult(**{**vars(bowl_sweep()), "why_none": "every step was skipped"})
    with pytest.warns(UserWarning) as caught:
        stuck.suggest()
    assert caught[0].filename == __file__


def test_the_loader_warning_points_at_the_caller():
    data = torch.utils.data.TensorDataset(torch.ones(4, 1), torch.zeros(4, 1))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return self

        def __next__(self):
            return data[0]

    model, optimizer, _ = probe_setup()
    with pytest.warns(UserWarning, match="dataset is an iterator") as caught:
        lf.lr_find(model, optimizer, F.mse_loss, torch.utils.data.DataLoader(Stream(), batch_size=2),
                   num_iter=10, end_lr=1e-2, diverge=1e9)
    assert caught[0].filename == __file__


def test_a_sweep_that_never_stepped_suggests_nothing_by_any_rule():
    """Its losses alone would give a suggestion: the reason it gave none stands for every rule."""
    result = bowl_sweep()
    assert all(result.suggest(m) is not None for m in lf.METHODS)
    stuck = lf.LRFindResult(**{**vars(result), "why_none": "every step was skipped (by a GradScaler)"})
    for method in lf.METHODS:
        with pytest.warns(UserWarning) as caught:
            assert stuck.suggest(method) is None
        assert [str(w.message) for w in caught] == [f"lr_find: no suggestion, {stuck.why_none}"]
    with pytest.raises(ValueError, match="method must be one of"):
        stuck.suggest("best")
    rebuilt = lf._result(result.lrs, result.losses, "cosine", None, "sgd", smoothed=result.smoothed,
                         stop_reason="completed")
    assert rebuilt.optimizer_kind_from == "" and rebuilt.group_lrs == [[lr] for lr in result.lrs]


def test_the_last_rate_is_the_end_rate_exactly():
    """1e-5 * (1.0 / 1e-5) and 0.03 + (0.3 - 0.03) are not 1.0 and 0.3 in floating point."""
    model, optimizer, loader = linear_setup()
    exp = lf.lr_find(model, optimizer, F.mse_loss, loader, start_lr=1e-5, end_lr=1.0, num_iter=10,
                     diverge=1e9)
    linear = lf.lr_find(model, optimizer, F.mse_loss, loader, start_lr=[0.03, 0.03], end_lr=[0.3, 0.3],
                        num_iter=10, diverge=1e9, step_mode="linear")
    assert exp.lrs[-1] == 1.0 and linear.group_lrs[-1] == [0.3, 0.3]


# --- the curve the rules read, and the rules, on hand-made curves ---------------------------------


def reference_curve(lrs: list[float], losses: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """suggestion_curve's smoothing as docs/lr_find.md states it, in numpy: a running median of five
    (of three, then the point itself, towards the ends), then a Gaussian in log10(lr) with sigma =
    max(0.25 decades, 1.5 x the median spacing), cut at four sigmas; slopes are central differences
    (one-sided at the ends) per decade."""
    x, raw = np.log10(lrs), np.asarray(losses)
    n = len(x)
    y = np.array([raw[0], np.median(raw[:3]), *[np.median(raw[i - 2:i + 3]) for i in range(2, n - 2)],
                  np.median(raw[-3:]), raw[-1]])
    sigma = max(0.25, 1.5 * np.median(np.diff(x)))
    near = np.abs(x[:, None] - x[None, :]) <= 4 * sigma
    w = np.exp(-0.5 * ((x[None, :] - x[:, None]) / sigma) ** 2) * near
    loss = (w @ y) / w.sum(axis=1)
    a, b = np.maximum(np.arange(n) - 1, 0), np.minimum(np.arange(n) + 1, n - 1)
    slope = (loss[b] - loss[a]) / (x[b] - x[a])
    return loss, slope


@pytest.mark.parametrize("spacing", ["dense", "coarse"])
def test_suggestion_curve_matches_its_description(spacing):
    """Dense: 60 points 0.07 decades apart (sigma 0.25 decades). Coarse: 30 points, 12 gaps of 0.1
    and 17 of 0.29 decades (sigma 1.5 x 0.29). Distinct noisy losses, so every window shows. No two
    points lie exactly 4 sigmas apart, where rounding alone decides whether the window holds them."""
    rng = np.random.default_rng(0)
    if spacing == "dense":
        x = -5 + 0.07 * np.arange(60)
    else:
        gaps = [0.29, 0.1] * 12 + [0.29] * 5
        x = -5 + np.concatenate([[0.0], np.cumsum(gaps)])
    lrs = (10**x).tolist()
    losses = (2 - np.tanh(2 * (x - x.mean())) + 0.3 * rng.standard_normal(len(x))).tolist()
    curve = lf.suggestion_curve(lrs, losses)
    loss, slope = reference_curve(lrs, losses)
    assert curve.lrs == lrs and curve.problem is None and not curve.exploded
    assert curve.loss == pytest.approx(loss.tolist(), rel=1e-12)
    assert curve.first == max(2, len(lrs) // 10)
    assert curve.lowest == curve.first + int(np.argmin(loss[curve.first:]))


def test_suggestion_curve_inputs_and_edges():
    lrs, losses = curve_lrs(20), [bowl(lr) for lr in curve_lrs(20)]
    with pytest.raises(ValueError):
        lf.suggestion_curve(lrs, losses[:-1])  # one loss per lr
    padded = lf.suggestion_curve([0.0, *lrs, math.inf], [1.0, *losses, 1.0])
    assert padded == lf.suggestion_curve(lrs, losses), "lrs of 0 or inf are not points"
    assert lf.suggestion_curve(lrs[:7], losses[:7]).problem is None, "7 points are the fewest"
    assert lf.suggestion_curve(lrs[:6], losses[:6]) == lf.SuggestionCurve(
        lrs[:6], losses[:6], 2, 2, False, "only 6 usable points")
    assert lf.suggestion_curve(lrs, sorted(losses)).problem == "the loss never decreases"
    twice = lf.suggestion_curve([lrs[0], *lrs], [losses[0], *losses])  # a repeated lr is no division by 0
    assert twice.problem is None and twice.lrs[0] == twice.lrs[1]


def test_only_a_non_finite_loss_past_the_last_finite_one_is_a_blow_up():
    lrs = curve_lrs(40)
    falling = [3.0 - i / 40 for i in range(40)]
    with pytest.warns(UserWarning, match="still falling"):
        assert lf.suggest_lr(lrs, falling[:20] + [math.nan] + falling[21:]) is None
    assert not lf.suggestion_curve(lrs, [math.nan, *falling[1:]]).exploded
    assert lf.suggestion_curve(lrs, [*falling[:-1], math.nan]).exploded
    assert not lf.suggestion_curve([*lrs, lrs[-1]], [*falling, math.nan]).exploded, "at the same lr: no"


def hand_curve(loss: list[float], first: int = 2, spacing: float = 0.1, exploded: bool = False,
               x: list[float] | None = None) -> lf.SuggestionCurve:
    """A curve the rules can read, built by hand: these losses, as they are, at log10(lr) = x."""
    x = x or [-4 + spacing * i for i in range(len(loss))]
    lowest = min(range(first, len(loss)), key=loss.__getitem__)
    return lf.SuggestionCurve([10**v for v in x], list(loss), first, lowest, exploded, None)


def test_minimum_is_the_vertex_of_the_parabola_through_the_lowest_point_and_its_neighbours():
    x = [-4.0, -3.8, -3.5, -3.45, -3.3, -3.0, -2.9, -2.5]  # uneven on purpose
    bottom = -3.41
    curve = hand_curve([(v - bottom) ** 2 + 1 for v in x], x=x)
    assert curve.lowest == 3
    assert lf.minimum(curve) == pytest.approx(10**bottom, rel=1e-9)
    assert lf.RULES["min/3"](curve) == pytest.approx(10**bottom / 3, rel=1e-9)


# --- saving and drawing a sweep -------------------------------------------------------------------


def bowl_sweep(schedule: str = "cosine") -> lf.LRFindResult:
    """A sweep down a bowl from 1e-5 that blows up at its end (a non-finite last loss)."""
    model, optimizer, loader = probe_setup()
    lrs = [10 ** (-5 + 6 * i / 49) for i in range(50)]
    values = [bowl(lr) for lr in lrs[:49]] + [math.inf]
    return lf.lr_find(model, optimizer, scripted_loss(values), loader, start_lr=1e-5, end_lr=10.0,
                      num_iter=50, diverge=1e9, schedule=schedule)


def test_save_sweep_writes_the_record_the_plot_and_one_tensorboard_image(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = bowl_sweep()
    out = tmp_path / "new" / "dir"
    for _ in range(2):  # a second save replaces the first
        wrote = lf.save_sweep(result, {"seed": 3}, out, schedules=NAMES)
    assert wrote == [out / "lr_find.json", out / "lr_find.png"]
    assert sorted(p.name for p in out.iterdir()) == ["lr_find", "lr_find.json", "lr_find.png"]
    record = json.loads((out / "lr_find.json").read_text())
    peak, base = result.suggestions["peak"], result.suggestions["base"]
    assert record == {
        "lrs": result.lrs, "losses": [*result.losses[:-1], None], "smoothed": [*result.smoothed[:-1], None],
        "train_losses": None, "group_lrs": [[lr] for lr in result.lrs],
        "stop_reason": "non-finite loss", "schedule": "cosine", "suggestion": base[0], "method": "min/3",
        "why_none": None, "note": None, "optimizer_kind": "sgd",
        "optimizer_kind_from": "SGD: no betas, eps or etas", "config": {"seed": 3},
        "sweep": lf.sweep_id(result.lrs, [*result.losses[:-1], None]),
        "suggestions": {"peak": {"lr": peak[0], "method": "minimum", "schedules": ["onecycle"],
                                 "group_lrs": [peak[0]]},
                        "base": {"lr": base[0], "method": "min/3",
                                 "schedules": ["constant", "step", "cosine", "warmup"],
                                 "group_lrs": [base[0]]}}}
    png = (out / "lr_find.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (840, 540)
    events = EventAccumulator(str(out / "lr_find"), size_guidance={"images": 0})
    events.Reload()
    assert events.Tags()["scalars"] == [] and events.Tags()["images"] == ["lr_find"]
    images = events.Images("lr_find")
    assert [(i.step, i.width, i.height) for i in images] == [(0, 840, 540)]
    drawn = np.asarray(Image.open(io.BytesIO(images[0].encoded_image_string)))
    assert np.array_equal(drawn, np.asarray(Image.open(out / "lr_find.png").convert("RGB")))
    assert (out / "lr_find.json").read_text() == json.dumps(record, indent=2)  # for people to read


@pytest.mark.parametrize("missing", ["matplotlib", "torch.utils.tensorboard"])
def test_save_sweep_without_matplotlib_or_tensorboard_says_what_to_install(tmp_path, monkeypatch, missing):
    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if missing == "matplotlib" and name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
        if name == missing:  # what torch says when tensorboard is not installed
            raise ImportError("TensorBoard logging requires TensorBoard version 1.15 or above")
        return real_import(name, *args, **kwargs)

    result = bowl_sweep()
    if missing != "matplotlib":
        pytest.importorskip("matplotlib")
    monkeypatch.setattr(builtins, "__import__", without)
    wrote = lf.save_sweep(result, {}, tmp_path)
    if missing == "matplotlib":
        assert wrote == [tmp_path / "lr_find.json", "no plot (pip install matplotlib)"]
    else:
        assert wrote == [tmp_path / "lr_find.json", tmp_path / "lr_find.png",
                         "no TensorBoard image (pip install tensorboard)"]


def test_a_failed_save_names_the_file_and_leaves_no_temporary_file(tmp_path):
    (tmp_path / "lr_find.json").mkdir()  # a folder where the file should go
    with pytest.raises(OSError) as info:
        lf.save_sweep(bowl_sweep(), {}, tmp_path)
    assert info.value.filename == str(tmp_path / "lr_find.json") and info.value.strerror
    assert info.value.errno == errno.EISDIR
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr_find.json", "lr_find.png"]  # the picture first


def test_plot_looks_as_described():
    """Raw loss faint, the smoothed curve solid, the chosen schedule's suggestion red and solid,
    the other grey and dashed; the y range holds the descent (lowest raw loss to the first, 8%
    margins), not the blow-up; 7 x 4.5 inches at 120 dpi."""
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba
    from matplotlib.font_manager import FontProperties

    model, optimizer, loader = probe_setup()
    lrs = [10 ** (-5 + 5 * i / 59) for i in range(60)]
    values = [3.0 - 2.0 * i / 39 for i in range(40)] + [1.0] * 10 + [1.0 + 10.0 * i for i in range(10)]
    result = lf.lr_find(model, optimizer, scripted_loss(values), loader, start_lr=lrs[0], end_lr=lrs[-1],
                        num_iter=60, diverge=1e9, schedule="cosine")
    fig = lf.plot_lr_find(result, schedules=NAMES)
    assert tuple(fig.get_size_inches()) == (7.0, 4.5) and fig.dpi == 120
    assert type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"
    ax = fig.axes[0]
    raw, smoothed, *marks = ax.get_lines()
    assert (raw.get_label(), raw.get_alpha(), raw.get_linewidth()) == ("loss per step", 0.3, 1)
    assert list(raw.get_xdata()) == result.lrs and list(raw.get_ydata()) == result.losses
    assert (smoothed.get_label(), smoothed.get_alpha(), smoothed.get_linewidth()) == (
        "smoothed: what the rules read", None, 2)
    assert to_rgba(raw.get_color()) == to_rgba(smoothed.get_color()) == to_rgba("tab:blue")
    (peak_lr, peak_rule), (base_lr, base_rule) = result.suggestions["peak"], result.suggestions["base"]
    looks = [(m.get_label(), to_rgba(m.get_color()), m.get_linestyle(), m.get_linewidth()) for m in marks]
    assert looks == [
        (f"onecycle peak ({peak_rule}): {peak_lr:.3g}", to_rgba("tab:gray"), "--", 1),
        (f"constant/step/cosine/warmup ({base_rule}): {base_lr:.3g}", to_rgba("tab:red"), "-", 2.5)]
    assert ax.get_ylim() == pytest.approx((1.0 - 0.16, 3.0 + 0.16), rel=1e-6)
    assert ax.get_xscale() == "log" and (ax.get_xlabel(), ax.get_ylabel()) == ("learning rate", "loss")
    assert ax.get_title() == "LR range test, 60 steps, completed; red: for --schedule cosine"
    legend = ax.get_legend()
    assert legend._loc == matplotlib.legend.Legend.codes["lower left"]
    assert legend.get_texts()[0].get_fontsize() == FontProperties(size="small").get_size_in_points()


# --- the optimizer's kind, the peers' modes, saved sweeps (issue 23) ------------------------------


def one_weight(param=None) -> list:
    return [param if param is not None else nn.Parameter(torch.zeros(2, 2))]


KINDS = [
    ("SGD", {"momentum": 0.9, "nesterov": True}, "sgd", "no betas, eps or etas"),
    ("ASGD", {}, "sgd", "no betas, eps or etas"),
    ("LBFGS", {}, "sgd", "no betas, eps or etas"),
    ("Adam", {}, "adaptive", "betas, eps"),
    ("AdamW", {"fused": True}, "adaptive", "betas, eps"),
    ("Adamax", {}, "adaptive", "betas, eps"),
    ("NAdam", {}, "adaptive", "betas, eps"),
    ("RAdam", {}, "adaptive", "betas, eps"),
    ("SparseAdam", {}, "adaptive", "betas, eps"),
    ("RMSprop", {"momentum": 0.9}, "adaptive", "eps"),
    ("Adagrad", {}, "adaptive", "eps"),
    ("Adadelta", {}, "adaptive", "eps"),
    ("Adafactor", {}, "adaptive", "eps"),
    ("Rprop", {}, "adaptive", "etas"),
]


@pytest.mark.parametrize(("name", "options", "kind", "how"), KINDS, ids=[k[0] for k in KINDS])
def test_the_optimizer_kind_is_told_from_its_defaults(name, options, kind, how):
    optimizer = getattr(torch.optim, name)([nn.Parameter(torch.zeros(2, 2))], lr=0.01, **options)
    assert lf._classify(optimizer) == (kind, f"{name}: {how}")


def test_a_third_party_optimizer_and_a_wrapper_are_told_alike():
    class Lion(torch.optim.Optimizer):  # lucidrains/lion-pytorch's defaults: a sign update with betas
        def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
            super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    inner = Lion([nn.Parameter(torch.zeros(2))])
    assert lf._classify(inner) == ("adaptive", "Lion: betas")
    wrapper = Wrapper(inner)
    assert lf._chain(wrapper) == [wrapper, inner]
    assert lf._classify(wrapper) == ("adaptive", "Lion in Wrapper: betas")
    twice = Wrapper(wrapper)
    assert lf._chain(twice) == [twice], "only an Optimizer in .optimizer is unwrapped"


@pytest.mark.parametrize("given", ["sgd", "adaptive"])
def test_an_explicit_optimizer_kind_overrides_and_is_recorded(given, tmp_path):
    model, _, loader = probe_setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = lf.lr_find(model, optimizer, scripted_loss(bowl, optimizer), loader, start_lr=1e-5,
                        diverge=1e9, optimizer_kind=given)
    assert (result.optimizer_kind, result.optimizer_kind_from) == (given, "optimizer_kind argument")
    assert result.method == lf.DEFAULT_RULES[given]["peak"]
    lf.save_sweep(result, {}, tmp_path, extra={"task": "digits", "config": {"seed": 1}})
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert (record["optimizer_kind"], record["optimizer_kind_from"]) == (given, "optimizer_kind argument")
    assert record["task"] == "digits" and record["config"] == {"seed": 1}, "extra's keys join the record"


def scripted_train_and_val(train_values, val_of_lr, optimizer):
    """A loss_fn scripted by call count in train mode and by the lr in eval mode (the val pass)."""
    train_loss = scripted_loss(train_values)

    def loss_fn(out, y):
        if torch.is_grad_enabled():
            return train_loss(out, y)
        return out.sum() * 0 + val_of_lr(optimizer.param_groups[0]["lr"])

    return loss_fn


def test_a_validation_sweep_stops_and_suggests_on_the_validation_curve():
    model, optimizer, loader = probe_setup()
    val_loader = [(torch.ones(2, 1), torch.zeros(2, 1))] * 3
    train = [2.0 - 0.01 * i for i in range(50)]  # still falling: alone it would suggest nothing
    loss_fn = scripted_train_and_val(train, bowl, optimizer)
    result = lf.lr_find(model, optimizer, loss_fn, loader, start_lr=1e-5, val_loader=val_loader)
    assert result.train_losses == pytest.approx(train[: len(result.lrs)])
    assert result.losses == pytest.approx([bowl(lr) for lr in result.lrs], rel=1e-6)
    assert result.stop_reason == "diverged" and len(result.lrs) < 50, "the validation loss blew up"
    assert result.suggestion == result.suggest() == lf.suggest_lr(result.lrs, result.losses) is not None
    pytest.importorskip("matplotlib")
    assert lf.plot_lr_find(result).axes[0].get_ylabel() == "validation loss"
    assert lf.plot_lr_find(bowl_sweep()).axes[0].get_ylabel() == "loss"


def test_a_validation_loss_is_the_mean_over_the_val_loader_in_eval_mode_after_the_step():
    model = make_convnet()
    optimizer = make_optimizer("sgd", model)
    train, val = make_batches(4, seed=1), make_batches(3, seed=2)
    model[3].eval()
    before = snapshot(model, optimizer)
    expected = []

    def progress(i, lr, loss):  # runs right after step i (no read lag on the CPU)
        model.eval()
        with torch.no_grad():
            expected.append(sum(F.cross_entropy(model(x), y) for x, y in val) / len(val))
        model.train()

    result = lf.lr_find(model, optimizer, F.cross_entropy, train, val_loader=val, num_iter=12, end_lr=1.0,
                        progress=progress)
    assert result.losses == [float(v) for v in expected]
    assert result.train_losses != result.losses and len(result.train_losses) == 12
    assert_restored(before, model, optimizer)
    with pytest.raises(ValueError, match="^val_loader is empty: it yielded no batches$"):
        lf.lr_find(model, optimizer, F.cross_entropy, train, val_loader=[], num_iter=12)
    assert_restored(before, model, optimizer)


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_a_linear_sweep_and_per_group_rates():
    model, optimizer, loader = linear_setup()  # groups at 1e-3 and 3e-3
    linear = lf.lr_find(model, optimizer, F.mse_loss, loader, start_lr=0.01, end_lr=0.1, num_iter=10,
                        step_mode="linear", diverge=1e9)
    assert linear.lrs == pytest.approx([0.01 + 0.01 * i for i in range(10)], rel=1e-12)
    assert (linear.lrs[0], linear.lrs[-1]) == (0.01, 0.1)
    assert [b for _, b in linear.group_lrs] == pytest.approx([3 * a for a in linear.lrs], rel=1e-12)
    own = lf.lr_find(model, optimizer, F.mse_loss, loader, start_lr=[1e-4, 1e-2], end_lr=[1e-1, 1.0],
                     num_iter=10, diverge=1e9)
    assert own.lrs == pytest.approx([1e-4 * 1000 ** (i / 9) for i in range(10)], rel=1e-12)
    second = [1e-2 * 100 ** (i / 9) for i in range(10)]
    assert [b for _, b in own.group_lrs] == pytest.approx(second, rel=1e-12)
    assert own.group_lrs[0] == [1e-4, 1e-2] and own.group_lrs[-1] == [1e-1, 1.0]
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 3e-3]


def test_per_group_suggestions_take_the_ratio_at_the_nearest_step():
    result = lf.LRFindResult([1e-3, 1e-2, 1e-1], [1.0] * 3, [1.0] * 3, 0.012, "completed", "minimum",
                             suggestions={"peak": (0.012, "minimum"), "base": (0.004, "min/3")},
                             group_lrs=[[1e-3, 1e-3], [1e-2, 2e-2], [1e-1, 4e-1]])
    assert result.for_groups() == [0.012, 0.024]
    assert result.for_groups("cosine") == [0.004, 0.008]  # nearer 1e-2 than 1e-3 in log lr
    assert lf.LRFindResult(**{**vars(result), "suggestions": {"peak": (2e-3, "minimum")}}).for_groups() == [
        2e-3, 2e-3]
    assert result.for_groups("linear") == result.for_groups("cosine"), "one's own schedule: its start"
    bare = lf.LRFindResult([1e-3], [1.0], [1.0], 0.5, "completed", "minimum",
                           suggestions={"peak": (0.5, "minimum")})
    assert bare.for_groups() == [0.5], "a result built without group_lrs: one group"


LISTS = "start_lr and end_lr as lists need one rate each per param group (2), got "


@pytest.mark.parametrize(("start_lr", "end_lr", "message"), [
    ([1e-5], [1.0], LISTS + "start_lr=[1e-05], end_lr=[1.0]"),
    ([1e-5, 1e-5], 1.0, LISTS + "start_lr=[1e-05, 1e-05], end_lr=1.0"),
    ([1e-5, 1e-4], [1.0], LISTS + "start_lr=[1e-05, 0.0001], end_lr=[1.0]"),
    ([1e-5, 2.0], [1.0, 1.0],
     "start_lr and end_lr need 0 < start_lr < end_lr < inf, got start_lr=[1e-05, 2.0], end_lr=[1.0, 1.0]"),
])
def test_bad_per_group_rates_name_them(start_lr, end_lr, message):
    model, optimizer, loader = linear_setup()
    with pytest.raises(ValueError) as info:
        lf.lr_find(model, optimizer, F.mse_loss, loader, start_lr=start_lr, end_lr=end_lr)
    assert str(info.value) == message


def test_suggest_lr_reads_lr_find_json_with_its_nulls(tmp_path):
    result = bowl_sweep()
    assert math.isinf(result.losses[-1]) and result.suggest() is not None
    lf.save_sweep(result, {}, tmp_path)
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert record["losses"][-1] is None
    for method in lf.METHODS:
        assert lf.suggest_lr(record["lrs"], record["losses"], method) == result.suggest(method)


def test_a_loaders_generators_and_sampler_state_come_back():
    class Sampler(torch.utils.data.Sampler):
        """A sampler keeping a Python RNG and an epoch counter of its own."""

        def __init__(self, n):
            self.n, self.rng, self.epoch = n, random.Random(3), 0

        def __len__(self):
            return self.n

        def __iter__(self):
            self.epoch += 1
            return iter(self.rng.sample(range(self.n), self.n))

    class Batches(torch.utils.data.Sampler):
        """A batch sampler of its own: batches of 4 in the order its sampler gives, and an epoch count."""

        def __init__(self, sampler):
            self.sampler, self.epoch = sampler, 0

        def __len__(self):
            return 3

        def __iter__(self):
            self.epoch += 1
            order = list(self.sampler)
            return iter([order[i:i + 4] for i in range(0, 12, 4)])

    data = torch.utils.data.TensorDataset(torch.randn(12, 1), torch.randn(12, 1))

    def orders(sweep: bool) -> tuple:
        g = torch.Generator().manual_seed(1)
        samplers = [Sampler(12), Sampler(12), Batches(Sampler(12))]
        loaders = [torch.utils.data.DataLoader(data, batch_size=4, sampler=samplers[0]),
                   torch.utils.data.DataLoader(data, batch_size=None, sampler=samplers[1]),
                   torch.utils.data.DataLoader(data, batch_sampler=samplers[2]),
                   torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=g)]
        if sweep:
            model, optimizer, _ = probe_setup()
            for loader in loaders:
                lf.lr_find(model, optimizer, F.mse_loss, loader, num_iter=10, end_lr=1e-2, diverge=1e9,
                           val_loader=loaders[-1])
        seen = [torch.cat([x.reshape(-1) for x, _ in loader]) for loader in loaders]
        return seen, [s.epoch for s in [*samplers, samplers[2].sampler]]

    (swept, swept_epochs), (plain, plain_epochs) = orders(True), orders(False)
    assert all(torch.equal(a, b) for a, b in zip(swept, plain, strict=True))
    assert swept_epochs == plain_epochs == [1, 1, 1, 1]


def bounded(lr: float) -> float:
    """A loss that cannot blow up (NT-Xent's is at most log of the batch): flat, a fall to a low near 3e-3,
    a rise at higher rates, then a slow fall to the end of any sweep, as scale-invariant layers give."""
    u = math.log10(lr / 3e-3)
    fall = 3.3 + 0.35 / (1 + math.exp(4 * (u + 0.6)))
    rise = 0.5 * math.exp(-(((u - 0.6) / 0.35) ** 2))
    return fall + rise - 0.1 * (1 - math.exp(-max(0.0, u - 0.6)))


@pytest.mark.parametrize("end_lr", [10.0, 100.0])
def test_a_bounded_loss_that_rises_and_falls_again_is_read_up_to_its_rise(end_lr):
    """Issue 49: such a curve's lowest point is the sweep's end, so the rules found none, and the hint to
    raise end_lr gave the same again; now they read it up to its first rise, and say so."""
    model, optimizer, loader = probe_setup()
    result = lf.lr_find(model, optimizer, scripted_loss(bounded, optimizer), loader, start_lr=1e-5,
                        end_lr=end_lr)
    assert result.stop_reason == "completed" and max(result.losses) < 4 * min(result.losses)
    assert 1e-3 <= result.suggestion <= 5e-3 and result.why_none is None, result.suggestion
    assert result.note.startswith("the loss rose after ") and "read the curve up to that rise" in result.note
    assert result.suggest("minimum") == result.suggestion  # from the lists too
    assert result.for_schedule("cosine") == pytest.approx(result.suggestion / 3)
