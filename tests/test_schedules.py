import io
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import schedules
from schedules import SCHEDULES, build_scheduler, epochs_to_steps, optimizer_step, steps_per_epoch

BASES = (0.1, 0.03)


def make_optimizer(kind="sgd", momentum=0.9):
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    groups = [{"params": [model.weight], "lr": BASES[0]}, {"params": [model.bias], "lr": BASES[1]}]
    if kind == "adam":
        return model, torch.optim.Adam(groups)
    if kind == "fused":
        return model, torch.optim.Adam(groups, fused=True)
    return model, torch.optim.SGD(groups, momentum=momentum)


def run(optimizer, scheduler, steps, *keys):
    """Per step and group, `keys` (default lr) read before optimizer.step(); scheduler after it."""
    keys = keys or ("lr",)
    seen = []
    for _ in range(steps):
        values = [tuple(group[key] for key in keys) for group in optimizer.param_groups]
        seen.append([v[0] if len(v) == 1 else v for v in values])
        optimizer.step()
        scheduler.step()
    return seen


def closed_form(name, k, base, T, W, step_size=1, gamma=0.1, ratio=0.0):
    if k < W:
        return base * (k + 1) / W
    if name == "step":
        return base * gamma ** ((k - W) // step_size)
    if name == "cosine":
        m = ratio * base
        return m + (base - m) * 0.5 * (1 + math.cos(math.pi * (k - W) / (T - W)))
    return base


CASES = [(1, 0, 1), (2, 1, 1), (10, 0, 3), (10, 9, 2), (17, 4, 5), (12, 3, 20), (40, 39, 1)]


@pytest.mark.parametrize("name", ["constant", "warmup", "step", "cosine"])
@pytest.mark.parametrize(("T", "W", "step_size"), CASES)
def test_lambda_schedules_match_closed_form(name, T, W, step_size):
    options = {"step": {"step_size": step_size, "gamma": 0.5}, "cosine": {"min_lr_ratio": 0.1}}
    _, opt = make_optimizer()
    if name == "warmup" and W == 0 and T > 1:
        with pytest.raises(ValueError, match="warmup_steps must be >= 1 for warmup"):
            build_scheduler(opt, name, T, warmup_steps=W)
        return
    sched = build_scheduler(opt, name, T, warmup_steps=W, **options.get(name, {}))
    with pytest.warns(UserWarning, match="past its total_steps") as caught:  # the 3 steps too many
        seen = run(opt, sched, T + 3)
    assert len(caught) == 1
    for k in range(T + 3):
        for g, base in enumerate(BASES):
            want = closed_form(name, min(k, T - 1), base, T, W, step_size, 0.5, 0.1)
            assert math.isclose(seen[k][g], want, rel_tol=1e-12), (k, g, seen[k][g], want)
    if W:
        assert seen[0][0] > 0 and math.isclose(seen[W - 1][0], BASES[0], rel_tol=1e-12)


@pytest.mark.parametrize(("T", "W", "step_size"), [(30, 3, 9), (31, 3, 10), (3, 0, 1), (3, 1, 1)])
def test_step_default_decays_at_a_third_and_two_thirds_after_warmup(T, W, step_size):
    _, opt = make_optimizer()
    seen = [lrs[0] for lrs in run(opt, build_scheduler(opt, "step", T, warmup_steps=W), T)]
    want = [closed_form("step", k, BASES[0], T, W, step_size) for k in range(T)]
    assert seen == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(("T", "step_size", "gamma"), [(30, None, 0.1), (20, 4, 0.5), (7, 1, 0.9)])
def test_step_without_warmup_equals_torchs_steplr_step_for_step(T, step_size, gamma):
    """Issue 54, 15: "step" is StepLR's closed form in a LambdaLR (schedules.py says why): without warmup its
    rates are torch.optim.lr_scheduler.StepLR's, step for step, its default step_size a third of the run."""
    _, opt = make_optimizer()
    ours = run(opt, build_scheduler(opt, "step", T, step_size=step_size, gamma=gamma), T)
    _, opt = make_optimizer()
    steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=step_size or math.ceil(T / 3), gamma=gamma)
    torchs = run(opt, steplr, T)
    assert sum(ours, []) == pytest.approx(sum(torchs, []), rel=1e-12)


def test_the_step_schedules_default_step_size_is_schedules_py_s_in_train_py_too():
    """Issue 54, 14: one rule for the default step_size (a third of the steps after the warmup): with a warmup
    of a third or more, train.py's schedule decays twice, as schedules.py's does, where it decayed once."""
    import train
    from configs import parse_config

    cfg = parse_config(["--schedule", "step", "--epochs", "6", "--warmup-epochs", "3", "--gamma", "0.5"])
    _, opt = make_optimizer()
    scheduler, total = train.make_scheduler(cfg, opt, 10)  # 10 batches an epoch: 60 steps, 30 of warmup
    direct = build_scheduler(make_optimizer()[1], "step", total, warmup_steps=30, gamma=0.5)
    assert total == 60 and scheduler.lr_lambdas[0](59) == direct.lr_lambdas[0](59) == 0.25
    _, opt = make_optimizer()
    seen = run(opt, build_scheduler(opt, "cosine", 100), 100)
    assert seen[0][0] == BASES[0] and 0 < seen[-1][0] < 1e-3 * BASES[0]
    _, opt = make_optimizer()  # min_lr_ratio 1: flat after the warmup
    seen = run(opt, build_scheduler(opt, "cosine", 6, warmup_steps=2, min_lr_ratio=1.0), 6)
    assert [lrs[0] for lrs in seen] == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.1, 0.1], rel=1e-12)


@pytest.mark.parametrize("T", [1, 2, 3, 11, 100])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pct_start": 0.25, "div_factor": 10.0},
        {"three_phase": True, "anneal_strategy": "linear"},
        {"div_factor": 1.0, "final_div_factor": 100.0},
    ],
)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_onecycle_equals_torch(T, options, kind):
    key = "betas" if kind == "adam" else "momentum"
    _, opt = make_optimizer(kind)
    sched = build_scheduler(opt, "onecycle", T, **options)
    _, ref_opt = make_optimizer(kind)
    ref = torch.optim.lr_scheduler.OneCycleLR(
        ref_opt, max_lr=list(BASES), total_steps=T, base_momentum=0.85, max_momentum=0.9, **options
    )
    assert run(opt, sched, T, "lr", key) == run(ref_opt, ref, T, "lr", key)
    _, opt = make_optimizer(kind)
    seen = run(opt, build_scheduler(opt, "onecycle", T, **options), T)
    for g, base in enumerate(BASES):
        final = base / options.get("div_factor", 25.0) / options.get("final_div_factor", 1e4)
        assert seen[-1][g] == pytest.approx(final)


def test_onecycle_max_lr_zero_is_allowed():
    _, opt = make_optimizer()
    assert run(opt, build_scheduler(opt, "onecycle", 6, max_lr=0.0), 6) == [[0.0, 0.0]] * 6


def test_onecycle_never_adds_momentum():
    _, opt = make_optimizer(momentum=0.0)
    momenta = run(opt, build_scheduler(opt, "onecycle", 20), 20, "momentum")
    assert all(step == [0.0, 0.0] for step in momenta)
    model = nn.Linear(2, 2)
    groups = [{"params": [model.weight], "momentum": 0.9}, {"params": [model.bias]}]
    opt = torch.optim.SGD(groups, lr=0.1)
    momenta = run(opt, build_scheduler(opt, "onecycle", 20), 20, "momentum")
    assert all(step == [0.9, 0.0] for step in momenta)
    _, opt = make_optimizer(momentum=0.5)
    momenta = run(opt, build_scheduler(opt, "onecycle", 20, max_lr=1.0), 20, "momentum")
    assert all(step == [0.5, 0.5] for step in momenta)
    _, opt = make_optimizer("adam")
    betas = run(opt, build_scheduler(opt, "onecycle", 20), 20, "betas")
    assert betas[0][0] == (0.9, 0.999) and min(b[0][0] for b in betas) == pytest.approx(0.85)
    opt, ref_opt = (torch.optim.Adagrad(nn.Linear(2, 2).parameters(), lr=0.1) for _ in range(2))
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.1, total_steps=20, cycle_momentum=False)
    assert run(opt, build_scheduler(opt, "onecycle", 20), 20) == run(ref_opt, ref, 20)
    assert "momentum" not in opt.param_groups[0]  # an optimizer without momentum gets none


def loop(model, opt, sched, scaler, micro_batches, accum=1, bad=(), clip=None):
    """Training loop calling optimizer_step on every accum-th micro batch and the last one."""
    results = []
    for i in range(micro_batches):
        loss = model(torch.ones(4, 2)).square().mean() / accum
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if i in bad:
            model.weight.grad[0, 0] = float("inf")
        if (i + 1) % accum == 0 or i == micro_batches - 1:
            results.append(optimizer_step(opt, sched, scaler, clip_grad=clip))
            opt.zero_grad(set_to_none=True)
    return results


def count_steps(opt):
    counter = [0]
    opt.register_step_post_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    return counter


@pytest.mark.parametrize("clip", [None, 1.0])
def test_grad_scaler_skipped_steps_do_not_advance_schedule(clip):
    model, opt = make_optimizer()
    sched = build_scheduler(opt, "cosine", 10, warmup_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    steps = count_steps(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = loop(model, opt, sched, scaler, 8, bad=(0, 1, 2), clip=clip)
    assert results == [False] * 3 + [True] * 5
    assert steps[0] == sched.last_epoch == 5
    assert scaler.get_scale() == 2.0**7
    _, fresh = make_optimizer()
    assert (
        opt.param_groups[0]["lr"]
        == run(fresh, build_scheduler(fresh, "cosine", 10, warmup_steps=2), 6)[5][0]
    )


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_plain_optimizer_steps_with_no_hook_to_tell(clip, monkeypatch):
    """Without a scaler or a wrapper the step always happens: nothing is hooked (a cost every step),
    and the schedule still moves with each step, gradients clipped first when asked."""
    model, opt = make_optimizer()
    sched = build_scheduler(opt, "cosine", 10)
    hooked = []
    monkeypatch.setattr(type(opt), "register_step_post_hook", lambda self, hook: hooked.append(hook))
    for _ in range(3):
        model(torch.ones(1, 2)).sum().mul(1e3).backward()
        assert optimizer_step(opt, sched, clip_grad=clip) is True
        grads = [p.grad.norm() for p in model.parameters()]
        assert clip is None or torch.linalg.vector_norm(torch.stack(grads)) <= clip * (1 + 1e-5)
        opt.zero_grad(set_to_none=True)
    assert hooked == [] and sched.last_epoch == 3


class SkipsEveryOther(torch.optim.Optimizer):
    """A wrapper with the torch optimizer in `.optimizer` and nothing else: it steps it every other call."""

    def __init__(self, optimizer):
        self.optimizer, self.calls = optimizer, 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.calls += 1
        if self.calls % 2 == 0:
            self.optimizer.step(closure)


class ReportsItsSkips(torch.optim.SGD):
    """An optimizer that says it skipped (step_was_skipped), with no `.optimizer` inside."""

    step_was_skipped = True


class Accumulating(torch.optim.SGD):
    """An optimizer between gradient syncs (gradient_state.sync_gradients False), no `.optimizer` inside."""

    gradient_state = type("GradientState", (), {"sync_gradients": False})()


def test_each_mark_of_a_wrapper_alone_is_told(monkeypatch):
    """`.optimizer`, `step_was_skipped` and `gradient_state` each make a wrapper: the step counts only when
    the torch optimizer inside ran it and no skip was reported, and no gradient is clipped between syncs.
    An optimizer with no other inside steps itself: nothing is hooked to tell."""
    hooked = []
    for kind in (ReportsItsSkips, Accumulating):
        monkeypatch.setattr(kind, "register_step_post_hook", lambda self, hook: hooked.append(hook))
    model, inner = make_optimizer()
    sched = build_scheduler(inner, "cosine", 10)
    wrapper = SkipsEveryOther(inner)
    steps = count_steps(inner)
    results = []
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward()
        results.append(optimizer_step(wrapper, sched))
    assert results == [False, True, False, True] and steps[0] == sched.last_epoch == 2
    model = nn.Linear(2, 2)
    opt = ReportsItsSkips(model.parameters(), lr=0.1)
    sched = build_scheduler(opt, "cosine", 10)
    model(torch.ones(1, 2)).sum().backward()
    assert optimizer_step(opt, sched) is False and sched.last_epoch == 0
    opt = Accumulating(model.parameters(), lr=0.1)
    sched = build_scheduler(opt, "cosine", 10)
    model(torch.ones(1, 2)).sum().mul(1e3).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert optimizer_step(opt, sched, clip_grad=1e-3) is True and sched.last_epoch == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert hooked == []


class HostReads(TorchDispatchMode):
    """Counts reads from the device (.item(), float(t), bool(t)) made while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["sgd", "fused"])
def test_grad_scaler_skips_are_told_with_one_read_per_step(kind):
    """A fused optimizer is called even on a skipped step (it skips on the device), so its skips
    are told from the scale: read once per step, plus once on the first call with a scaler."""
    model, opt = make_optimizer(kind)
    sched = build_scheduler(opt, "cosine", 10, warmup_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with HostReads() as reads:
        results = loop(model, opt, sched, scaler, 8, bad=(0, 1, 2))
    assert results == [False] * 3 + [True] * 5
    assert sched.last_epoch == 5 and scaler.get_scale() == 2.0**7
    assert reads.count == 8 + (kind == "fused")


def test_disabled_scaler_and_no_scaler_always_step():
    for scaler in (torch.amp.GradScaler("cpu", enabled=False), None):
        model, opt = make_optimizer()
        sched = build_scheduler(opt, "warmup", 10, warmup_steps=5)
        steps = count_steps(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert loop(model, opt, sched, scaler, 4, clip=0.5) == [True] * 4
        assert steps[0] == sched.last_epoch == 4


@pytest.mark.parametrize("batches", [1, 5, 7, 8])
@pytest.mark.parametrize("accum", [1, 2, 3, 8])
def test_gradient_accumulation_step_counts(batches, accum):
    per_epoch = steps_per_epoch(batches, accum)
    assert per_epoch == math.ceil(batches / accum)
    model, opt = make_optimizer()
    sched = build_scheduler(opt, "cosine", 2 * per_epoch)
    steps = count_steps(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert len(loop(model, opt, sched, None, batches, accum)) == per_epoch
    assert steps[0] == sched.last_epoch == 2 * per_epoch


def test_epochs_to_steps():
    assert steps_per_epoch(7) == 7
    assert epochs_to_steps(1, 10) == 10
    assert epochs_to_steps(0.5, 10, 3) == 2
    assert epochs_to_steps(2, 7, 2) == 8
    assert epochs_to_steps(0, 7) == 0


RESUME = [
    ("constant", 3, {}),
    ("warmup", 4, {}),
    ("step", 2, {"step_size": 3, "gamma": 0.5}),
    ("cosine", 3, {"min_lr_ratio": 0.05}),
    ("onecycle", 0, {"pct_start": 0.4}),
]


@pytest.mark.parametrize(("name", "W", "options"), RESUME)
@pytest.mark.parametrize("j", [1, 5, 11])
@pytest.mark.parametrize("order", ["build-then-load", "load-then-build"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_resume_matches_uninterrupted_run(name, W, options, j, order, kind):
    """The optimizer's state loaded before or after building the scheduler (imagenet/main.py builds
    it late, since it needs len(loader)), then the scheduler's: the same rates and momenta."""
    assert {case[0] for case in RESUME} == set(SCHEDULES)
    T, key = 12, "betas" if kind == "adam" else "momentum"
    _, opt = make_optimizer(kind)
    full = run(opt, build_scheduler(opt, name, T, warmup_steps=W, **options), T, "lr", key)
    _, opt = make_optimizer(kind)
    sched = build_scheduler(opt, name, T, warmup_steps=W, **options)
    first = run(opt, sched, j, "lr", key)
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    _, opt = make_optimizer(kind)
    if order == "load-then-build":
        opt.load_state_dict(state["optimizer"])
    sched = build_scheduler(opt, name, T, warmup_steps=W, **options)
    if order == "build-then-load":
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    assert first + run(opt, sched, T - j, "lr", key) == full


@pytest.mark.parametrize("name", ["cosine", "onecycle"])
@pytest.mark.parametrize("order", ["build-then-load", "load-then-build"])
def test_resume_with_a_tensor_lr(name, order):
    """An lr held in a tensor (Adam's capturable runs) gets the saved rate in place."""
    def make():
        torch.manual_seed(0)
        return torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.01), foreach=False)

    opt = make()
    full = [float(step[0]) for step in run(opt, build_scheduler(opt, name, 10), 10)]
    opt = make()
    sched = build_scheduler(opt, name, 10)
    run(opt, sched, 4)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    opt = make()
    if order == "load-then-build":
        opt.load_state_dict(state["optimizer"])
    sched = build_scheduler(opt, name, 10)
    if order == "build-then-load":
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert [float(step[0]) for step in run(opt, sched, 6)] == full[4:]


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_schedule_stepped_past_its_end_holds_its_last_rate_and_warns_once(name):
    _, opt = make_optimizer()
    sched = build_scheduler(opt, name, 6, warmup_steps=2 if name == "warmup" else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        last = run(opt, sched, 6)[-1]  # a whole run: 6 scheduler steps, the last after the last step
    with pytest.warns(UserWarning) as caught:
        held = run(opt, sched, 4)
    assert held == [last] * 4
    assert [str(w.message) for w in caught] == [
        f"the {name} schedule was stepped past its total_steps (6) and holds its last rate; the usual cause "
        "is a second scheduler.step() per epoch beside the one after each optimizer step (optimizer_step "
        "makes that one)"]


@pytest.mark.parametrize("name", ["constant", "warmup", "step"])
def test_a_longer_resume_keeps_the_length_it_was_built_for(name):
    """--allow-more-epochs: a 6-step state loaded into a 9-step schedule runs 3 more, with no warning."""
    _, opt = make_optimizer()
    short = build_scheduler(opt, name, 6, warmup_steps=2 if name == "warmup" else 0)
    run(opt, short, 6)
    _, opt = make_optimizer()
    longer = build_scheduler(opt, name, 9, warmup_steps=2 if name == "warmup" else 0)
    longer.load_state_dict(short.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(opt, longer, 3)
    assert longer.total_steps == 9 and longer.last_epoch == 9


def test_the_past_end_warning_points_at_the_caller():
    _, opt = make_optimizer()
    sched = build_scheduler(opt, "cosine", 1)
    opt.step()  # first, as torch asks (else its own warning, not the one tested here)
    sched.step()
    with pytest.warns(UserWarning) as caught:
        sched.step()
    assert caught[0].filename == __file__


def test_onecycle_peaks_per_group():
    """A number is the first group's peak, the others keeping their ratio (0.1 : 0.03); a list sets
    each; None takes each group's lr, or the peak a onecycle schedule left in a loaded state."""
    for max_lr, peaks in ((1.0, [1.0, 0.3]), ([0.5, 0.05], [0.5, 0.05]), (None, list(BASES))):
        _, opt = make_optimizer()
        build_scheduler(opt, "onecycle", 10, max_lr=max_lr)
        assert [g["max_lr"] for g in opt.param_groups] == pytest.approx(peaks, rel=1e-12)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": 0.0}, {"params": [model.bias], "lr": 0.1}])
    build_scheduler(opt, "onecycle", 10, max_lr=0.2)
    assert [g["max_lr"] for g in opt.param_groups] == [0.2, 0.2], "no ratio to a first group at 0"


def test_clip_grad_zero_is_off():
    model, opt = make_optimizer(momentum=0.0)
    model(torch.ones(4, 2)).square().mean().backward()
    want = model.weight - BASES[0] * model.weight.grad
    assert optimizer_step(opt, clip_grad=0) is True
    assert torch.equal(model.weight, want)


def test_clip_grad_clips_only_the_parameters_given():
    model, opt = make_optimizer(momentum=0.0)
    model(torch.ones(4, 2)).square().mean().mul(100).backward()
    weight_grad = model.weight.grad.clone()
    assert weight_grad.norm() > 1 and model.bias.grad.norm() > 1
    assert optimizer_step(opt, clip_grad=1e-3, parameters=[model.bias]) is True
    assert torch.equal(model.weight.grad, weight_grad)
    assert model.bias.grad.norm() == pytest.approx(1e-3, rel=1e-3)


def test_copied_alone_works(tmp_path):
    """One interpreter (torch imports slowly): import the lone copy, then run it as a script."""
    shutil.copy(Path(schedules.__file__), tmp_path / "schedules.py")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    code = f"""
import pathlib, runpy, sys, torch, schedules
assert pathlib.Path(schedules.__file__).parent == pathlib.Path({str(tmp_path)!r})
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
schedules.build_scheduler(opt, "cosine", 10, warmup_steps=2)
assert opt.param_groups[0]["lr"] == 0.5
sys.argv = "schedules.py --schedule cosine --total-steps 50 --warmup-steps 5".split()
runpy.run_path("schedules.py", run_name="__main__")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[0] == "0" and "49" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["schedules.py"]


RANGE_10 = "an int in [0, total_steps) = [0, 10)"
ONE_PER_GROUP = "a number >= 0 or a list of 2, one per group"
BAD = [
    ("nope", 10, {}, "name must be one of constant, step, onecycle, warmup, cosine; got 'nope'"),
    ("cosine", 0, {}, "total_steps must be an int >= 1; got 0"),
    ("cosine", True, {}, "total_steps must be an int >= 1; got True"),
    ("cosine", 2.0, {}, "total_steps must be an int >= 1; got 2.0"),
    ("cosine", 10, {"warmup_steps": -1}, f"warmup_steps must be {RANGE_10}; got -1"),
    ("cosine", 10, {"warmup_steps": 10}, f"warmup_steps must be {RANGE_10}; got 10"),
    ("cosine", 1, {"warmup_steps": 1}, "warmup_steps must be an int in [0, total_steps) = [0, 1); got 1"),
    ("warmup", 10, {"warmup_steps": 1.5}, f"warmup_steps must be {RANGE_10}; got 1.5"),
    ("step", 10, {"gamma": 0}, "gamma must be a number > 0; got 0"),
    ("step", 10, {"gamma": -0.5}, "gamma must be a number > 0; got -0.5"),
    ("step", 10, {"step_size": 0}, "step_size must be an int >= 1; got 0"),
    ("step", 10, {"step_size": 2.5}, "step_size must be an int >= 1; got 2.5"),
    ("cosine", 10, {"min_lr_ratio": -0.1}, "min_lr_ratio must be in [0, 1]; got -0.1"),
    ("cosine", 10, {"min_lr_ratio": 1.5}, "min_lr_ratio must be in [0, 1]; got 1.5"),
    ("cosine", 10, {"min_lr_ratio": True}, "min_lr_ratio must be in [0, 1]; got True"),
    ("onecycle", 10, {"max_lr": -1.0}, f"max_lr must be {ONE_PER_GROUP}; got -1.0"),
    ("onecycle", 10, {"max_lr": [0.1, -1.0]}, f"max_lr must be {ONE_PER_GROUP}; got [0.1, -1.0]"),
    ("onecycle", 10, {"max_lr": [0.1]}, f"max_lr must be {ONE_PER_GROUP}; got [0.1]"),
    ("onecycle", 10, {"pct_start": 0}, "pct_start must be in (0, 1); got 0"),
    ("onecycle", 10, {"pct_start": 1}, "pct_start must be in (0, 1); got 1"),
    ("onecycle", 10, {"pct_start": 1.2}, "pct_start must be in (0, 1); got 1.2"),
    ("onecycle", 10, {"pct_start": 0.1}, "pct_start * total_steps must be != 1 (OneCycleLR divides by 0; "
                                         "safe_pct_start() gives a value that works); got 1.0"),
    ("onecycle", 10, {"pct_start": 0.6, "three_phase": True},
     "pct_start must be <= 0.5 with three_phase; got 0.6"),
    ("onecycle", 10, {"div_factor": 0}, "div_factor must be a number > 0; got 0"),
    ("onecycle", 10, {"final_div_factor": -1.0}, "final_div_factor must be a number > 0; got -1.0"),
    ("onecycle", 10, {"anneal_strategy": "exp"}, "anneal_strategy must be 'cos' or 'linear'; got 'exp'"),
    ("onecycle", 10, {"warmup_steps": 2},
     "warmup_steps must be 0 for onecycle: its warm phase is set by pct_start"),
    ("cosine", 10, {"gamma": 0.1}, "unknown option 'gamma' for cosine; accepted: ['min_lr_ratio']"),
    ("constant", 10, {"step_size": 2}, "unknown option 'step_size' for constant; accepted: []"),
    ("warmup", 10, {}, "warmup_steps must be >= 1 for warmup (but 0 in a one-step run): without one it is "
                       "constant"),
    ("warmup", 2, {}, "warmup_steps must be >= 1 for warmup (but 0 in a one-step run): without one it is "
                      "constant"),
]


@pytest.mark.parametrize(("name", "T", "kwargs", "message"), BAD)
def test_bad_input_names_the_parameter_the_rule_and_the_value(name, T, kwargs, message):
    _, opt = make_optimizer()
    with pytest.raises(ValueError) as info:
        build_scheduler(opt, name, T, **kwargs)
    assert str(info.value) == message


def test_bad_counts_and_clip():
    _, opt = make_optimizer()
    for call, message in [
        (lambda: steps_per_epoch(0), "num_batches must be an int >= 1; got 0"),
        (lambda: steps_per_epoch(True), "num_batches must be an int >= 1; got True"),
        (lambda: steps_per_epoch(5, 0), "accum_steps must be an int >= 1; got 0"),
        (lambda: epochs_to_steps(-1, 5), "epochs must be a number >= 0; got -1"),
        (lambda: epochs_to_steps(True, 5), "epochs must be a number >= 0; got True"),
        (lambda: optimizer_step(opt, clip_grad=-1.0), "clip_grad must be None or a number >= 0; got -1.0"),
    ]:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


@pytest.mark.parametrize(
    "argv",
    [
        ["--schedule", "nope", "--total-steps", "5"],
        ["--schedule", "step", "--total-steps", "0"],
        ["--schedule", "step", "--total-steps", "x"],
        ["--schedule", "step", "--total-steps", "9", "--gamma", "-1"],
        ["--schedule", "cosine", "--total-steps", "9", "--lr", "-1"],
        ["--total-steps", "9"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        schedules.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ")


def test_cli_writes_a_png_only_when_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert schedules.main(["--schedule", "cosine", "--total-steps", "20"]) == 0
    assert list(tmp_path.iterdir()) == [] and "png" not in capsys.readouterr().out.lower()
    pytest.importorskip("matplotlib")
    assert schedules.main(["--schedule", "cosine", "--total-steps", "20", "--png", "c.png"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["c.png"] and "wrote c.png" in capsys.readouterr().out


def test_cli_table(capsys, tmp_path):
    png = tmp_path / "s.png"
    assert (
        schedules.main(["--schedule", "onecycle", "--total-steps", "100", "--png", str(png)]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[1:13]]
    assert len(rows) == 12 and rows[0][0] == "0" and rows[-1][0] == "99"
    assert float(rows[-1][1]) == pytest.approx(0.1 / 25 / 1e4)
    assert png.is_file() or lines[-1].startswith("matplotlib is not installed")


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("T", range(1, 13))
def test_safe_pct_start_lets_every_short_onecycle_run(T, three_phase):
    for pct in sorted({0.25, 0.3, 0.5, *(k / T for k in range(1, T))}):
        if three_phase and pct > 0.5:
            continue
        singular = float(pct * T) == 1
        safe = schedules.safe_pct_start(pct, T, three_phase)
        assert (safe != pct) == singular  # any other value keeps torch's curve exactly
        if singular and not three_phase:
            assert safe == schedules.safe_pct_start(pct, T) > pct  # two-phase is the default
        _, opt = make_optimizer()
        if singular:
            with pytest.raises(ValueError, match="safe_pct_start"):
                build_scheduler(opt, "onecycle", T, pct_start=pct, three_phase=three_phase)
        seen = run(opt, build_scheduler(opt, "onecycle", T, pct_start=safe, three_phase=three_phase), T)
        for g, base in enumerate(BASES):
            lrs = [step[g] for step in seen]
            assert all(0 < lr <= base * (1 + 1e-12) for lr in lrs), (pct, lrs)
            if singular:  # the one warm step at the initial lr, then only down
                assert lrs[0] == pytest.approx(base / 25)
                assert lrs[1:] == sorted(lrs[1:], reverse=True)
