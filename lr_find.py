"""Learning-rate range test: sweep the lr, suggest one per schedule, put back all it touched. Torch alone
(matplotlib, TensorBoard to draw): copy the file alone. `python lr_find.py` sweeps train.py's setup."""

from __future__ import annotations

import bisect
import contextlib
import copy
import hashlib
import io
import itertools
import json
import math
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# The rule per optimizer kind and schedule family (family_of), measured by bench/lr_find_rules.py
DEFAULT_RULES = {"sgd": {"peak": "minimum", "base": "min/3"}, "adaptive": {"peak": "min/3", "base": "min/10"}}
SUGGEST_SIGMA_DECADES = 0.25  # smoothing width: averages minibatch noise, keeps a 1-decade drop sharp
DIVERGED_RUN = 2  # raw losses in a row above diverge x their lowest running median that end a sweep too
PNG_SWEEP_KEY = "lr_find sweep"  # lr_find.png's text chunk naming its sweep, as lr_find.json's "sweep" does
_READ_LAG = {"cuda": 1}  # steps by which a sweep reads its losses late, by device type (0 if not here)
FIRST_LOSS_NOT_FINITE = ("the first step's loss is not finite, before any update: not the learning rate "
                         "but the data or the model (nan or inf in the inputs or targets, or a layer that "
                         "makes them)")


def lr_find(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            loss_fn: Callable[[Any, Any], torch.Tensor] | None, loader: Iterable[Any], *,
            start_lr: float | Sequence[float] = 1e-7, end_lr: float | Sequence[float] = 10.0,
            num_iter: int = 50, smooth: float = 0.9, diverge: float = 4.0, accum_steps: int = 1,
            autocast_dtype: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None,
            device: torch.device | str | None = None, schedule: str = "onecycle", method: str | None = None,
            min_iter_before_stop: int = 10, progress: Callable[[int, float, float], None] | None = None,
            batch_loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None, step_mode: str = "exp",
            val_loader: Iterable[Any] | None = None, optimizer_kind: str | None = None,
            normalizer: Callable[[Any], torch.Tensor | float] | None = None) -> LRFindResult:
    """Sweep the lr, one optimizer step a rate, until the loss blows up; put all back (docs/lr_find.md)."""
    def whole(value: Any, low: int) -> bool:
        return isinstance(value, int) and value >= low

    for ok, message in [  # a ValueError naming the first bad argument, before anything is touched
        ((loss_fn is None) != (batch_loss is None), "pass loss_fn(outputs, targets) or batch_loss(model, b)"),
        (isinstance(schedule, str), f"schedule must be a schedule's name, a str, got {schedule!r}"),
        (method is None or method in RULES, f"method must be one of {METHODS}, got {method!r}"),
        (step_mode in ("exp", "linear"), f"step_mode must be 'exp' or 'linear', got {step_mode!r}"),
        (optimizer_kind in (None, *DEFAULT_RULES), f"optimizer_kind must be None, 'sgd' or 'adaptive', got "
                                                   f"{optimizer_kind!r}"),
        (whole(num_iter, 10), f"num_iter must be an int >= 10 to suggest, got {num_iter}"),
        (0 <= smooth < 1, f"smooth must be in [0, 1), got {smooth}"),
        (diverge > 1, f"diverge must be > 1, got {diverge}"),
        (whole(accum_steps, 1), f"accum_steps must be an int >= 1, got {accum_steps}"),
        (whole(min_iter_before_stop, 0), f"min_iter_before_stop must be an int >= 0: {min_iter_before_stop}"),
        (any(p.requires_grad for p in model.parameters()), "model has no trainable parameters"),
        (any(g["params"] for g in optimizer.param_groups), "optimizer has no parameters"),
    ]:
        if not ok:
            raise ValueError(message)
    plan = _plan(optimizer, start_lr, end_lr, num_iter, step_mode)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    kind, kind_from = (optimizer_kind, "optimizer_kind argument") if optimizer_kind else _classify(optimizer)
    optimizers = _chain(optimizer) if hasattr(optimizer, "optimizer") else [optimizer]  # a wrapper's too
    pairs = batch_loss is None  # loss_fn(model(inputs), targets) on (inputs, targets) batches
    loss_of = (lambda b: loss_fn(model(b[0]), b[1])) if pairs else (lambda b: batch_loss(model, b))
    if autocast_dtype is not None:  # the forward under autocast, the backward outside, as in train.py
        loss_of = torch.autocast(device.type, dtype=autocast_dtype)(loss_of)

    def step(rates: list[float]) -> torch.Tensor:
        """One optimizer step at ``rates``, one per group: [the loss the curve reads, the training loss]."""
        for group, lr in zip(optimizer.param_groups, rates, strict=True):  # a tensor lr stays that tensor
            group["lr"] = group["lr"].fill_(lr) if isinstance(group["lr"], torch.Tensor) else lr
        optimizer.zero_grad(set_to_none=True)
        window = list(itertools.islice(batches, accum_steps))  # the step's batches
        divisor = len(window) if normalizer is None else sum(map(normalizer, window))
        total = None  # the window's mean loss, as one big batch would give
        for batch in window:  # one graph held at a time
            loss = loss_of(batch)
            loss = loss if type(divisor) is int and divisor == 1 else loss / divisor  # no kernel for 1
            total = loss.detach().float() if total is None else total + loss.detach().float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        curve = total if val_loader is None else _val_loss(  # the mean over val_loader, after the step
            model, val_loader, loss_of, normalizer, device, pairs)
        return torch.stack([curve, total]).flatten()

    taken = []  # the optimizer steps taken, one item each (its step hook below)
    with contextlib.ExitStack() as undo:  # on the way out, even on error, undo puts all back: last kept first
        moved = _snapshot(model, optimizers, scaler, undo)
        undo.enter_context(optimizers[-1].register_step_post_hook(lambda *_: taken.append(1)))
        if hasattr(loader, "__dict__"):  # a DataLoader (a loader with state): its state comes back
            loader = _keep_loader(loader, undo)
        val_loader = None if val_loader is None else _keep_loader(val_loader, undo)
        batches = _batches(loader, device, undo, pairs)
        model.train()
        lag = _READ_LAG.get(device.type, 0)
        reads = _late_reads(step, plan, device, lag) if lag else (step(rates).tolist() for rates in plan)
        with torch.enable_grad():  # a sweep trains, even when called under torch.no_grad()
            stop_reason, losses, train_losses, smoothed = _sweep(
                reads, plan, progress, smooth, diverge, min_iter_before_stop)
        stuck = None if taken and moved() else (  # a sweep that never stepped says nothing
            f"the weights never changed in {len(taken)} steps (zero gradients, or steps skipped on the "
            "device)" if taken else "every step was skipped (by a GradScaler, or an optimizer wrapper)")
        if losses and not math.isfinite(losses[0]):  # before any update: no rate is to blame
            stuck = FIRST_LOSS_NOT_FINITE
    return _result([rates[0] for rates in plan[: len(losses)]], losses, schedule, method, kind, stuck,
                   smoothed=smoothed, stop_reason=stop_reason, optimizer_kind_from=kind_from,
                   group_lrs=plan[: len(losses)], train_losses=None if val_loader is None else train_losses)


def family_of(schedule: str) -> str:
    """"peak" for onecycle, whose rate tops its cycle; "base" for any other (yours too): it starts there."""
    return "peak" if schedule == "onecycle" else "base"


@dataclass
class LRFindResult:
    """A sweep, per step, and its suggestions: "peak" and "base" (family_of), each (lr, rule)."""

    lrs: list[float]  # the first group's
    losses: list[float]  # the curve's: a val_loader's if given
    smoothed: list[float]  # what the stop rule reads
    suggestion: float | None
    stop_reason: str
    method: str
    schedule: str = "onecycle"
    suggestions: dict[str, tuple[float | None, str]] = field(default_factory=dict)
    optimizer_kind: str = "sgd"  # or "adaptive": which DEFAULT_RULES served
    optimizer_kind_from: str = ""  # how the kind was told
    group_lrs: list[list[float]] = field(default_factory=list)
    train_losses: list[float] | None = None  # with a val_loader, the training losses
    why_none: str | None = None  # why there is no suggestion
    note: str | None = None  # how the rules read the curve, where that is not plain

    def suggest(self, method: str = "minimum") -> float | None:
        """Another rule's pick from this sweep, without re-running it (None if it gave none)."""
        if method in RULES and self.why_none:
            warnings.warn(f"lr_find: no suggestion, {self.why_none}", UserWarning, stacklevel=2)
            return None
        return suggest_lr(self.lrs, self.losses, method)

    def for_schedule(self, schedule: str) -> float | None:
        """The suggestion for ``schedule``: onecycle's peak, or the rate any other starts at (family_of)."""
        return self.suggestions[family_of(schedule)][0]

    def for_groups(self, schedule: str | None = None) -> list[float] | None:
        """The suggestion per param group, in their ratio at the nearest step: onecycle's max_lr list."""
        return self.per_group(self.for_schedule(schedule or self.schedule))

    def per_group(self, lr: float | None) -> list[float] | None:
        """``lr`` for the first group, the others in their ratio to it at the step nearest ``lr``."""
        rates = lr and min(self.group_lrs or [[lr]], key=lambda r: abs(math.log(r[0] / lr)))
        return rates and [lr * (rate / rates[0]) for rate in rates]


def suggest_lr(lrs: Sequence[float], losses: Sequence[float | None], method: str = "minimum") -> float | None:
    """One rule's pick from a sweep (lr_find.json's lists too); None, with a UserWarning, if it finds none."""
    if method not in RULES:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return _read(suggestion_curve(lrs, losses), {method: method})[0][method][0]


# --- what the rules read, and the rules -------------------------------------------------------

@dataclass(frozen=True)
class SuggestionCurve:
    """The smoothed loss at the finite points in lr order; rules pick from ``first`` on (edge bias before)."""

    lrs: list[float]
    loss: list[float]
    first: int
    lowest: int
    exploded: bool  # the sweep ended in a non-finite loss, so a lowest point at the end is real
    problem: str | None  # why no rule can read this curve
    note: str | None = None  # how the rules read it, where that is not plain (a bounded loss's curve)


def suggestion_curve(lrs: Sequence[float], losses: Sequence[float | None]) -> SuggestionCurve:
    """A running median of five, then a Gaussian in log10(lr): smooth without shifting (docs/lr_find.md)."""
    pairs = [(float(lr), math.nan if v is None else float(v))  # JSON's null: a non-finite loss
             for lr, v in zip(lrs, losses, strict=True) if 0 < lr < math.inf]
    points = sorted((lr, v) for lr, v in pairs if math.isfinite(v))
    exploded = bool(points) and any(not math.isfinite(v) and lr > points[-1][0] for lr, v in pairs)
    n, lrs, raw = len(points), [p[0] for p in points], [p[1] for p in points]
    x, first = [math.log10(lr) for lr in lrs], max(2, n // 10)
    if n - max(2, n // 20) - first < 3:
        return SuggestionCurve(lrs, raw, first, first, exploded, f"only {n} usable points")
    y = raw[:1] + [sorted(raw[:3])[1]] + [sorted(raw[i - 2:i + 3])[2] for i in range(2, n - 2)]
    y += [sorted(raw[-3:])[1], raw[-1]]
    sigma = max(SUGGEST_SIGMA_DECADES, 1.5 * sorted(b - a for a, b in zip(x, x[1:], strict=False))[n // 2])
    loss = []
    for xi in x:  # four sigmas each side hold all but 1e-4 of the weight
        lo, hi = bisect.bisect_left(x, xi - 4 * sigma), bisect.bisect_right(x, xi + 4 * sigma)
        w = [math.exp(-0.5 * ((xj - xi) / sigma) ** 2) for xj in x[lo:hi]]
        loss.append(sum(wj * yj for wj, yj in zip(w, y[lo:hi], strict=True)) / sum(w))
    lowest = min(range(first, n), key=loss.__getitem__)
    problem = "the loss never decreases" if loss[lowest] >= loss[first] else None
    if lowest >= n - max(2, n // 20) and not exploded:  # still falling at the end, never blown up
        return _bounded(lrs, loss, first, lowest, problem)
    return SuggestionCurve(lrs, loss, first, lowest, exploded, problem)


def minimum(curve: SuggestionCurve) -> float | None:
    """The lr at the lowest loss, between points by a parabola through its neighbours (docs/lr_find.md)."""
    i = curve.lowest
    if i == len(curve.lrs) - 1:  # the loss still falls at the end, unless the sweep blew up
        return curve.lrs[i] if curve.exploded else None
    (x0, x1, x2), (y0, y1, y2) = [math.log10(v) for v in curve.lrs[i - 1:i + 2]], curve.loss[i - 1:i + 2]
    bend = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    vertex = x1 - 0.5 * ((x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)) / bend if bend else x1
    return 10 ** min(max(vertex, x0), x2)


def fraction_of_minimum(k: int) -> Callable[[SuggestionCurve], float | None]:
    """A k-th of ``minimum``: a third for SGD's start and Adam's peak, a tenth for Adam's start."""
    return lambda curve: None if (lr := minimum(curve)) is None else lr / k


RULES: dict[str, Callable[[SuggestionCurve], float | None]] = {
    "minimum": minimum, "min/3": fraction_of_minimum(3), "min/10": fraction_of_minimum(10)}
METHODS = tuple(RULES)


# --- saving and drawing a sweep ---------------------------------------------------------------

def save_sweep(result: LRFindResult, config: dict, out_dir: Any, extra: dict | None = None,
               schedules: Iterable[str] = ()) -> list[Any]:
    """Write lr_find.json (with ``config``, ``extra``), lr_find.png and its TensorBoard image; return them."""
    (out_dir := Path(out_dir)).mkdir(parents=True, exist_ok=True)
    finite = {k: getattr(result, k) and [v if math.isfinite(v) else None for v in getattr(result, k)]
              for k in ("losses", "smoothed", "train_losses")}  # JSON has no NaN
    served = _served(result, schedules)
    record = {**asdict(result), **finite, "config": config,
              "suggestions": {f: {"lr": lr, "method": rule, "schedules": served[f], "group_lrs":
                                  result.per_group(lr)} for f, (lr, rule) in result.suggestions.items()},
              **(extra or {})}
    # Both name the sweep: --lr auto tells a kill -9 between the two writes
    record["sweep"], drawn = sweep_id(record["lrs"], record["losses"]), io.BytesIO()
    try:
        plot = plot_lr_find(result, schedules=schedules)
        plot.savefig(drawn, format="png", metadata={PNG_SWEEP_KEY: record["sweep"]})
        picture = _write_atomically(out_dir / "lr_find.png", drawn.getvalue())
    except ImportError as err:
        picture = f"no plot (pip install {err.name or 'matplotlib'})"
    wrote = [_write_atomically(out_dir / "lr_find.json", json.dumps(record, indent=2).encode()), picture]
    if isinstance(picture, Path):
        try:
            from matplotlib.image import imread
            from torch.utils.tensorboard import SummaryWriter
            pixels = (imread(io.BytesIO(drawn.getvalue()), format="png")[..., :3] * 255).round()
            with SummaryWriter(str(out_dir / "lr_find"), purge_step=0) as writer:  # a re-run replaces it
                writer.add_image("lr_find", pixels.astype("uint8"), dataformats="HWC")
        except ImportError as err:
            wrote.append(f"no TensorBoard image (pip install {err.name or 'tensorboard'})")
    return wrote


def sweep_id(lrs: Sequence[float], losses: Sequence[float | None]) -> str:
    """A short name for a sweep, from its lrs and losses as lr_find.json holds them (null: non-finite)."""
    return hashlib.sha256(json.dumps([list(lrs), list(losses)]).encode()).hexdigest()[:12]


def plot_lr_find(result: LRFindResult, ax: Any = None, schedules: Iterable[str] = ()) -> Any:
    """Loss against lr, each suggestion marked (docs/lr_find.md), on ``ax`` or a new Figure; returns it."""
    from matplotlib.figure import Figure
    ax = ax or Figure(figsize=(7, 4.5), dpi=120, layout="constrained").add_subplot()
    raw = [(lr, v) for lr, v in zip(result.lrs, result.losses, strict=True) if math.isfinite(v)]
    if raw:
        ax.plot(*zip(*raw, strict=True), color="tab:blue", alpha=0.3, linewidth=1, label="loss per step")
    curve = suggestion_curve(result.lrs, result.losses)
    if not curve.problem:
        ax.plot(curve.lrs, curve.loss, color="tab:blue", linewidth=2, label="smoothed: what the rules read")
        descent = curve.loss[: curve.lowest + 1]
        low, high = min(descent + [v for _, v in raw]), max(descent + [raw[0][1]])
        pad = 0.08 * (high - low)  # > 0: the curve falls from its first point, never below the raw losses
        ax.set_ylim(low - pad, high + pad)  # the blow-up may leave the top; the descent stays readable
    served = _served(result, schedules)
    for family, (lr, rule) in result.suggestions.items():
        chosen = family == family_of(result.schedule)
        name = "onecycle peak" if family == "peak" else ("/".join(served[family]) or "other schedules")
        if lr is not None:
            ax.axvline(lr, color="tab:red" if chosen else "tab:gray", linestyle="-" if chosen else "--",
                       linewidth=2.5 if chosen else 1, label=f"{name} ({rule}): {lr:.3g}")
    ax.set_xscale("log")
    ax.set(xlabel="learning rate", ylabel="loss" if result.train_losses is None else "validation loss",
           title=f"LR range test, {len(result.lrs)} steps, {result.stop_reason}; red: for --schedule "
           f"{result.schedule}")
    if ax.get_legend_handles_labels()[0]:  # a sweep of no finite loss draws nothing to name
        ax.legend(loc="lower left", fontsize="small")
    return ax.figure


# --- the command line -------------------------------------------------------------------------
# pragma: no mutate start (the CLI is not in the mutation score; docs/testing.md)

def main(argv: list[str] | None = None) -> None:
    """`python lr_find.py [--flag ...]`: the range test on the run train.py would train, for its --lr auto."""
    try:  # the run's setup, as train.py builds it: lr_find() above needs none of this
        from tqdm import tqdm

        import task
        from configs import TRAIN_SETTINGS, UserError, command_line, parse_config
        from machinery import checkpoints, files, processes, run_folder, stops
        from models import OPTIMIZERS, build_optimizer
        from schedules import SCHEDULES
        from train import CHOICES, setup
    except ImportError as err:
        raise SystemExit(f"error: python lr_find.py sweeps train.py's setup and needs the template's other "
                         f"files ({err.name} is missing); `from lr_find import lr_find` works alone") from err
    if (world_size := int(os.environ.get("WORLD_SIZE", "1"))) > 1 and os.environ.get("RANK", "0") != "0":
        raise SystemExit(0)  # under torchrun one sweep is enough: rank 0 runs it, the others leave
    warnings.filterwarnings("ignore", "lr_find: no suggestion")  # said below, in the one error line
    with stops.one_line("; lr_find wrote nothing and the model is as it was: run the command again", status=1,
                        caught=ValueError,  # a UserError, or a bad argument of lr_find()'s
                        program=__name__ == "__main__"):  # called in-process: a signal goes on to the caller
        cfg = parse_config(argv, "Learning-rate range test on train.py's setup.",
                           {**CHOICES, "find_method": METHODS}, offered=TRAIN_SETTINGS)
        run_folder.claim(Path(cfg.out_dir))  # fail now, not after the sweep; one run in a folder
        device = processes.pick_device(cfg.device, cfg.deterministic)
        splits, info, model = setup(cfg, task, device)  # seeded by --seed first
        print(*info.notes, sep="\n")
        if hasattr(model, "turns"):  # a sweep steps one optimizer on one loss
            raise UserError(f"lr_find.py sweeps one optimizer and {cfg.model} trains networks in turn: sweep "
                            "one with lr_find() in your own code (docs/own_code.md), then train with --lr")
        optimizer = build_optimizer(model, cfg, cfg.find_start_lr)
        amp_dtype, scaler = processes.amp_setup(device, cfg.amp)  # fresh, as train.py's is here
        stream = (batch for epoch in itertools.count() for batch in splits.train.epoch(epoch))
        with splits, contextlib.closing(stream), tqdm(total=cfg.find_iters, desc="lr_find", leave=False,
                                                       disable=None) as bar:  # None: no bar without a TTY
            result = lr_find(model, optimizer, lambda out, y: task.loss(out, y, cfg=cfg, info=info), stream,
                             start_lr=cfg.find_start_lr, end_lr=cfg.find_end_lr, num_iter=cfg.find_iters,
                             normalizer=lambda batch: task.normalizer(batch[1], cfg, info),
                             accum_steps=cfg.accum_steps, autocast_dtype=amp_dtype, scaler=scaler,
                             schedule=cfg.schedule, progress=lambda i, lr, loss: bar.update(),
                             method=None if cfg.find_method == "auto" else cfg.find_method,
                             optimizer_kind=OPTIMIZERS[cfg.optimizer].kind)
        record = {**cfg.to_dict(), "task": checkpoints.task_identity(task)}  # what --lr auto checks
        with files.reporting_write_errors(cfg.out_dir):
            wrote = save_sweep(result, record, cfg.out_dir, schedules=SCHEDULES)
        alone = "; rank 0 runs it" if world_size > 1 else ""  # said once written: `| head` may close stdout
        print(f"lr_find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
              f"{result.stop_reason}{alone}{f'; {result.note}' if result.note else ''}; wrote "
              f"{', '.join(map(str, wrote))}")
        if result.suggestion is None:
            fix = "" if result.why_none == FIRST_LOSS_NOT_FINITE else (
                "; widen --find-start-lr/--find-end-lr or raise --find-iters, and look at lr_find.png")
            raise UserError(f"no learning rate suggested ({result.why_none}){fix}", 1)
        served, chosen = _served(result, SCHEDULES), family_of(result.schedule)
        print(f"suggested lr: {result.suggestion:.3g} ({result.method}) for --schedule {result.schedule}", *(
            f"; for {'/'.join(served[f])}: {lr:.3g} ({rule})" for f, (lr, rule) in result.suggestions.items()
            if lr and f != chosen), sep="")
        sweep_only = tuple(name for name in cfg.to_dict() if name == "lr" or name.startswith("find_"))
        processes.say(f"next: {command_line('train.py', cfg, leave_out=sweep_only)} --lr auto")


# pragma: no mutate end
# --- internals: the plan, suggestions, files, batches and the sweep ----------------------------

def _plan(optimizer, start_lr, end_lr, num_iter: int, step_mode: str) -> list[list[float]]:
    """Each step's lr per group: lists give each its own; one rate is the first's, the others in ratio."""
    groups, lists = optimizer.param_groups, [isinstance(v, (list, tuple)) for v in (start_lr, end_lr)]
    if any(lists) and not (all(lists) and len(start_lr) == len(end_lr) == len(groups)):
        raise ValueError(f"start_lr and end_lr as lists need one rate each per param group ({len(groups)}), "
                         f"got start_lr={start_lr}, end_lr={end_lr}")
    first, n = float(groups[0]["lr"]), len(groups)
    starts, ends, scales = (start_lr, end_lr, [1.0] * n) if any(lists) else (
        [start_lr] * n, [end_lr] * n, [float(g["lr"]) / first if first else 1.0 for g in groups])
    if not all(0 < s < e < math.inf for s, e in zip(starts, ends, strict=True)):
        raise ValueError(f"start_lr and end_lr need 0 < start_lr < end_lr < inf, got start_lr={start_lr}, "
                         f"end_lr={end_lr}")
    exp, steps = step_mode == "exp", [i / (num_iter - 1) for i in range(num_iter)]
    return [[(e if t == 1 else s * (e / s) ** t if exp else s + (e - s) * t) * k
             for s, e, k in zip(starts, ends, scales, strict=True)] for t in steps]


def _chain(optimizer: Any) -> list[Any]:  # the optimizer and those it wraps in .optimizer (accelerate's)
    chain = [optimizer]
    while isinstance(getattr(chain[-1], "optimizer", None), torch.optim.Optimizer):
        chain.append(chain[-1].optimizer)
    return chain


def _classify(optimizer: Any) -> tuple[str, str]:
    """("sgd" or "adaptive", why): betas, eps or etas make steps whose size ignores the gradient's scale."""
    chain = _chain(optimizer)
    signs, name = sorted({"betas", "eps", "etas"} & set(chain[-1].defaults)), " in ".join(
        type(o).__name__ for o in reversed(chain))
    return ("adaptive" if signs else "sgd"), f"{name}: {', '.join(signs) or 'no betas, eps or etas'}"


def _bounded(lrs: list[float], loss: list[float], first: int, lowest: int, problem) -> SuggestionCurve:
    """A curve still falling at the end of a sweep that never blew up: read up to its rise, if any."""
    fall, low = loss[first] - loss[lowest], first
    for k in range(first, lowest):
        low = k if loss[k] < loss[low] else low
        if loss[first] - loss[low] >= fall / 2 and loss[k] - loss[low] >= fall / 4 > 0:
            note = (f"the loss rose after {lrs[low]:.3g} and fell again, never blowing up (a bounded loss?): "
                    "the rules read the curve up to that rise")
            return SuggestionCurve(lrs, loss, first, low, False, problem, note)
    return SuggestionCurve(lrs, loss, first, lowest, False, problem)


def _read(curve: SuggestionCurve, rules: dict[str, str], stuck: str | None = None) -> tuple[dict, str | None]:
    """Each rule's pick (none for a ``stuck`` sweep), and why some found none, said in one warning."""
    picks = {name: (None if stuck or curve.problem else RULES[rule](curve), rule)
             for name, rule in rules.items()}
    # With a readable curve a rule finds none only where its lowest point is the sweep's last
    why = None if all(lr for lr, _ in picks.values()) else (
        stuck or curve.problem or "the loss was still falling at the end of the sweep (raise end_lr)")
    if why:
        warnings.warn(f"lr_find: no suggestion, {why}", UserWarning, stacklevel=4)
    return picks, why


def _result(lrs, losses, schedule, method, kind, stuck=None, **fields) -> LRFindResult:
    """Each suggestion read from ``losses`` by ``kind``'s rules (``schedule``'s by ``method`` if given)."""
    chosen, rules, curve = family_of(schedule), DEFAULT_RULES[kind], suggestion_curve(lrs, losses)
    picks, why = _read(curve, {**rules, chosen: method or rules[chosen]}, stuck)
    fields.setdefault("group_lrs", [[lr] for lr in lrs])
    return LRFindResult(lrs, losses, suggestion=picks[chosen][0], method=picks[chosen][1], schedule=schedule,
                        suggestions=picks, optimizer_kind=kind, why_none=why, note=curve.note, **fields)


def _served(result: LRFindResult, schedules: Iterable[str]) -> dict[str, list[str]]:
    """The schedules each of the result's suggestions serves, as save_sweep says (family_of)."""
    names = dict.fromkeys([*schedules, "onecycle", result.schedule])
    return {family: [name for name in names if family_of(name) == family] for family in result.suggestions}


def _write_atomically(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as err:  # named after the file the user knows, not the temporary one
        raise OSError(err.errno, err.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _batches(loader, device: torch.device, undo: contextlib.ExitStack, pairs: bool) -> Iterator[Any]:
    """The loader's batches, started again as often as needed; pairs of tensors on ``device`` as they come."""
    batches = undo.enter_context(contextlib.closing(_cycle(loader)))  # DataLoader workers stop there
    first = next(batches)
    if isinstance(first, (list, tuple)) and len(first) == 2 and all(
            isinstance(t, torch.Tensor) and t.device == device for t in first):
        return itertools.chain([first], batches)
    first = _pair(_to_device(first, device)) if pairs else _to_device(first, device)  # any other: moved whole
    return itertools.chain([first], (_to_device(batch, device) for batch in batches))


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:  # a sweep longer than the loader starts it again
    for passes in itertools.count():
        served = 0
        for served, batch in enumerate(loader, 1):  # noqa: B007 (served counts the batches)
            yield batch
        if not served:
            raise ValueError("loader is empty: it yielded no batches" if passes == 0 else "loader is empty "
                             "on re-iteration (a one-shot iterator?): lr_find needs a loader it can iterate "
                             "again when num_iter * accum_steps exceeds its length")


def _to_device(obj: Any, device: torch.device) -> Any:
    """A batch on ``device`` whole, at any depth (mappings as dicts); what has a ``.to`` moves itself."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if callable(getattr(obj, "to", None)):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_to_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _pair(batch: Any) -> Any:
    """``batch`` if it is the (inputs, targets) pair loss_fn needs; else an error that names the hook."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch
    what = type(batch).__name__ + (f" with keys {list(batch)}" if isinstance(batch, Mapping) else
                                   f" of {len(batch)}" if isinstance(batch, (list, tuple)) else "")
    raise ValueError(f"lr_find: loss_fn(model(inputs), targets) needs (inputs, targets) batches, got a "
                     f"{what}; pass loss_fn=None and batch_loss=, a function (model, batch) -> loss, such "
                     "as lambda model, batch: model(**batch).loss")


def _val_loss(model, val_loader, loss_of, normalizer, device, pairs: bool) -> torch.Tensor:
    """The loss the curve reads with a val_loader: its mean over it, in eval mode."""
    model.eval()
    with torch.no_grad():
        window = [_to_device(batch, device) for batch in val_loader]
        if not window:
            raise ValueError("val_loader is empty: it yielded no batches")
        divisor = len(window) if normalizer is None else sum(map(normalizer, window))
        total = sum(loss_of(_pair(b) if pairs else b).detach().float() for b in window) / divisor
    model.train()
    return total.float()  # as the training loss is read


def _late_reads(step, plan: list[list[float]], device: torch.device, lag: int) -> Iterator[list[float]]:
    """``step`` per row of ``plan``, its losses read ``lag`` steps late: on CUDA the GPU never drains."""
    cuda = device.type == "cuda"
    rows = torch.empty((len(plan), 2), dtype=torch.float32, pin_memory=cuda).unbind()  # no select a step
    events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else []
    for i in range(len(plan) + lag):  # step i, then read step i - lag
        if i < len(plan):
            rows[i].copy_(step(plan[i]), non_blocking=cuda)
            if cuda:
                events[i % 2].record(torch.cuda.current_stream(device))
        if i < lag:
            continue
        if cuda:  # step i - lag's copy to the host has landed
            events[(i - lag) % 2].synchronize()
        yield rows[i - lag].tolist()


def _sweep(reads: Iterator[list[float]], plan: list[list[float]], progress, smooth: float, diverge: float,
           min_iter_before_stop: int) -> tuple[str, list[float], list[float], list[float]]:
    """Each step's [curve loss, training loss] from ``reads``, until the stop rule (docs/lr_find.md) fires."""
    losses, train_losses, smoothed = [], [], []
    average, floor, high_run = 0.0, math.inf, 0  # the moving average, lowest median of 5, high raw losses
    for n, (loss, train_loss) in enumerate(reads):
        if progress is not None:
            progress(n, plan[n][0], loss)
        losses.append(loss)
        train_losses.append(train_loss)
        if not math.isfinite(loss):
            smoothed.append(math.nan)
            return "non-finite loss", losses, train_losses, smoothed
        average = smooth * average + (1 - smooth) * loss
        smoothed.append(average / (1 - smooth ** (n + 1)))
        best, recent = min(smoothed), sorted(losses[-5:])  # all finite: a non-finite one stops it
        floor = min(floor, recent[len(recent) // 2])  # a running median barely lags
        high_run = high_run + 1 if loss > diverge * floor else 0
        blown_up = (best > 0 and smoothed[-1] > diverge * best) or (floor > 0 and high_run >= DIVERGED_RUN)
        if n >= min_iter_before_stop and blown_up:
            return "diverged", losses, train_losses, smoothed
    return "completed", losses, train_losses, smoothed


# --- internals: snapshot and restore ----------------------------------------------------------

def _snapshot(model, optimizers: list[Any], scaler, undo: contextlib.ExitStack) -> Callable[[], bool]:
    """Keep for ``undo`` all a step may change, global RNGs too; returns a test: did a trained weight move?"""
    undo.callback(model.zero_grad, set_to_none=True)  # run last, so on the parameters as put back
    undo.callback(optimizers[-1].zero_grad, set_to_none=True)
    owners = [*model.modules(), *optimizers, *([scaler] if scaler is not None else [])]
    values = _keep([*map(vars, owners), *optimizers[0].param_groups], undo)
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else ()
    undo.enter_context(torch.random.fork_rng(cuda, device_type="cuda"))
    undo.callback(random.setstate, random.getstate())
    if (numpy := sys.modules.get("numpy")) is not None:  # touched only when the caller imported it
        undo.callback(numpy.random.set_state, numpy.random.get_state())
    weights = [(t, value) for t, value in values if t.requires_grad]
    return lambda: any(not torch.equal(t.detach(), value.to(t.device)) for t, value in weights)


def _keep(owners: list[dict], undo: contextlib.ExitStack) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For ``undo``: put back these dicts, those in them, and tensors' values in place; (tensor, copy)s."""
    dicts, leaves, todo = {}, {}, list(owners)
    while todo:
        obj = todo.pop()
        if not isinstance(obj, dict):
            leaves[id(obj)] = obj
        elif id(obj) not in dicts:  # each dict once, however many hold it
            dicts[id(obj)] = obj, dict(obj)
            todo += [*obj.keys(), *obj.values()]
    values = [(t, t.detach().to("cpu", copy=True)) for t in leaves.values() if isinstance(t, torch.Tensor)]
    for leaf in leaves.values():
        if isinstance(leaf, torch.Generator):
            undo.callback(leaf.set_state, leaf.get_state())
        elif isinstance(leaf, random.Random):
            undo.callback(leaf.setstate, leaf.getstate())

    def put_back() -> None:
        for live, items in dicts.values():
            live.clear()
            live.update(items)
        with torch.no_grad():
            for tensor, value in values:
                tensor.copy_(value)

    undo.callback(put_back)
    return values


def _keep_loader(loader: Iterable[Any], undo: contextlib.ExitStack) -> Iterable[Any]:
    """The loader to sweep, its samplers' state kept for ``undo``; with persistent workers, a copy."""
    parts = [loader, getattr(loader, "sampler", None), batches := getattr(loader, "batch_sampler", None),
             getattr(batches, "sampler", None)]
    _keep([vars(o) for o in parts if hasattr(o, "__dict__")], undo)  # one named twice is kept once
    if hasattr(type(getattr(loader, "dataset", None)), "__next__"):
        warnings.warn(f"lr_find: the DataLoader's dataset is an iterator ({type(loader.dataset).__name__}): "
                      "the sweep used up what it drew; give lr_find a loader of its own, or the dataset an "
                      "__iter__ that starts afresh", UserWarning, stacklevel=3)
    if isinstance(loader, torch.utils.data.DataLoader) and loader.persistent_workers:
        loader = copy.copy(loader)
        vars(loader)["persistent_workers"] = False
    return loader


if __name__ == "__main__":
    main()
