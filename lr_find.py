"""Learning-rate range test: sweep the lr exponentially, record the loss, suggest an lr per schedule.

One sweep serves every schedule, but not with one number: onecycle's peak (max_lr) tolerates rates
up to where the sweep's loss bottoms out, while a schedule that starts at its full rate (constant,
step, cosine, warmup) needs less, and with an Adam-like optimizer much less. Each rule is a small
function; DEFAULT_RULES says which serves which, as bench_lr_find.py measured. Model, optimizer,
GradScaler, RNG streams and train/eval flags are restored bit for bit afterwards, so a sweep can
run right before training.

The library needs only torch (matplotlib inside plot_lr_find), so this file can be copied alone.
Read top to bottom: the public API, then the command line, then the sweep and restore internals.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import importlib
import math
import random
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# What each schedule takes from a sweep: onecycle its peak, the others the rate they start at.
SCHEDULES = {"onecycle": "peak", "constant": "base", "step": "base", "cosine": "base", "warmup": "base"}
# The rule per optimizer kind and schedule, as bench_lr_find.py measured (README, "Learning rate"):
# started at full rate with no warmup, Adam-like optimizers blow up well below the sweep's bottom.
DEFAULT_RULES = {"sgd": {"peak": "minimum", "base": "min/3"},
                 "adaptive": {"peak": "minimum", "base": "min/10"}}
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
            torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)
METHODS = ("minimum", "min/3", "min/10", "valley", "steepest")
SUGGEST_SIGMA_DECADES = 0.25  # smoothing width: averages minibatch noise, keeps a 1-decade drop sharp
# Raw losses in a row above `diverge` x the lowest running median of five that also end a sweep:
# the moving average lags, and can miss a blow-up that the raw losses show plainly.
DIVERGED_RUN = 2
_MIN_NUM_ITER = 10


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
        return self.suggestions[_family(schedule)][0]


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
    ``min_iter_before_stop`` on) once the smoothed loss exceeds ``diverge`` times its best, or
    ``DIVERGED_RUN`` raw losses in a row exceed ``diverge`` times their lowest running median
    of five (each only while that reference is positive). All it touched is
    restored afterwards, even on error. ``progress(i, lr, loss)`` sees each step. On CUDA each loss
    is read one step late from pinned memory, so the loop never waits for the GPU.

    ``.suggestion`` serves ``schedule`` (onecycle: its peak) by DEFAULT_RULES for the optimizer's
    kind, or by ``method`` if given; ``.for_schedule(name)`` gives the others.
    """
    _check_args(start_lr, end_lr, num_iter, smooth, diverge, accum_steps, min_iter_before_stop)
    _family(schedule)
    if method is not None:
        _check_method(method)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters")
    if not any(len(g["params"]) for g in optimizer.param_groups):
        raise ValueError("optimizer has no parameters")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    restore = _snapshot(model, optimizer, scaler)
    batches = _cycle(loader)
    try:
        with torch.enable_grad():
            lrs, losses, smoothed, stop_reason = _sweep(
                model, optimizer, loss_fn, batches, device, _lr_schedule(start_lr, end_lr, num_iter),
                smooth, diverge, accum_steps, autocast_dtype, scaler, min_iter_before_stop, progress)
    finally:
        batches.close()  # now, not when a traceback lets go: DataLoader workers stop here
        restore()
    kind = "adaptive" if isinstance(optimizer, ADAPTIVE) else "sgd"
    return _result(lrs, losses, smoothed, stop_reason, schedule, method, kind)


def suggest_lr(lrs: Sequence[float], losses: Sequence[float], method: str = "minimum") -> float | None:
    """One rule's pick from a sweep; None, with a UserWarning, when too few points are usable,
    the loss never decreases, or it still falls at the end of the sweep (for the minimum)."""
    _check_method(method)
    return _read(suggestion_curve(lrs, losses), {method: method})[method][0]


@dataclass(frozen=True)
class SuggestionCurve:
    """What the rules read: the smoothed loss at the finite points in lr order. Rules pick from
    ``first`` on (the first points are edge-biased); ``lowest`` is the lowest point from there."""

    lrs: list[float]
    loss: list[float]
    slope: list[float]  # per decade of lr
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
        return SuggestionCurve(lrs, raw, [], first, first, exploded, f"only {n} usable points")
    y = raw[:1] + [sorted(raw[:3])[1]] + [sorted(raw[i - 2:i + 3])[2] for i in range(2, n - 2)]
    y += [sorted(raw[-3:])[1], raw[-1]]
    sigma = max(SUGGEST_SIGMA_DECADES, 1.5 * sorted(b - a for a, b in zip(x, x[1:], strict=False))[n // 2])
    loss = []
    for xi in x:  # four sigmas each side hold all but 1e-4 of the weight
        lo, hi = bisect.bisect_left(x, xi - 4 * sigma), bisect.bisect_right(x, xi + 4 * sigma)
        w = [math.exp(-0.5 * ((xj - xi) / sigma) ** 2) for xj in x[lo:hi]]
        loss.append(sum(wj * yj for wj, yj in zip(w, y[lo:hi], strict=True)) / sum(w))
    ends = [(max(i - 1, 0), min(i + 1, n - 1)) for i in range(n)]
    slope = [(loss[b] - loss[a]) / (x[b] - x[a]) if x[b] > x[a] else 0.0 for a, b in ends]
    lowest = min(range(first, n), key=loss.__getitem__)
    problem = "the loss never decreases" if loss[lowest] >= loss[first] else None
    return SuggestionCurve(lrs, loss, slope, first, lowest, exploded, problem)


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


def steepest(curve: SuggestionCurve) -> float | None:
    """Where the loss falls fastest per decade, up to the lowest loss (a fall after a blow-up is
    no descent worth having) and never in the last 5% (already diverging)."""
    n = len(curve.lrs)
    i = min(range(curve.first, max(min(n - max(2, n // 20), curve.lowest + 1), curve.first + 1)),
            key=curve.slope.__getitem__)
    return curve.lrs[i] if curve.slope[i] < 0 else None


def valley(curve: SuggestionCurve) -> float | None:
    """In the longest stretch over which the loss keeps falling, the lr at which two thirds of its
    drop is done: a rate still on the descent, clear of the turn, for schedules that start there."""
    loss, start, run_start, run_len = curve.loss, curve.first, curve.first, 0
    for j in range(curve.first + 1, len(loss)):
        if loss[j] >= loss[j - 1]:
            start = j
        elif j - start > run_len:
            run_start, run_len = start, j - start
    if run_len < 2:
        return None
    target = loss[run_start] - (loss[run_start] - loss[run_start + run_len]) * 2 / 3
    return curve.lrs[next(j for j in range(run_start, run_start + run_len + 1) if loss[j] <= target)]


def min_over_3(curve: SuggestionCurve) -> float | None:
    """A third of ``minimum``: a rate that SGD can start at and hold."""
    lr = minimum(curve)
    return None if lr is None else lr / 3


def min_over_10(curve: SuggestionCurve) -> float | None:
    """A tenth of ``minimum`` (fastai's classic rule): what Adam-like optimizers can start at."""
    lr = minimum(curve)
    return None if lr is None else lr / 10


RULES: dict[str, Callable[[SuggestionCurve], float | None]] = {
    "minimum": minimum, "min/3": min_over_3, "min/10": min_over_10, "valley": valley, "steepest": steepest}


def plot_lr_find(result: LRFindResult, path: Any = None, ax: Any = None) -> Any:
    """Loss against lr (log x): the raw loss faint, the curve the rules read solid, each schedule's
    suggestion marked, the chosen one red. Returns the matplotlib Figure (no pyplot state or GUI
    backend involved); also writes a PNG when ``path`` is given."""
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
        pad = 0.08 * (high - low) or 0.1 * abs(high) or 1.0
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
    if path is not None:
        ax.figure.savefig(path)
    return ax.figure


def _family(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
    return SCHEDULES[schedule]


def _check_method(method: str) -> None:
    if method not in RULES:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _read(curve: SuggestionCurve, rules: dict[str, str]) -> dict[str, tuple[float | None, str]]:
    """Each named rule's pick from one curve; a curve they cannot read is warned about once."""
    picks = {name: (None if curve.problem else RULES[rule](curve), rule) for name, rule in rules.items()}
    if any(lr is None for lr, _ in picks.values()):
        reason = curve.problem or ("the loss was still falling at the end of the sweep (raise end_lr)"
                                   if curve.lowest == len(curve.lrs) - 1 else "the loss never decreases")
        warnings.warn(f"lr_find: no suggestion, {reason}", UserWarning, stacklevel=4)
    return picks


def _result(lrs: list[float], losses: list[float], smoothed: list[float], stop_reason: str,
            schedule: str = "onecycle", method: str | None = None, kind: str = "sgd") -> LRFindResult:
    chosen, rules = _family(schedule), DEFAULT_RULES[kind]
    picks = _read(suggestion_curve(lrs, losses), {**rules, chosen: method or rules[chosen]})
    lr, rule = picks[chosen]
    return LRFindResult(lrs, losses, smoothed, lr, stop_reason, rule, schedule, picks, kind)


# --- command line -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """`python lr_find.py [--config X.toml] [--flag value ...]` sweeps the data, model and optimizer
    train.py builds from the same flags; writes lr_find.json, lr_find.png and that image to
    TensorBoard in --out-dir; prints the next command. `--from-json [DIR]` re-reads a saved sweep."""
    import os
    from pathlib import Path

    import torch.nn.functional as F
    from tqdm import tqdm

    import runtime
    from configs import exit_with_error, parse_or_exit
    from data import build_loaders
    from models import build_model, build_optimizer

    argv = sys.argv[1:] if argv is None else list(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and os.environ.get("RANK", "0") != "0":
        raise SystemExit(0)  # under torchrun one sweep is enough: rank 0 runs it, the others leave
    given = [arg.split("=")[0] for arg in argv if arg.startswith("--")]
    folder = None
    if "--from-json" in given:
        at = [arg.split("=")[0] for arg in argv].index("--from-json")
        flag = argv.pop(at)
        has_dir = "=" in flag or (at < len(argv) and not argv[at].startswith("-"))
        folder = (flag.split("=", 1)[1] if "=" in flag else argv.pop(at)) if has_dir else ""
    cfg = parse_or_exit(argv, description="Learning-rate range test on train.py's setup.")
    out_dir = Path(folder or cfg.out_dir)
    if folder is not None:
        return _rederive(out_dir, cfg.find_method, cfg.schedule, set(given))
    if world_size > 1:
        print(f"lr_find.py: one sweep is enough, so rank 0 runs it and the other {world_size - 1} "
              "processes exit")
    try:  # fail now, not after the sweep
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / ".lr_find.tmp").write_bytes(b"")
        (out_dir / ".lr_find.tmp").unlink()
    except OSError as err:
        exit_with_error(f"cannot write to --out-dir {out_dir} ({err.strerror or err})")
    try:
        device = runtime.pick_device(cfg.device)
        torch.manual_seed(cfg.seed)
        batches, _, info = build_loaders(cfg, device)
        model = build_model(cfg, info.channels, info.num_classes, device)
        amp_dtype, scaler = runtime.amp_setup(device, cfg.amp)
        bar = tqdm(total=cfg.find_iters, desc="lr_find", disable=not sys.stdout.isatty(), leave=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = lr_find(
                model, build_optimizer(model, cfg, cfg.find_start_lr),
                functools.partial(F.cross_entropy, label_smoothing=cfg.label_smoothing),
                (batch for epoch in range(sys.maxsize) for batch in batches.epoch(epoch)),
                start_lr=cfg.find_start_lr, end_lr=cfg.find_end_lr, num_iter=cfg.find_iters,
                accum_steps=cfg.accum_steps, autocast_dtype=amp_dtype, scaler=scaler, device=device,
                schedule=cfg.schedule, method=None if cfg.find_method == "auto" else cfg.find_method,
                progress=lambda i, lr, loss: bar.update())
        bar.close()
    except ValueError as err:  # configs.UserError is one
        exit_with_error(str(err))
    _save(result, cfg.to_dict(), out_dir, caught)
    print(f"next: {_next_command(argv)}")


def _rederive(out_dir: Any, find_method: str, schedule: str, given: set[str]) -> None:
    """Suggestions and plot again from out_dir/lr_find.json, with --find-method and --schedule
    where given and the saved ones otherwise."""
    import json

    from configs import exit_with_error

    other = sorted(given - {"--from-json", "--find-method", "--schedule", "--out-dir"})
    if other:
        exit_with_error(f"--from-json re-reads a saved sweep: it takes --find-method and --schedule, "
                        f"not {', '.join(other)}")
    path = out_dir / "lr_find.json"
    try:
        record = json.loads(path.read_text())
        config, stop_reason = dict(record["config"]), str(record["stop_reason"])
        lrs, losses, smoothed = ([math.nan if v is None else float(v) for v in record[key]]
                                 for key in ("lrs", "losses", "smoothed"))
        kind = record.get("optimizer_kind") or ("adaptive" if config.get("optimizer") == "adamw" else "sgd")
        if "--schedule" in given or "schedule" not in config:
            config["schedule"] = schedule
        if "--find-method" in given or "find_method" not in config:
            config["find_method"] = find_method
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _result(lrs, losses, smoothed, stop_reason, config["schedule"],
                             None if config["find_method"] == "auto" else config["find_method"], kind)
    except OSError as err:
        exit_with_error(f"cannot read {path} ({err.strerror or err}); run `python lr_find.py` first")
    except (ValueError, KeyError, TypeError) as err:
        exit_with_error(f"{path} is not a sweep lr_find.py wrote ({type(err).__name__}: {err})")
    _save(result, config, out_dir, caught)


def save_sweep(result: LRFindResult, config: dict, out_dir: Any) -> list[Any]:
    """Write lr_find.json, lr_find.png and the same picture to TensorBoard in out_dir/lr_find/: the
    one writer for `python lr_find.py` and `train.py --lr find`. Returns what it wrote; an OSError
    is the caller's to report. No TensorBoard scalars: their x axis would be the step index, where
    neither loss nor lr means much."""
    import io
    import json
    import os
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def write(path: Any, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as err:  # named after the file the user knows, not the temporary one
            raise OSError(err.errno, err.strerror, str(path)) from None
        finally:
            tmp.unlink(missing_ok=True)

    serves = {f: [s for s, g in SCHEDULES.items() if g == f] for f in result.suggestions}
    finite = {k: [v if math.isfinite(v) else None for v in getattr(result, k)]
              for k in ("losses", "smoothed")}
    record = {"lrs": result.lrs, **finite, "stop_reason": result.stop_reason, "schedule": result.schedule,
              "suggestion": result.suggestion, "method": result.method,
              "optimizer_kind": result.optimizer_kind, "config": config,
              "suggestions": {f: {"lr": lr, "method": rule, "schedules": serves[f]}
                              for f, (lr, rule) in result.suggestions.items()}}
    wrote = [out_dir / "lr_find.json"]
    write(wrote[0], json.dumps(record, indent=2).encode())
    try:
        png = io.BytesIO()
        plot_lr_find(result).savefig(png, format="png")
        wrote.append(out_dir / "lr_find.png")
        write(wrote[-1], png.getvalue())
        from matplotlib.image import imread
        from torch.utils.tensorboard import SummaryWriter

        pixels = (imread(io.BytesIO(png.getvalue()), format="png")[..., :3] * 255).round()
        with SummaryWriter(str(out_dir / "lr_find"), purge_step=0) as writer:  # a re-run replaces it
            writer.add_image("lr_find", pixels.astype("uint8"), dataformats="HWC")
    except ImportError as err:
        wrote.append(f"no {'plot' if len(wrote) == 1 else 'TensorBoard image'} (pip install {err.name})")
    return wrote


def _save(result: LRFindResult, config: dict, out_dir: Any, caught: list) -> None:
    """save_sweep, then the summary lines; a failed write or no suggestion is one line, exit 1."""
    from configs import exit_with_error

    try:
        wrote = save_sweep(result, config, out_dir)
    except OSError as err:
        exit_with_error(f"could not write {err.filename or out_dir} ({err.strerror or err})", status=1)
    print(f"lr_find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
          f"{result.stop_reason}; wrote {', '.join(map(str, wrote))}")
    if result.suggestion is None:
        why = "; ".join(dict.fromkeys(str(w.message) for w in caught)) or "no usable points"
        exit_with_error(f"no learning rate suggested ({why}); widen --find-start-lr/--find-end-lr "
                        "or raise --find-iters, and look at lr_find.png", status=1)
    serves = {f: [s for s, g in SCHEDULES.items() if g == f] for f in result.suggestions}
    others = "".join(f"; for {'/'.join(serves[f])}: {lr:.3g} ({rule})" for f, (lr, rule)
                     in result.suggestions.items() if lr and f != SCHEDULES[result.schedule])
    print(f"suggested lr: {result.suggestion:.3g} ({result.method}) for --schedule {result.schedule}{others}")


def _next_command(argv: list[str]) -> str:
    """The train.py command that continues from this sweep: same flags, lr taken from the file."""
    import shlex

    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name == "--lr" or name.startswith("--find-"):
            skip = "=" not in arg and not name.startswith("--find-method=")
            continue
        kept.append(arg)
    return shlex.join(["python", "train.py", *kept, "--lr", "auto"])


# --- the sweep ----------------------------------------------------------------------------


def _check_args(start_lr: float, end_lr: float, num_iter: int, smooth: float, diverge: float,
                accum_steps: int, min_iter_before_stop: int) -> None:
    def whole(v: Any, low: int) -> bool:
        return isinstance(v, int) and v >= low

    for ok, message in [
        (start_lr > 0, f"start_lr must be > 0, got {start_lr}"),
        (end_lr > start_lr, f"start_lr must be < end_lr, got start_lr={start_lr}, end_lr={end_lr}"),
        (math.isfinite(end_lr), f"end_lr must be finite, got {end_lr}"),
        (whole(num_iter, _MIN_NUM_ITER),
         f"num_iter must be an int >= {_MIN_NUM_ITER} to suggest, got {num_iter}"),
        (0 <= smooth < 1, f"smooth must be in [0, 1), got {smooth}"),
        (diverge > 1, f"diverge must be > 1, got {diverge}"),
        (whole(accum_steps, 1), f"accum_steps must be an int >= 1, got {accum_steps}"),
        (whole(min_iter_before_stop, 0),
         f"min_iter_before_stop must be an int >= 0, got {min_iter_before_stop}"),
    ]:
        if not ok:
            raise ValueError(message)


def _lr_schedule(start_lr: float, end_lr: float, num_iter: int) -> list[float]:
    lrs = [start_lr * (end_lr / start_lr) ** (i / (num_iter - 1)) for i in range(num_iter)]
    lrs[0], lrs[-1] = start_lr, end_lr
    return lrs


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """Re-iterate the loader forever, so a sweep longer than one epoch needs no special loader."""
    for passes in range(sys.maxsize):
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty and passes == 0:
            raise ValueError("loader is empty: it yielded no batches")
        if empty:
            raise ValueError("loader is empty on re-iteration (a one-shot iterator?): lr_find needs a "
                             "loader it can iterate again when num_iter * accum_steps exceeds its length")


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _read_lag(device: torch.device) -> int:
    """Steps by which loss values are read late: on CUDA, reading the previous step's loss
    while the current one is queued keeps the GPU busy instead of draining it every step."""
    return 1 if device.type == "cuda" else 0


class _LossReader:
    """Brings one float per step to the host: one ``.item()`` on CPU-like devices; on CUDA an
    async copy into pinned memory plus an event wait one step later (no per-step sync)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self._cuda = device.type == "cuda"
        self._held: dict[int, torch.Tensor] = {}
        if self._cuda:
            self._stream = torch.cuda.current_stream(device)
            self._host = torch.empty(n, dtype=torch.float32, pin_memory=True)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]

    def push(self, i: int, loss: torch.Tensor) -> None:
        if self._cuda:
            self._host[i].copy_(loss.detach().float().reshape(()), non_blocking=True)
            self._events[i % 2].record(self._stream)
        else:
            self._held[i] = loss

    def pop(self, i: int) -> float:
        if self._cuda:
            self._events[i % 2].synchronize()
            return float(self._host[i])
        return self._held.pop(i).item()


def _sweep(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           loss_fn: Callable[[Any, Any], torch.Tensor], batches: Iterator[Any], device: torch.device,
           schedule: list[float], smooth: float, diverge: float, accum_steps: int,
           autocast_dtype: torch.dtype | None, scaler: torch.amp.GradScaler | None,
           min_iter_before_stop: int, progress: Callable[[int, float, float], None] | None,
           ) -> tuple[list[float], list[float], list[float], str]:
    groups = optimizer.param_groups
    first = float(groups[0]["lr"])
    ratios = [float(g["lr"]) / first if first else 1.0 for g in groups]
    reader, lag = _LossReader(device, len(schedule)), _read_lag(device)
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    avg, best, floor, high_run, recent = 0.0, math.inf, math.inf, 0, deque(maxlen=5)

    def record(i: int) -> str | None:
        nonlocal avg, best, floor, high_run
        value = reader.pop(i)
        lrs.append(schedule[i])
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

    autocast = contextlib.nullcontext
    if autocast_dtype is not None:
        autocast = functools.partial(torch.autocast, device.type, dtype=autocast_dtype)
    model.train()
    pending: deque[int] = deque()
    stop: str | None = None
    for i, lr in enumerate(schedule):
        for group, ratio in zip(groups, ratios, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr * ratio)
            else:
                group["lr"] = lr * ratio
        optimizer.zero_grad(set_to_none=True)
        total = None
        for _ in range(accum_steps):
            inputs, targets = next(batches)
            inputs, targets = _to_device(inputs, device), _to_device(targets, device)
            with autocast():
                loss = loss_fn(model(inputs), targets)
            if accum_steps == 1:
                total = loss
            else:
                part = loss.detach().float()
                total = part if total is None else total + part
                loss = loss / accum_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        reader.push(i, total if accum_steps == 1 else total / accum_steps)
        pending.append(i)
        while len(pending) > lag and stop is None:
            stop = record(pending.popleft())
        if stop is not None:
            break
    while pending and stop is None:
        stop = record(pending.popleft())
    return lrs, losses, smoothed, stop or "completed"


# --- snapshot / restore -------------------------------------------------------------------


class _Stored:
    """A CPU copy of a tensor plus where it lived, so snapshots never occupy accelerator memory."""

    __slots__ = ("cpu", "device")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.cpu = tensor.detach().to("cpu", copy=True)
        self.device = tensor.device


def _stash(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _Stored(obj)
    if type(obj) is dict:
        return {k: _stash(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_stash(v) for v in obj)
    return copy.deepcopy(obj)


def _unstash(saved: Any, live: Any) -> Any:
    """Rebuild ``saved``; tensors are copied into ``live``'s tensors when they still fit.

    Writing in place keeps tensor identities (and exact dtype/device), which
    ``Optimizer.load_state_dict`` would not: it recreates state cast to each param's dtype.
    """
    if isinstance(saved, _Stored):
        if (isinstance(live, torch.Tensor) and live.shape == saved.cpu.shape
                and live.dtype == saved.cpu.dtype and live.device == saved.device):
            with torch.no_grad():
                live.copy_(saved.cpu)
            return live
        return saved.cpu.to(saved.device, copy=True)
    if type(saved) is dict:
        live = live if isinstance(live, dict) else {}
        return {k: _unstash(v, live.get(k)) for k, v in saved.items()}
    if type(saved) in (list, tuple):
        fits = type(live) is type(saved) and len(live) == len(saved)
        return type(saved)(_unstash(v, live[i] if fits else None) for i, v in enumerate(saved))
    return saved


_SCALAR_TYPES = (bool, int, float, str, type(None))


def _snapshot_optimizer(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    state = {p: _stash(s) for p, s in optimizer.state.items()}
    groups = [{k: _stash(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    # Flags such as the one LR schedulers use to notice optimizer.step() calls.
    scalars = {k: v for k, v in vars(optimizer).items() if isinstance(v, _SCALAR_TYPES)}

    def restore() -> None:
        live_state = optimizer.state
        for p in [p for p in live_state if p not in state]:
            del live_state[p]
        for p, saved in state.items():
            current = live_state.get(p)
            rebuilt = _unstash(saved, current)
            if isinstance(current, dict):
                current.clear()
                current.update(rebuilt)
            else:
                live_state[p] = rebuilt
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            rebuilt = _unstash(saved, group)
            for k in [k for k in group if k != "params" and k not in saved]:
                del group[k]
            group.update(rebuilt)
        for k in [k for k, v in vars(optimizer).items() if isinstance(v, _SCALAR_TYPES)]:
            if k not in scalars:
                delattr(optimizer, k)
        for k, v in scalars.items():
            setattr(optimizer, k, v)

    return restore


def _snapshot_scaler(scaler: torch.amp.GradScaler | None) -> Callable[[], None]:
    if scaler is None:
        return lambda: None
    state = scaler.state_dict()
    # A GradScaler creates its scale tensor on first use; put it back to "not created yet" so
    # the next scale() initialises it exactly as it would have without the sweep.
    lazy = getattr(scaler, "_scale", None) is None
    per_optimizer = copy.copy(getattr(scaler, "_per_optimizer_states", None))

    def restore() -> None:
        if state:
            scaler.load_state_dict(state)
        if lazy and hasattr(scaler, "_scale"):
            scaler._scale = None
            scaler._growth_tracker = None
        if per_optimizer is not None:
            scaler._per_optimizer_states = per_optimizer

    return restore


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler | None) -> Callable[[], None]:
    """Record everything a sweep mutates; return the function that puts it back."""
    params = [(p, _Stored(p)) for p in model.parameters()]
    buffers = [(module, name, b, _Stored(b)) for module in model.modules()
               for name, b in module.named_buffers(recurse=False)]
    modes = [(m, m.training) for m in model.modules()]
    restore_optimizer, restore_scaler = _snapshot_optimizer(optimizer), _snapshot_scaler(scaler)
    rng = _capture_rng_state()

    def restore() -> None:
        with torch.no_grad():
            for p, saved in params:
                p.copy_(saved.cpu)
            for module, name, b, saved in buffers:
                if getattr(module, name, None) is not b:
                    setattr(module, name, b)
                b.copy_(saved.cpu)
        restore_optimizer()
        restore_scaler()
        _restore_rng_state(rng)
        for m, training in modes:
            m.training = training
        for p in [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]:
            p.grad = None

    return restore


# --- RNG: a private copy of runtime.py's, so that this file can be copied alone -------------


def _capture_rng_state() -> dict:
    """Every global RNG a training step may draw from, as tensors and plain values only (so it
    survives ``torch.save``/``torch.load(weights_only=True)`` inside a checkpoint)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")  # touched only when the caller already imported it
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                          float(cached))
    return state


def _restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"])[: torch.cuda.device_count()])
    if "numpy" in state:
        np = sys.modules.get("numpy") or importlib.import_module("numpy")
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))


capture_rng_state, restore_rng_state = _capture_rng_state, _restore_rng_state  # train.py's, for now


if __name__ == "__main__":
    main()
