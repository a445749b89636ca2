"""Learning-rate range test: sweep the lr exponentially, record the loss, suggest an lr per schedule.

One sweep serves every schedule, but not with one number: onecycle's peak tolerates rates up to
where the sweep's loss bottoms out; schedules that start at their full rate need less, and with an
Adam-like optimizer much less. All a sweep touches is put back bit for bit. The library needs only
torch (matplotlib and TensorBoard only to draw), so this file can be copied alone.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import io
import itertools
import json
import math
import os
import random
import sys
import warnings
from collections import deque, namedtuple
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# What each schedule takes from a sweep: onecycle its peak, the others the rate they start at.
SCHEDULES = {"onecycle": "peak", "constant": "base", "step": "base", "cosine": "base", "warmup": "base"}
_SERVED = {family: [s for s, f in SCHEDULES.items() if f == family] for family in ("peak", "base")}
# The rule per optimizer kind and schedule, as bench/lr_find_rules.py measured (README, "Learning rate"):
# started at full rate with no warmup, Adam-like optimizers blow up well below the sweep's bottom,
# and even under onecycle's warmup their best peak sits a little below it.
DEFAULT_RULES = {"sgd": {"peak": "minimum", "base": "min/3"},
                 "adaptive": {"peak": "min/3", "base": "min/10"}}
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
            torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)
SUGGEST_SIGMA_DECADES = 0.25  # smoothing width: averages minibatch noise, keeps a 1-decade drop sharp
# Raw losses in a row above `diverge` x the lowest running median of five that also end a sweep:
# the moving average lags, and can miss a blow-up that the raw losses show plainly.
DIVERGED_RUN = 2


def lr_find(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            loss_fn: Callable[[Any, Any], torch.Tensor], loader: Iterable[Any], *,
            start_lr: float = 1e-7, end_lr: float = 10.0, num_iter: int = 50, smooth: float = 0.9,
            diverge: float = 4.0, accum_steps: int = 1, autocast_dtype: torch.dtype | None = None,
            scaler: torch.amp.GradScaler | None = None, device: torch.device | str | None = None,
            schedule: str = "onecycle", method: str | None = None, min_iter_before_stop: int = 10,
            progress: Callable[[int, float, float], None] | None = None) -> LRFindResult:
    """Train with an exponentially growing lr and record the loss of every optimizer step.

    ``loader`` yields ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``. Step
    i sets ``start_lr * (end_lr / start_lr) ** (i / (num_iter - 1))`` on the first param group,
    the others keeping their ratio to it. The sweep stops at a non-finite loss, or (from step
    ``min_iter_before_stop`` on) once the smoothed loss passes ``diverge`` times its best or
    ``DIVERGED_RUN`` raw losses in a row pass ``diverge`` times their lowest running median of five.
    Everything it touched is restored afterwards, even on error. ``progress(i, lr, loss)`` sees
    each step. ``.suggestion`` serves ``schedule`` by DEFAULT_RULES for the optimizer's kind, or by
    ``method`` if given; ``.for_schedule(name)`` gives the others.
    """
    _check_args(model, optimizer, schedule, method, start_lr, end_lr, num_iter, smooth, diverge,
                accum_steps, min_iter_before_stop)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    lrs = [start_lr * (end_lr / start_lr) ** (i / (num_iter - 1)) for i in range(num_iter)]
    lrs[0], lrs[-1] = start_lr, end_lr
    restore, batches = _snapshot(model, optimizer, scaler), _cycle(loader)
    try:
        with torch.enable_grad():  # a sweep trains, even when called under torch.no_grad()
            losses, smoothed, stop_reason = _sweep(model, optimizer, loss_fn, batches, device, lrs, smooth,
                                                   diverge, accum_steps, autocast_dtype, scaler,
                                                   min_iter_before_stop, progress)
    finally:
        batches.close()  # now, not when a traceback lets go: DataLoader workers stop here
        restore()
    kind = "adaptive" if isinstance(optimizer, ADAPTIVE) else "sgd"
    return _result(lrs[: len(losses)], losses, smoothed, stop_reason, schedule, method, kind)


@dataclass
class LRFindResult:
    """One entry per step in ``lrs``, ``losses`` and ``smoothed`` (the moving average the stop
    rule watches; NaN at a non-finite loss, which ends the sweep). ``suggestions`` maps "peak" and
    "base" to (lr or None, rule); ``suggestion`` and ``method`` are those serving ``schedule``."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float | None
    stop_reason: str
    method: str
    schedule: str = "onecycle"
    suggestions: dict[str, tuple[float | None, str]] = field(default_factory=dict)
    optimizer_kind: str = "sgd"  # or "adaptive": which DEFAULT_RULES served

    def suggest(self, method: str = "minimum") -> float | None:
        """Re-derive a suggestion from this sweep with another rule, without re-running it."""
        return suggest_lr(self.lrs, self.losses, method)

    def for_schedule(self, schedule: str) -> float | None:
        """The suggestion for ``schedule``: onecycle's peak, or the others' starting rate."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
        return self.suggestions[SCHEDULES[schedule]][0]


def suggest_lr(lrs: Sequence[float], losses: Sequence[float], method: str = "minimum") -> float | None:
    """One rule's pick from a sweep; None, with a UserWarning, when too few points are usable,
    the loss never decreases, or it still falls at the end of the sweep (for the minimum)."""
    if method not in RULES:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return _read(suggestion_curve(lrs, losses), {method: method})[method][0]


# --- what the rules read, and the rules -------------------------------------------------------


@dataclass(frozen=True)
class SuggestionCurve:
    """The smoothed loss at the finite points in lr order. Rules pick from ``first`` on (the first
    points are edge-biased); ``lowest`` is the lowest point from there."""

    lrs: list[float]
    loss: list[float]
    first: int
    lowest: int
    exploded: bool  # the sweep ended in a non-finite loss, so a lowest point at the end is real
    problem: str | None  # why no rule can read this curve


def suggestion_curve(lrs: Sequence[float], losses: Sequence[float]) -> SuggestionCurve:
    """Smooth without shifting: a running median of five (drops lone spikes, keeps a monotone drop
    sharp), then a Gaussian in log10(lr) of SUGGEST_SIGMA_DECADES (or 1.5 point spacings if wider).
    The sweep's moving average trails the data, and would move every feature to a higher lr."""
    pairs = [(float(lr), float(v)) for lr, v in zip(lrs, losses, strict=True) if 0 < lr < math.inf]
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
    return SuggestionCurve(lrs, loss, first, lowest, exploded, problem)


def minimum(curve: SuggestionCurve) -> float | None:
    """The lr at the lowest loss, placed between sweep points by a parabola through its neighbours:
    onecycle's warmup and annealing absorb rates up to where a sweep's loss bottoms out. None when
    the loss still falls at the end of a sweep that did not blow up."""
    i = curve.lowest
    if i == len(curve.lrs) - 1:
        return curve.lrs[i] if curve.exploded else None
    (x0, x1, x2), (y0, y1, y2) = [math.log10(v) for v in curve.lrs[i - 1:i + 2]], curve.loss[i - 1:i + 2]
    bend = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    vertex = x1 - 0.5 * ((x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)) / bend if bend else x1
    return 10 ** min(max(vertex, x0), x2)


def min_over_3(curve: SuggestionCurve) -> float | None:
    """A third of ``minimum``: a rate SGD can start at and hold, and an Adam-like onecycle peak."""
    return None if (lr := minimum(curve)) is None else lr / 3


def min_over_10(curve: SuggestionCurve) -> float | None:
    """A tenth of ``minimum`` (fastai's classic rule): what Adam-like optimizers can start at."""
    return None if (lr := minimum(curve)) is None else lr / 10


RULES: dict[str, Callable[[SuggestionCurve], float | None]] = {
    "minimum": minimum, "min/3": min_over_3, "min/10": min_over_10}
METHODS = tuple(RULES)


# --- saving and drawing a sweep ---------------------------------------------------------------


def save_sweep(result: LRFindResult, config: dict, out_dir: Any) -> list[Any]:
    """Write lr_find.json, lr_find.png and the same picture to TensorBoard in out_dir/lr_find/ (no
    scalars: against the step index neither loss nor lr means much). The one writer for `python
    lr_find.py` and `train.py --lr find`; returns what it wrote. An OSError names the file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    finite = {k: [v if math.isfinite(v) else None for v in values]  # JSON has no NaN
              for k, values in (("losses", result.losses), ("smoothed", result.smoothed))}
    record = {"lrs": result.lrs, **finite, "stop_reason": result.stop_reason, "schedule": result.schedule,
              "suggestion": result.suggestion, "method": result.method,
              "optimizer_kind": result.optimizer_kind, "config": config,
              "suggestions": {f: {"lr": lr, "method": rule, "schedules": _SERVED[f]}
                              for f, (lr, rule) in result.suggestions.items()}}
    wrote = [_write_atomically(out_dir / "lr_find.json", json.dumps(record, indent=2).encode())]
    try:
        png = io.BytesIO()
        plot_lr_find(result).savefig(png, format="png")
        wrote.append(_write_atomically(out_dir / "lr_find.png", png.getvalue()))
        from matplotlib.image import imread
        from torch.utils.tensorboard import SummaryWriter

        pixels = (imread(io.BytesIO(png.getvalue()), format="png")[..., :3] * 255).round()
        with SummaryWriter(str(out_dir / "lr_find"), purge_step=0) as writer:  # a re-run replaces it
            writer.add_image("lr_find", pixels.astype("uint8"), dataformats="HWC")
    except ImportError as err:
        what = "plot" if len(wrote) == 1 else "TensorBoard image"
        wrote.append(f"no {what} (pip install {err.name or 'tensorboard'})")
    return wrote


def plot_lr_find(result: LRFindResult, ax: Any = None) -> Any:
    """Loss against lr (log x): the raw loss faint, the curve the rules read solid, each schedule's
    suggestion marked, the chosen one red. Draws on ``ax`` or a new matplotlib Figure (no pyplot
    state or GUI backend involved) and returns the Figure: ``.savefig("lr.png")`` writes a PNG."""
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
    names = {"peak": "onecycle peak", "base": "constant/step/cosine/warmup"}
    for family, (lr, rule) in result.suggestions.items():
        chosen = family == SCHEDULES.get(result.schedule)
        if lr is not None:
            ax.axvline(lr, color="tab:red" if chosen else "tab:gray", linestyle="-" if chosen else "--",
                       linewidth=2.5 if chosen else 1, label=f"{names[family]} ({rule}): {lr:.3g}")
    ax.set_xscale("log")
    ax.set(xlabel="learning rate", ylabel="loss", title=f"LR range test, {len(result.lrs)} steps, "
           f"{result.stop_reason}; red: for --schedule {result.schedule}")
    ax.legend(loc="lower left", fontsize="small")
    return ax.figure


# --- the command line -------------------------------------------------------------------------
# pragma: no mutate start (the CLI is not in the mutation score; README, Testing)


def main(argv: list[str] | None = None) -> None:
    """`python lr_find.py [--config X.toml] [--flag value ...]`: sweep the setup that train.py builds
    from the same flags, save the sweep and print the suggestions."""
    try:
        from tqdm import tqdm

        import distributed
        import task
        from configs import UserError, command_line, exit_with_error, parse_config
        from data import build_loaders
        from models import amp_setup, build_model, build_optimizer
    except ImportError as err:
        raise SystemExit(f"error: python lr_find.py sweeps train.py's setup and needs the template's other "
                         f"files ({err.name} is missing); the library part, `from lr_find import lr_find`, "
                         "works in this file alone") from None

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and os.environ.get("RANK", "0") != "0":
        raise SystemExit(0)  # under torchrun one sweep is enough: rank 0 runs it, the others leave
    warnings.filterwarnings("ignore", "lr_find: no suggestion")  # said below, in the one error line
    try:  # the data, model and optimizer that train.py builds from the same flags
        from checkpoints import check_writable_dir

        cfg = parse_config(argv, description="Learning-rate range test on train.py's setup.")
        if world_size > 1:
            print(f"lr_find.py: one sweep is enough: rank 0 runs it, the other {world_size - 1} processes "
                  "exit")
        check_writable_dir(cfg.out_dir)  # fail now, not after the sweep
        device = distributed.pick_device(cfg.device)
        torch.manual_seed(cfg.seed)
        batches, _, info = build_loaders(cfg, device)
        model = build_model(cfg, info.input_shape[0], len(info.names), device)
        amp_dtype, scaler = amp_setup(device, cfg.amp)
        optimizer = build_optimizer(model, cfg, cfg.find_start_lr)
        with tqdm(total=cfg.find_iters, desc="lr_find", disable=not sys.stdout.isatty(), leave=False) as bar:
            result, wrote, why = sweep_setup(cfg, task, model, optimizer, batches, amp_dtype, scaler, device,
                                             progress=lambda i, lr, loss: bar.update())
    except UserError as err:
        exit_with_error(str(err))
    print(f"lr_find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
          f"{result.stop_reason}; wrote {', '.join(map(str, wrote))}")
    if result.suggestion is None:
        exit_with_error(f"no learning rate suggested ({why}); widen --find-start-lr/--find-end-lr or raise "
                        "--find-iters, and look at lr_find.png", status=1)
    others = "".join(f"; for {'/'.join(_SERVED[f])}: {lr:.3g} ({rule})" for f, (lr, rule)
                     in result.suggestions.items() if lr and f != SCHEDULES[result.schedule])
    print(f"suggested lr: {result.suggestion:.3g} ({result.method}) for --schedule {result.schedule}{others}")
    not_for_training = [name for name in cfg.to_dict() if name == "lr" or name.startswith("find_")]
    print(f"next: {command_line('train.py', cfg, leave_out=tuple(not_for_training))} --lr auto")


def sweep_setup(cfg, task, model, optimizer, batches, amp_dtype, scaler, device, batches_per_step: int = 1,
                progress=None) -> tuple[LRFindResult, list, str | None]:
    """The range test on train.py's model, data, task loss and a sweep `optimizer`, as `python
    lr_find.py` and `train.py --lr find` both run it, and its files written: (result, what it wrote,
    why there is no suggestion). Its record names the task, so --lr auto refuses another task's sweep.
    Under torchrun (train.py's --lr find), rank 0 sweeps with `batches_per_step` of its batches a step."""
    from checkpoints import reporting_write_errors
    from configs import UserError

    stream = (batch for epoch in itertools.count() for batch in batches.epoch(epoch))
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.closing(stream):
            warnings.simplefilter("always")
            result = lr_find(model, optimizer, functools.partial(task.loss, cfg=cfg), stream,
                             start_lr=cfg.find_start_lr, end_lr=cfg.find_end_lr, num_iter=cfg.find_iters,
                             accum_steps=cfg.accum_steps * batches_per_step, autocast_dtype=amp_dtype,
                             scaler=scaler, device=device, schedule=cfg.schedule, progress=progress,
                             method=None if cfg.find_method == "auto" else cfg.find_method)
    except ValueError as err:  # lr_find's checks of its arguments
        raise UserError(str(err)) from None
    with reporting_write_errors(cfg.out_dir):
        wrote = save_sweep(result, {**cfg.to_dict(), "task": task_identity(task)}, cfg.out_dir)
    why = "; ".join(str(w.message).removeprefix("lr_find: no suggestion, ") for w in caught) or None
    return result, wrote, why


def task_identity(task) -> dict:
    """The task a sweep measured: its name and a hash of its source, so that an edited loss counts."""
    import hashlib
    import inspect

    return {"name": task.NAME, "source": hashlib.sha256(inspect.getsource(task).encode()).hexdigest()[:16]}


# pragma: no mutate end
# --- internals: checks, suggestions, files and the sweep --------------------------------------


def _check_args(model, optimizer, schedule, method, start_lr, end_lr, num_iter, smooth, diverge,
                accum_steps, min_iter_before_stop) -> None:
    """A ValueError naming the first bad argument, before anything is touched."""
    def whole(v: Any, low: int) -> bool:
        return isinstance(v, int) and v >= low

    for ok, message in [
        (schedule in SCHEDULES, f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}"),
        (method is None or method in RULES, f"method must be one of {METHODS}, got {method!r}"),
        (0 < start_lr < end_lr < math.inf, f"start_lr and end_lr need 0 < start_lr < end_lr < inf, got "
                                           f"start_lr={start_lr}, end_lr={end_lr}"),
        (whole(num_iter, 10), f"num_iter must be an int >= 10 to suggest, got {num_iter}"),
        (0 <= smooth < 1, f"smooth must be in [0, 1), got {smooth}"),
        (diverge > 1, f"diverge must be > 1, got {diverge}"),
        (whole(accum_steps, 1), f"accum_steps must be an int >= 1, got {accum_steps}"),
        (whole(min_iter_before_stop, 0),
         f"min_iter_before_stop must be an int >= 0, got {min_iter_before_stop}"),
        (any(p.requires_grad for p in model.parameters()), "model has no trainable parameters"),
        (any(g["params"] for g in optimizer.param_groups), "optimizer has no parameters"),
    ]:
        if not ok:
            raise ValueError(message)


def _read(curve: SuggestionCurve, rules: dict[str, str]) -> dict[str, tuple[float | None, str]]:
    """Each named rule's pick from one curve; one warning if any finds none."""
    picks = {name: (None if curve.problem else RULES[rule](curve), rule) for name, rule in rules.items()}
    if any(lr is None for lr, _ in picks.values()):
        warnings.warn(f"lr_find: no suggestion, {_why_none(curve)}", UserWarning, stacklevel=4)
    return picks


def _why_none(curve: SuggestionCurve) -> str:
    if curve.problem or curve.lowest < len(curve.lrs) - 1:
        return curve.problem or "the loss never decreases"
    return "the loss was still falling at the end of the sweep (raise end_lr)"


def _result(lrs: list[float], losses: list[float], smoothed: list[float], stop_reason: str,
            schedule: str, method: str | None, kind: str) -> LRFindResult:
    chosen, rules = SCHEDULES[schedule], DEFAULT_RULES[kind]
    picks = _read(suggestion_curve(lrs, losses), {**rules, chosen: method or rules[chosen]})
    lr, rule = picks[chosen]
    return LRFindResult(lrs, losses, smoothed, lr, stop_reason, rule, schedule, picks, kind)


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


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """Re-iterate the loader forever, so a sweep longer than one epoch needs no special loader."""
    for passes in itertools.count():
        served = 0
        for served, batch in enumerate(loader, 1):  # noqa: B007 (served counts the batches)
            yield batch
        if not served:
            raise ValueError("loader is empty: it yielded no batches" if passes == 0 else "loader is empty "
                             "on re-iteration (a one-shot iterator?): lr_find needs a loader it can iterate "
                             "again when num_iter * accum_steps exceeds its length")


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return {k: _to_device(v, device) for k, v in obj.items()} if isinstance(obj, dict) else obj


def _read_lag(device: torch.device) -> int:
    """Steps by which losses are read late (host, in _sweep)."""
    return 1 if device.type == "cuda" else 0


def _sweep(model, optimizer, loss_fn, batches, device, schedule, smooth, diverge, accum_steps,
           autocast_dtype, scaler, min_iter_before_stop, progress) -> tuple[list[float], list[float], str]:
    """One optimizer step per lr of ``schedule`` until the stop rule fires: (losses, smoothed, why)."""
    groups = optimizer.param_groups
    first = float(groups[0]["lr"])
    ratios = [float(g["lr"]) / first if first else 1.0 for g in groups]
    # Step i's loss goes to host[i]: on CUDA asynchronously, into pinned memory, and it is read a step
    # later (_read_lag) once its event has passed, so the GPU is never drained to read a loss.
    cuda, lag = device.type == "cuda", _read_lag(device)
    host = torch.empty(len(schedule), dtype=torch.float32, pin_memory=cuda)
    events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else []
    losses, smoothed, recent = [], [], deque(maxlen=5)
    avg, best, floor, high_run = 0.0, math.inf, math.inf, 0

    def record(i: int) -> str | None:
        """Read step i's loss; return why the sweep stops there, if it does."""
        nonlocal avg, best, floor, high_run
        if cuda:
            events[i % 2].synchronize()
        value = float(host[i])
        losses.append(value)
        if progress is not None:
            progress(i, schedule[i], value)
        if not math.isfinite(value):
            smoothed.append(math.nan)
            return "non-finite loss"
        avg = smooth * avg + (1 - smooth) * value
        smoothed.append(avg / (1 - smooth ** (i + 1)))
        best = min(best, smoothed[-1])
        recent.append(value)
        floor = min(floor, sorted(recent)[len(recent) // 2])  # a running median barely lags
        high_run = high_run + 1 if value > diverge * floor else 0
        blown_up = (best > 0 and smoothed[-1] > diverge * best) or (floor > 0 and high_run >= DIVERGED_RUN)
        return "diverged" if i >= min_iter_before_stop and blown_up else None

    autocast = functools.partial(torch.autocast, device.type, dtype=autocast_dtype,
                                 enabled=autocast_dtype is not None)
    model.train()
    stop = None
    for i, lr in enumerate(schedule):
        for group, ratio in zip(groups, ratios, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr * ratio)
            else:
                group["lr"] = lr * ratio
        optimizer.zero_grad(set_to_none=True)
        total = 0.0  # the recorded loss: the window's mean, as one big batch would give
        for _ in range(accum_steps):
            inputs, targets = (_to_device(v, device) for v in next(batches))
            with autocast():
                loss = loss_fn(model(inputs), targets) / accum_steps
            total = total + loss.detach().float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        host[i].copy_(total.reshape(()), non_blocking=cuda)
        if cuda:
            events[i % 2].record(torch.cuda.current_stream(device))
        if i >= lag and (stop := record(i - lag)):
            break
    else:  # the steps still unread
        for i in range(len(schedule) - lag, len(schedule)):
            if stop := record(i):
                break
    return losses, smoothed, stop or "completed"


# --- internals: snapshot and restore ----------------------------------------------------------

_Kept = namedtuple("_Kept", "live saved")  # a tensor, dict or list, and its contents to put back


def _keep(obj: Any) -> Any:
    """What ``_put_back`` needs to restore ``obj``: tensors copied to the CPU (a snapshot takes no
    accelerator memory), dicts and lists item by item, tuples rebuilt, other values deep-copied."""
    if isinstance(obj, torch.Tensor):
        return _Kept(obj, obj.detach().to("cpu", copy=True))
    if isinstance(obj, dict):
        return _Kept(obj, {k: _keep(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return _Kept(obj, [_keep(v) for v in obj])
    return tuple(_keep(v) for v in obj) if type(obj) is tuple else copy.deepcopy(obj)


def _put_back(kept: Any) -> Any:
    """Restore into the very tensors, dicts and lists that ``_keep`` saw, so whoever holds them sees
    the old values: unlike ``Optimizer.load_state_dict``, this keeps each tensor's identity."""
    if type(kept) is tuple:
        return tuple(_put_back(v) for v in kept)
    if not isinstance(kept, _Kept):
        return kept
    live, saved = kept
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            return live.copy_(saved)
    if isinstance(live, dict):
        live.clear()
        live.update({k: _put_back(v) for k, v in saved.items()})
    else:
        live[:] = [_put_back(v) for v in saved]
    return live


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler | None) -> Callable[[], None]:
    """Record everything a sweep changes; return the function that puts it back."""
    tensors = _keep({(module, name): t for module in model.modules() for name, t in
                     [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]})
    state = _keep(optimizer.state)
    groups = _keep([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    # Plain attributes too, such as the flag an LR scheduler sets to notice optimizer.step() calls.
    plain = (bool, int, float, str, type(None))
    flags = {k: v for k, v in vars(optimizer).items() if isinstance(v, plain)}
    # All of the scaler: its scale is created on first use, and must go back to "not created yet".
    scaler_vars = _keep(vars(scaler) if scaler is not None else {})
    modes, rng = [(m, m.training) for m in model.modules()], _capture_rng_state()

    def restore() -> None:
        for (module, name), tensor in _put_back(tensors).items():
            if getattr(module, name, None) is not tensor:  # the sweep re-bound it
                setattr(module, name, tensor)
        _put_back(state)
        for group, saved in zip(optimizer.param_groups, _put_back(groups), strict=True):
            params = group["params"]
            group.clear()
            group.update(params=params, **saved)
        for k in [k for k, v in vars(optimizer).items() if isinstance(v, plain) and k not in flags]:
            delattr(optimizer, k)
        vars(optimizer).update(flags)
        _put_back(scaler_vars)
        _restore_rng_state(rng)
        for m, training in modes:
            m.training = training
        for p in [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]:
            p.grad = None

    return restore


# A deliberate private copy of runtime.py's RNG capture, so that this file works copied alone. It
# lives in memory only, so unlike runtime.py's it need not survive a weights_only checkpoint.
def _capture_rng_state() -> dict:
    """Every global RNG a training step may draw from."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # touched only when the caller already imported it
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


if __name__ == "__main__":
    main()
