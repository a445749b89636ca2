"""Tests for lr_find.py: exact restoration, the lr schedule, smoothing, stopping, suggestions."""

from __future__ import annotations

import copy
import math
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lr_find as lf  # noqa: E402

F = nn.functional


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

    state = lf._capture_rng_state()
    control = draws()
    lf._restore_rng_state(state)

    first_weight = model[0].weight
    seen = {"changed": False, "train": []}

    def progress(i, lr, loss):
        seen["changed"] |= not torch.equal(first_weight, before["tensors"]["0.weight"])
        seen["train"].append(all(m.training for m in model.modules()))

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
    """A re-iterable custom loader that counts batches and passes."""

    def __init__(self, batches):
        self.batches, self.served, self.passes = batches, 0, 0

    def __iter__(self):
        self.passes += 1
        for b in self.batches:
            self.served += 1
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
    """A loss_fn whose value is scripted (by call count or by the current lr), gradient zero."""
    calls = []

    def loss_fn(out, y):
        i = len(calls)
        calls.append(i)
        v = values(optimizer.param_groups[0]["lr"]) if optimizer is not None else values[i]
        return out.sum() * 0 + v

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


@pytest.mark.parametrize("lr_star", [3e-5, 1e-3, 3e-2])
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_lr_find_suggests_the_steepest_point(lr_star, noise):
    model, optimizer, loader = probe_setup()
    f = synthetic_curve(lr_star, noise=noise, seed=int(-math.log10(lr_star)))
    result = lf.lr_find(model, optimizer, scripted_loss(f, optimizer), loader, method="steepest")
    assert result.method == "steepest"
    assert lr_star / 2 <= result.suggestion <= lr_star * 2
    assert lr_star <= result.suggest("valley") <= 4 * lr_star
    lowest = result.lrs[min(range(len(result.lrs)), key=result.losses.__getitem__)]
    assert lowest / 3 <= 10 * result.suggest("min/10") <= 3 * lowest


def test_suggest_lr_on_a_clean_curve():
    lrs = [10 ** (-7 + 8 * i / 99) for i in range(100)]
    losses = [synthetic_curve(1e-2, k=1.5)(lr) for lr in lrs]
    assert 0.5e-2 <= lf.suggest_lr(lrs, losses, "steepest") <= 2e-2
    assert 1e-2 <= lf.suggest_lr(lrs, losses, "valley") <= 4e-2
    spiky = list(losses)
    spiky[30] *= 3
    spiky[45] *= 3
    assert 0.5e-2 <= lf.suggest_lr(lrs, spiky, "steepest") <= 2e-2, "a lone spike is not a descent"
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
    assert "non-finite" in result.stop_reason
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
@pytest.mark.parametrize("values", [[1.0] * 12 + [1e3] * 8, [1.0] * 5 + [math.nan] * 15])
def test_late_loss_reads_give_the_same_result(monkeypatch, values):
    """On CUDA losses are read one step late; the recorded sweep must not change."""
    model, optimizer, loader = probe_setup()
    now = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=20)
    monkeypatch.setattr(lf, "_read_lag", lambda device: 1)
    late = lf.lr_find(model, optimizer, scripted_loss(values), loader, num_iter=20)
    assert now.stop_reason != "completed"
    assert (late.lrs, late.stop_reason) == (now.lrs, now.stop_reason)
    assert late.losses == pytest.approx(now.losses, nan_ok=True)


def test_one_shot_iterator_loader_is_an_error_that_still_restores():
    model, optimizer, _ = probe_setup()
    before = snapshot(model, optimizer)
    batches = iter([(torch.ones(2, 1), torch.zeros(2, 1))] * 3)
    with pytest.raises(ValueError, match="loader.*empty"):
        lf.lr_find(model, optimizer, F.mse_loss, batches, num_iter=10)
    assert_restored(before, model, optimizer)


def frozen_model():
    model = nn.Linear(1, 1)
    model.requires_grad_(False)
    return model


BAD_INPUTS = [
    ({"start_lr": 0.0}, "start_lr"),
    ({"start_lr": -1e-3}, "start_lr"),
    ({"start_lr": 1.0, "end_lr": 0.5}, "start_lr"),
    ({"start_lr": 1.0, "end_lr": 1.0}, "start_lr"),
    ({"num_iter": 5}, "num_iter"),
    ({"accum_steps": 0}, "accum_steps"),
    ({"smooth": 1.0}, "smooth"),
    ({"smooth": -0.1}, "smooth"),
    ({"diverge": 1.0}, "diverge"),
    ({"method": "fastest"}, "method"),
    ({"schedule": "linear"}, "schedule"),
    ({"min_iter_before_stop": -1}, "min_iter_before_stop"),
    ({"loader": []}, "loader"),
    ({"model": "frozen"}, "model"),
    ({"optimizer": "empty"}, "optimizer"),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_INPUTS, ids=[n for _, n in BAD_INPUTS])
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
    fig = lf.plot_lr_find(result, path)
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
                       schedule="cosine", method="steepest")
    assert (other.suggestion, other.method) == (result.suggest("steepest"), "steepest")
    assert other.suggestions["peak"] == result.suggestions["peak"]


def test_raw_blow_up_stops_the_sweep_as_diverged():
    """The moving average lags: here it never reaches 4x its best, but the raw losses explode."""
    falling = [2.3 - 0.05 * i for i in range(26)]
    model, optimizer, loader = probe_setup()
    blown = lf.lr_find(model, optimizer, scripted_loss(falling + [1.5, 8.0, 9.0, 1.2] + [1.1] * 10),
                       loader, num_iter=40)
    assert blown.stop_reason == "diverged" and blown.losses[-2:] == [8.0, 9.0]
    assert max(blown.smoothed) < 4 * min(blown.smoothed), "the old rule alone would not have stopped"
    spike = lf.lr_find(model, optimizer, scripted_loss(falling + [1.0, 9.0, 1.0] + [1.0] * 11),
                       loader, num_iter=40)
    assert spike.stop_reason == "completed", "one spike is noise, not a blow-up"


def test_plot_draws_the_curve_the_rules_read_and_marks_every_schedule():
    pytest.importorskip("matplotlib")
    model, optimizer, loader = probe_setup()
    result = lf.lr_find(model, optimizer, scripted_loss(bowl, optimizer), loader, start_lr=1e-5,
                        diverge=1e9, schedule="cosine")
    ax = lf.plot_lr_find(result).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    curve = lf.suggestion_curve(result.lrs, result.losses)
    drawn = lines["smoothed: what the rules read"]
    assert list(drawn.get_xdata()) == curve.lrs and list(drawn.get_ydata()) == curve.loss
    marks = {label: line for label, line in lines.items() if label.startswith(("onecycle", "constant"))}
    assert len(marks) == 2
    chosen = [line for line in marks.values() if line.get_color() == "tab:red"]
    assert len(chosen) == 1 and chosen[0].get_xdata()[0] == result.for_schedule("cosine")
    assert any(line.get_xdata()[0] == result.for_schedule("onecycle") for line in marks.values())
