"""Learning-rate schedules counted in optimizer steps, and the optimizer step that steps them.

Torch and the standard library only, so it can be copied alone into another project (docs/schedules.md).
Preview a schedule: python schedules.py --schedule cosine --total-steps 1000 --warmup-steps 50
(a table; add --png PATH for a plot)"""

from __future__ import annotations

import functools
import math
import sys
import warnings
import weakref
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

# Each schedule's options and their defaults (None: set from the run; docs/schedules.md). Its names are
# the one list of schedules: SCHEDULES, which configs/ and the tests read.
_OPTIONS = {
    "constant": {},
    "step": {"step_size": None, "gamma": 0.1},
    "onecycle": {"max_lr": None, "pct_start": 0.3, "div_factor": 25.0, "final_div_factor": 1e4,
                 "anneal_strategy": "cos", "three_phase": False},  # torch's OneCycleLR's defaults
    "warmup": {},
    "cosine": {"min_lr_ratio": 0.0},
}
SCHEDULES = tuple(_OPTIONS)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check(condition: bool, name: str, expected: str, value: object) -> None:
    _require(condition, f"{name} must be {expected}; got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def steps_per_epoch(num_batches: int, accum_steps: int = 1) -> int:
    """Optimizer steps per epoch: the last, partial accumulation window still steps."""
    _check(_is_int(num_batches) and num_batches >= 1, "num_batches", "an int >= 1", num_batches)
    _check(_is_int(accum_steps) and accum_steps >= 1, "accum_steps", "an int >= 1", accum_steps)
    return -(-num_batches // accum_steps)


def epochs_to_steps(epochs: float, num_batches: int, accum_steps: int = 1) -> int:
    """Convert a length given in (possibly fractional) epochs to optimizer steps, rounded."""
    _check(_is_real(epochs) and epochs >= 0, "epochs", "a number >= 0", epochs)
    return round(epochs * steps_per_epoch(num_batches, accum_steps))


def safe_pct_start(pct_start: float, total_steps: int, three_phase: bool = False) -> float:
    """pct_start, nudged off the one value that breaks OneCycleLR: pct_start * total_steps == 1."""
    if float(pct_start * total_steps) != 1:
        return pct_start
    return pct_start * (1 - 1e-9 if three_phase else 1 + 1e-9)


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, total_steps: int, *, warmup_steps: int = 0,
                    **options: object) -> LRScheduler:
    """Schedule `name` over `total_steps` optimizer steps, stepped after each one (optimizer_step does).
    Options left out or None take their defaults (_OPTIONS); each one's meaning: docs/schedules.md."""
    _require(name in SCHEDULES, f"name must be one of {', '.join(SCHEDULES)}; got {name!r}")
    _check(_is_int(total_steps) and total_steps >= 1, "total_steps", "an int >= 1", total_steps)
    ok = _is_int(warmup_steps) and 0 <= warmup_steps < total_steps
    _check(ok, "warmup_steps", f"an int in [0, total_steps) = [0, {total_steps})", warmup_steps)
    accepted = list(_OPTIONS[name])
    for key in options:
        _require(key in accepted, f"unknown option {key!r} for {name}; accepted: {accepted}")
    options = _OPTIONS[name] | {key: value for key, value in options.items() if value is not None}
    if name == "onecycle":
        return _onecycle(optimizer, total_steps, warmup_steps, options)
    return _lambda_schedule(optimizer, name, total_steps, warmup_steps, options)


def _onecycle(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
              options: dict) -> OneCycleLR:
    """torch's OneCycleLR, its options checked; momentum cycles only where every group has some."""
    _require(warmup_steps == 0, "warmup_steps must be 0 for onecycle: its warm phase is set by pct_start")
    groups, max_lr, pct_start = optimizer.param_groups, options["max_lr"], options["pct_start"]
    peaks = [float(group.get("max_lr", group["lr"])) for group in groups]  # its lr, or a loaded state's peak
    lrs = list(max_lr) if isinstance(max_lr, list | tuple) else [max_lr] * len(groups)
    if max_lr is None:
        lrs = peaks
    ok = len(lrs) == len(groups) and all(_is_real(lr) and lr >= 0 for lr in lrs)
    _check(ok, "max_lr", f"a number >= 0 or a list of {len(groups)}, one per group", max_lr)
    if not isinstance(max_lr, list | tuple | None) and peaks[0]:  # the first group's peak
        lrs = [max_lr * (peak / peaks[0]) for peak in peaks]
    _check(_is_real(pct_start) and 0 < pct_start < 1, "pct_start", "in (0, 1)", pct_start)
    _check(not options["three_phase"] or pct_start <= 0.5, "pct_start", "<= 0.5 with three_phase", pct_start)
    product = float(pct_start * total_steps)
    expected = "!= 1 (OneCycleLR divides by 0; safe_pct_start() gives a value that works)"
    _check(product != 1, "pct_start * total_steps", expected, product)
    for key in ("div_factor", "final_div_factor"):
        _check(_is_real(options[key]) and options[key] > 0, key, "a number > 0", options[key])
    strategy = options["anneal_strategy"]
    _check(strategy in ("cos", "linear"), "anneal_strategy", "'cos' or 'linear'", strategy)
    momenta = [_momentum(group) for group in groups]  # OneCycleLR reads them only when it cycles
    return _OneCycleLR(optimizer, total_steps=total_steps, **(options | {"max_lr": lrs}),
                       cycle_momentum=all(m > 0 for m in momenta),
                       base_momentum=[min(0.85, m) for m in momenta], max_momentum=momenta)


def _momentum(group: dict) -> float:
    """The group's own momentum, or the top of the cycle a onecycle schedule set in it."""
    if "max_momentum" in group:
        return float(group["max_momentum"])
    return float(group["betas"][0]) if "betas" in group else float(group.get("momentum", 0.0))


def _lambda_schedule(optimizer: torch.optim.Optimizer, name: str, total_steps: int, warmup_steps: int,
                     options: dict) -> LambdaLR:
    """constant, warmup, step or cosine: torch's LambdaLR over _lr_factor, the options checked first. step is
    StepLR's closed form in a LambdaLR, as the others: one class holds warmup, the past-end hold, resume."""
    _require(name != "warmup" or warmup_steps >= 1 or total_steps == 1,
             "warmup_steps must be >= 1 for warmup (but 0 in a one-step run): without one it is constant")
    if name == "step":
        if options["step_size"] is None:
            options["step_size"] = math.ceil((total_steps - warmup_steps) / 3)  # >= 1: warmup_steps < total
        step_size, gamma = options["step_size"], options["gamma"]
        _check(_is_int(step_size) and step_size >= 1, "step_size", "an int >= 1", step_size)
        _check(_is_real(gamma) and gamma > 0, "gamma", "a number > 0", gamma)
    if name == "cosine":
        ratio = options["min_lr_ratio"]
        _check(_is_real(ratio) and 0 <= ratio <= 1, "min_lr_ratio", "in [0, 1]", ratio)
    factor = functools.partial(_lr_factor, kind=name, total_steps=total_steps, warmup_steps=warmup_steps,
                               **options)
    return _LambdaLR(optimizer, factor, name, total_steps)


def _lr_factor(step: int, *, kind: str, total_steps: int, warmup_steps: int, step_size: int = 1,
               gamma: float = 1.0, min_lr_ratio: float = 0.0) -> float:
    """The base lr's factor before optimizer step `step` (< total_steps): a linear warmup, then `kind`'s."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    k = step - warmup_steps
    if kind == "step":
        return gamma ** (k // step_size)
    if kind == "cosine":
        cosine = 0.5 * (1 + math.cos(math.pi * k / (total_steps - warmup_steps)))
        return min_lr_ratio + (1 - min_lr_ratio) * cosine
    return 1.0


class _Counted:
    """Past total_steps the last rate holds (one warning); a loaded state sets the saved rates."""

    schedule: str
    total_steps: int
    _warned_past_end = False  # set on the instance, so its state_dict keeps it

    def get_lr(self) -> list:
        step = self.last_epoch
        if step > self.total_steps:
            self._warn_past_end()
        self.last_epoch = min(step, self.total_steps - 1)
        try:
            return super().get_lr()
        finally:
            self.last_epoch = step

    def _warn_past_end(self) -> None:
        if not self._warned_past_end:
            self._warned_past_end = True
            warnings.warn(f"the {self.schedule} schedule was stepped past its total_steps "
                          f"({self.total_steps}) and holds its last rate; the usual cause is a second "
                          "scheduler.step() per epoch beside the one after each optimizer step "
                          "(optimizer_step makes that one)", UserWarning, stacklevel=5)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "use get_last_lr()": this call sets the rates
            rates = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


class _LambdaLR(_Counted, LambdaLR):
    def __init__(self, optimizer: torch.optim.Optimizer, factor, schedule: str, total_steps: int):
        self.schedule, self.total_steps = schedule, total_steps
        super().__init__(optimizer, factor)

    def load_state_dict(self, state_dict: dict) -> None:
        # The length stays the one built for: a resume with more epochs (constant, warmup, step) trains on.
        super().load_state_dict({**state_dict, "total_steps": self.total_steps})


class _OneCycleLR(_Counted, OneCycleLR):
    schedule = "onecycle"


# The scale each GradScaler had after optimizer_step's last update(): a fused optimizer's skip shrinks it.
_scale_after_update = weakref.WeakKeyDictionary()


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None = None,
                   scaler: torch.amp.GradScaler | None = None, *, clip_grad: float | None = None,
                   parameters: Iterable[torch.Tensor] | None = None) -> bool:
    """Step the optimizer, then the scheduler only if the optimizer really stepped; return whether it did.
    clip_grad (None or 0: off) clips the grad norm of `parameters` (default: the optimizer's) first."""
    ok = clip_grad is None or (_is_real(clip_grad) and clip_grad >= 0)
    _check(ok, "clip_grad", "None or a number >= 0", clip_grad)
    if clip_grad and parameters is None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
    # A GradScaler or a wrapper (accelerate's AcceleratedOptimizer and the like) may skip the step.
    if scaler is not None or hasattr(optimizer, "optimizer") or hasattr(optimizer, "gradient_state") or (
            hasattr(optimizer, "step_was_skipped")):
        return _step_unless_skipped(optimizer, scheduler, scaler, clip_grad=clip_grad, parameters=parameters)
    if clip_grad:
        torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return True


def _step_unless_skipped(optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None,
                         scaler: torch.amp.GradScaler | None, *, clip_grad: float | None,
                         parameters: Iterable[torch.Tensor] | None) -> bool:
    """optimizer_step with a GradScaler or a wrapper: the step counts when the torch optimizer inside ran
    it (a step hook tells) and no wrapper reports `step_was_skipped`."""
    if not getattr(getattr(optimizer, "gradient_state", None), "sync_gradients", True):
        scaler = clip_grad = None  # between gradient syncs: the wrapper's step() does nothing
    inner = optimizer  # the torch optimizer inside wrappers that keep it in `.optimizer`
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    plain = scaler is None and inner is optimizer  # steps for sure: no hook to tell
    called: list[bool] = []
    hook = None if plain else inner.register_step_post_hook(lambda *_: called.append(True))
    try:
        if clip_grad:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
    finally:
        if hook is not None:
            hook.remove()
    stepped = (plain or bool(called)) and not getattr(optimizer, "step_was_skipped", False)
    if scaler is not None:
        # A fused optimizer (GradScaler's own test) is called even on a skipped step and skips on the
        # device: the scale, read once after update(), tells (a skip shrinks it).
        skips_on_device = scaler.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False)
        if skips_on_device and scaler not in _scale_after_update:
            _scale_after_update[scaler] = scaler.get_scale()  # first call with this scaler: one extra read
        scaler.update()
        if skips_on_device:
            before, after = _scale_after_update[scaler], scaler.get_scale()
            _scale_after_update[scaler] = after
            stepped = stepped and after >= before
    if stepped and scheduler is not None:
        scheduler.step()
    return stepped


# pragma: no mutate block (the preview CLI below is not in the mutation score; docs/testing.md)
def main(argv: list[str] | None = None) -> int:
    """Preview a schedule on a dummy SGD optimizer (momentum 0.9): a table of lr and momentum,
    and a plot only when --png PATH is given (nothing is written otherwise)."""
    import argparse  # the preview's alone
    from typing import NoReturn

    def fail(message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.error = fail
    parser.add_argument("--schedule", required=True, choices=SCHEDULES)
    parser.add_argument("--total-steps", required=True, type=int)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=0)
    names = ("step_size", "gamma", "min_lr_ratio", "pct_start", "div_factor", "final_div_factor")
    for key in names:
        parser.add_argument("--" + key.replace("_", "-"), type=int if key == "step_size" else float)
    parser.add_argument("--png", metavar="PATH", help="also plot the lr into this PNG file (needs "
                        "matplotlib); without --png nothing is written")
    args = parser.parse_args(argv)
    options = {key: getattr(args, key) for key in names if getattr(args, key) is not None}
    try:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr, momentum=0.9)
        scheduler = build_scheduler(optimizer, args.schedule, args.total_steps,
                                    warmup_steps=args.warmup_steps, **options)
    except ValueError as exc:
        fail(str(exc))
    lrs, momenta = [], []
    for _ in range(args.total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        momenta.append(optimizer.param_groups[0]["momentum"])
        optimizer.step()
        scheduler.step()
    last = args.total_steps - 1
    print(f"{'step':>8}  {'lr':>12}  {'momentum':>8}")
    for k in sorted({round(i * last / 11) for i in range(12)}):
        print(f"{k:>8}  {lrs[k]:>12.6g}  {momenta[k]:>8.4g}")
    if not args.png:
        return 0
    try:
        from matplotlib.figure import Figure  # no pyplot state or GUI backend involved
    except ImportError:
        print("matplotlib is not installed; no PNG written")
        return 0
    ax = Figure(figsize=(7, 3.5), layout="tight").add_subplot()
    ax.plot(lrs)
    title = f"{args.schedule} ({args.total_steps} steps)"
    ax.set(xlabel="optimizer step", ylabel="learning rate", title=title)
    try:
        ax.figure.savefig(args.png)
    except OSError as exc:
        fail(f"cannot write {args.png}: {exc}")
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
