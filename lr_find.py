"""Learning-rate range test: sweep the lr exponentially, record the loss, suggest an lr.

The model, optimizer, GradScaler, RNG streams and train/eval flags are restored bit for bit
afterwards, so a sweep can run right before training without changing what training does.

Self-contained on purpose: at import time only torch and the standard library are needed, so the
file can be copied alone into another project. numpy is touched only when the caller already
imported it; matplotlib is imported inside ``plot_lr_find``.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LRFindResult",
    "METHODS",
    "capture_rng_state",
    "lr_find",
    "plot_lr_find",
    "restore_rng_state",
    "save_sweep",
    "suggest_lr",
]

METHODS = ("steepest", "min/10", "valley")

# Width (in decades of lr) of the zero-phase smoothing used by the suggestion: wide enough to
# average minibatch noise, narrow enough to keep a one-decade drop sharp.
SUGGEST_SIGMA_DECADES = 0.25

_MIN_NUM_ITER = 10


@dataclass
class LRFindResult:
    """Outcome of a sweep; the three lists are aligned, one entry per optimizer step.

    A non-finite loss ends the sweep: its lr and raw value are kept in ``lrs``/``losses`` (so
    the failure point is visible), but it never enters the moving average, whose entry at that
    position is NaN. Every other ``smoothed`` entry is finite.
    """

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float | None
    stop_reason: str
    method: str

    def suggest(self, method: str = "steepest") -> float | None:
        """Re-derive a suggestion from this sweep with another method, without re-running it."""
        return suggest_lr(self.lrs, self.losses, method)


# --- RNG ----------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Snapshot every global RNG a training step may draw from.

    The result holds only tensors and plain Python values, so it survives
    ``torch.save``/``torch.load(weights_only=True)`` inside a checkpoint.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    return state


def restore_rng_state(state: dict) -> None:
    """Put back what ``capture_rng_state`` saw (also after a save/load roundtrip)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda_states)
    if "numpy" in state:
        np = sys.modules.get("numpy") or importlib.import_module("numpy")
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))


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
        if (
            isinstance(live, torch.Tensor)
            and live.shape == saved.cpu.shape
            and live.dtype == saved.cpu.dtype
            and live.device == saved.device
        ):
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


def _snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> Callable[[], None]:
    """Record everything a sweep mutates; return the function that puts it back."""
    params = [(p, _Stored(p)) for p in model.parameters()]
    buffers = [
        (module, name, b, _Stored(b))
        for module in model.modules()
        for name, b in module.named_buffers(recurse=False)
    ]
    modes = [(m, m.training) for m in model.modules()]
    restore_optimizer = _snapshot_optimizer(optimizer)
    restore_scaler = _snapshot_scaler(scaler)
    rng = capture_rng_state()

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
        restore_rng_state(rng)
        for m, training in modes:
            m.training = training
        for p in model.parameters():
            p.grad = None
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    return restore


# --- sweep --------------------------------------------------------------------------------


def _lr_schedule(start_lr: float, end_lr: float, num_iter: int) -> list[float]:
    ratio = end_lr / start_lr
    lrs = [start_lr * ratio ** (i / (num_iter - 1)) for i in range(num_iter)]
    lrs[0], lrs[-1] = start_lr, end_lr
    return lrs


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """Re-iterate the loader forever, so a sweep longer than one epoch needs no special loader."""
    passes = 0
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            if passes == 0:
                raise ValueError("loader is empty: it yielded no batches")
            raise ValueError(
                "loader is empty on re-iteration (a one-shot iterator?): lr_find needs a "
                "loader it can iterate again when num_iter * accum_steps exceeds its length"
            )
        passes += 1


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


def _set_lr(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _check_args(
    start_lr: float,
    end_lr: float,
    num_iter: int,
    smooth: float,
    diverge: float,
    accum_steps: int,
    method: str,
    min_iter_before_stop: int,
) -> None:
    if not start_lr > 0:
        raise ValueError(f"start_lr must be > 0, got {start_lr}")
    if not end_lr > start_lr:
        raise ValueError(f"start_lr must be < end_lr, got start_lr={start_lr}, end_lr={end_lr}")
    if not math.isfinite(end_lr):
        raise ValueError(f"end_lr must be finite, got {end_lr}")
    if not isinstance(num_iter, int) or num_iter < _MIN_NUM_ITER:
        raise ValueError(f"num_iter must be an int >= {_MIN_NUM_ITER} to suggest, got {num_iter}")
    if not 0 <= smooth < 1:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    if not diverge > 1:
        raise ValueError(f"diverge must be > 1, got {diverge}")
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps}")
    if not isinstance(min_iter_before_stop, int) or min_iter_before_stop < 0:
        raise ValueError(f"min_iter_before_stop must be an int >= 0, got {min_iter_before_stop}")
    _check_method(method)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def lr_find(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    loader: Iterable[Any],
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_iter: int = 50,
    smooth: float = 0.9,
    diverge: float = 4.0,
    accum_steps: int = 1,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    device: torch.device | str | None = None,
    method: str = "steepest",
    min_iter_before_stop: int = 10,
    progress: Callable[[int, float, float], None] | None = None,
) -> LRFindResult:
    """Train with an exponentially growing lr and record the loss of every optimizer step.

    ``loader`` yields ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``.
    Step i uses ``start_lr * (end_lr / start_lr) ** (i / (num_iter - 1))`` on the first param
    group; other groups keep their lr ratio to it. The sweep stops early on a non-finite loss,
    or once the smoothed loss exceeds ``diverge`` times its best (not before
    ``min_iter_before_stop`` steps; only while that best is positive, as the ratio means
    nothing otherwise). Everything the sweep touched is restored afterwards, even on error.
    ``progress(i, lr, loss)`` is called for each recorded step.

    Defaults: 50 steps over 8 decades (about 6 per decade) is as good for the suggestion, which
    smooths over a quarter decade anyway, as the customary 100, at half the cost. smooth=0.9
    lets the divergence check react within a few steps; 0.98 trails by about 50 steps, the
    whole sweep. The loss reaches the host once per step: ``.item()`` on CPU; on CUDA it is
    read one step late from pinned memory, so the loop never waits for the GPU (a stop is
    then noticed one step late, and that extra step is discarded).
    """
    _check_args(
        start_lr, end_lr, num_iter, smooth, diverge, accum_steps, method, min_iter_before_stop
    )
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
                model, optimizer, loss_fn, batches, device,
                _lr_schedule(start_lr, end_lr, num_iter),
                smooth=smooth, diverge=diverge, accum_steps=accum_steps,
                autocast_dtype=autocast_dtype, scaler=scaler,
                min_iter_before_stop=min_iter_before_stop, progress=progress,
            )  # fmt: skip
    finally:
        batches.close()  # now, not when a traceback lets go: DataLoader workers stop here
        restore()
    suggestion = suggest_lr(lrs, losses, method)
    return LRFindResult(lrs, losses, smoothed, suggestion, stop_reason, method)


def _sweep(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Iterator[Any],
    device: torch.device,
    schedule: list[float],
    *,
    smooth: float,
    diverge: float,
    accum_steps: int,
    autocast_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None,
    min_iter_before_stop: int,
    progress: Callable[[int, float, float], None] | None,
) -> tuple[list[float], list[float], list[float], str]:
    groups = optimizer.param_groups
    first = float(groups[0]["lr"])
    ratios = [float(g["lr"]) / first if first else 1.0 for g in groups]
    reader = _LossReader(device, len(schedule))
    lag = _read_lag(device)
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    avg, best = 0.0, math.inf

    def record(i: int) -> str | None:
        nonlocal avg, best
        value = reader.pop(i)
        lrs.append(schedule[i])
        losses.append(value)
        if progress is not None:
            progress(i, schedule[i], value)
        if not math.isfinite(value):
            smoothed.append(math.nan)
            return "non-finite loss"
        avg = smooth * avg + (1 - smooth) * value
        s = avg / (1 - smooth ** (i + 1))
        smoothed.append(s)
        best = min(best, s)
        if i >= min_iter_before_stop and best > 0 and s > diverge * best:
            return "diverged"
        return None

    if autocast_dtype is None:
        autocast: Callable[[], Any] = contextlib.nullcontext
    else:
        autocast = functools.partial(torch.autocast, device.type, dtype=autocast_dtype)
    model.train()
    pending: deque[int] = deque()
    stop: str | None = None
    for i, lr in enumerate(schedule):
        for group, ratio in zip(groups, ratios, strict=True):
            _set_lr(group, lr * ratio)
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


# --- suggestion ---------------------------------------------------------------------------


def _suggestion_curve(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """The curve the suggestion reads, and its slope per decade.

    A running median of five drops lone spikes (common at high lr) while keeping a monotone
    drop sharp; a Gaussian in log10(lr) then averages the noise without shifting anything.
    """
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    mid = y.unfold(0, 5, 1).median(dim=1).values
    y = torch.cat([y[:1], y[:3].median().view(1), mid, y[-3:].median().view(1), y[-1:]])
    sigma = max(SUGGEST_SIGMA_DECADES, 1.5 * float((x[1:] - x[:-1]).median()))
    rows = []
    for block in x.split(1024):
        w = torch.exp(-0.5 * ((block[:, None] - x[None, :]) / sigma) ** 2)
        rows.append((w @ y) / w.sum(dim=1))
    z = torch.cat(rows)
    dz = torch.cat([z[1:2] - z[:1], z[2:] - z[:-2], z[-1:] - z[-2:-1]])
    dx = torch.cat([x[1:2] - x[:1], x[2:] - x[:-2], x[-1:] - x[-2:-1]])
    slope = torch.where(dx > 0, dz / dx.clamp_min(1e-300), torch.zeros_like(dz))
    return z.tolist(), slope.tolist()


def _no_suggestion(reason: str) -> None:
    warnings.warn(f"lr_find: no suggestion, {reason}", UserWarning, stacklevel=3)


def suggest_lr(
    lrs: Sequence[float], losses: Sequence[float], method: str = "steepest"
) -> float | None:
    """Pick an lr from a sweep's raw (or already smoothed) losses.

    The curve is smoothed here rather than taken from the sweep's moving average, which trails
    the data by about smooth/(1 - smooth) steps and so shifts every feature to a higher lr.
    Instead: drop non-finite points, take a running median of five (removes lone spikes but
    keeps a monotone drop sharp), then a Gaussian in log10(lr) of width
    ``SUGGEST_SIGMA_DECADES`` or 1.5 point spacings if wider (symmetric, so it blurs without
    shifting). The first 10% of points (at least 2) are never chosen, being edge-biased; nor,
    for "steepest", the last 5%, already diverging.

    - "steepest": where the loss falls fastest per decade of lr, looking only up to the lowest
      loss (a fall after a divergence spike is not a descent worth having).
    - "min/10": a tenth of the lr at the lowest loss.
    - "valley": in the longest stretch over which the loss keeps falling, the lr at which
      two thirds of that stretch's drop is done.

    Returns None, with a UserWarning, when too few usable points remain or the loss never falls.
    """
    _check_method(method)
    points = sorted(
        (math.log10(lr), float(lr), float(loss))
        for lr, loss in zip(lrs, losses, strict=True)
        if lr > 0 and math.isfinite(lr) and math.isfinite(loss)
    )
    n = len(points)
    lo, hi = max(2, n // 10), n - max(2, n // 20)
    if hi - lo < 3:
        _no_suggestion(f"only {n} usable points")
        return None
    curve, grads = _suggestion_curve([p[0] for p in points], [p[2] for p in points])

    lowest = min(range(lo, n), key=curve.__getitem__)
    if method == "min/10":
        return points[lowest][1] / 10
    if method == "steepest":
        i = min(range(lo, max(min(hi, lowest + 1), lo + 1)), key=grads.__getitem__)
        if grads[i] >= 0:
            _no_suggestion("the loss never decreases")
            return None
        return points[i][1]
    run_start, run_len, start = lo, 0, lo
    for j in range(lo + 1, n):
        if curve[j] >= curve[j - 1]:
            start = j
        elif j - start > run_len:
            run_start, run_len = start, j - start
    if run_len < 2:
        _no_suggestion("the loss never decreases")
        return None
    top, bottom = curve[run_start], curve[run_start + run_len]
    target = top - (top - bottom) * 2 / 3
    i = next(j for j in range(run_start, run_start + run_len + 1) if curve[j] <= target)
    return points[i][1]


# --- plot ---------------------------------------------------------------------------------


def plot_lr_find(result: LRFindResult, path: Any = None, ax: Any = None) -> Any:
    """Loss against lr (log x): raw loss faint, smoothed loss solid, suggestion marked.

    Returns the matplotlib Figure; also writes a PNG when ``path`` is given. Uses
    ``matplotlib.figure.Figure`` directly so no pyplot state or GUI backend is involved.
    """
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    def finite(values: list[float]) -> list[tuple[float, float]]:
        return [(lr, v) for lr, v in zip(result.lrs, values, strict=True) if math.isfinite(v)]

    raw, smooth = finite(result.losses), finite(result.smoothed)
    if raw:
        ax.plot(*zip(*raw, strict=True), color="tab:blue", alpha=0.3, linewidth=1, label="loss")
    if smooth:
        ax.plot(*zip(*smooth, strict=True), color="tab:blue", linewidth=2, label="smoothed")
        values = [v for _, v in smooth]
        low = min(values + [v for _, v in raw])
        high = max(values + [raw[0][1]])
        pad = 0.08 * (high - low) or 0.1 * abs(high) or 1.0
        ax.set_ylim(low - pad, high + pad)
    if result.suggestion is not None:
        ax.axvline(
            result.suggestion,
            color="tab:red",
            linestyle="--",
            label=f"{result.method}: {result.suggestion:.2e}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.set_title(f"LR range test ({result.stop_reason}, {len(result.lrs)} steps)")
    ax.legend(loc="best")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def save_sweep(result: LRFindResult, config: dict, out_dir: Any) -> list[Any]:
    """Write lr_find.json (the sweep, its suggestion and the `config` it ran with), lr_find.png
    (when matplotlib is there) and TensorBoard scalars into ``out_dir``: the one writer for
    `python lr_find.py` and `train.py --lr find`. Returns the paths of the files written."""
    import json
    from pathlib import Path

    from torch.utils.tensorboard import SummaryWriter

    def finite_or_none(values: list[float]) -> list[float | None]:
        return [v if math.isfinite(v) else None for v in values]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"lrs": result.lrs, "losses": finite_or_none(result.losses),
              "smoothed": finite_or_none(result.smoothed), "suggestion": result.suggestion,
              "method": result.method, "stop_reason": result.stop_reason, "config": config}
    wrote = [out_dir / "lr_find.json"]
    wrote[0].write_text(json.dumps(record, indent=2))
    with SummaryWriter(str(out_dir)) as writer:
        points = zip(result.lrs, result.losses, result.smoothed, strict=True)
        for i, (lr, loss, smoothed) in enumerate(points):
            writer.add_scalar("lr_find/lr", lr, i)
            if math.isfinite(loss) and math.isfinite(smoothed):
                writer.add_scalar("lr_find/loss", loss, i)
                writer.add_scalar("lr_find/smoothed", smoothed, i)
        try:
            figure = plot_lr_find(result, out_dir / "lr_find.png")
            writer.add_figure("lr_find", figure, close=False)
            wrote.append(out_dir / "lr_find.png")
        except ImportError:
            pass
    return wrote


# --- command line -------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> None:
    """`python lr_find.py [--config X.toml] [--flag value ...]`: the sweep train.py's setup needs.

    Builds the same data, model and optimizer as train.py from the same config, writes
    lr_find.json, lr_find.png and TensorBoard scalars to --out-dir, and prints the next command.
    """
    import functools
    import itertools
    import os
    from pathlib import Path

    import torch.nn.functional as F
    from tqdm import tqdm

    import runtime
    from configs import UserError, exit_with_error, parse_or_exit
    from data import build_loaders
    from models import build_model, build_optimizer

    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_or_exit(argv, description="Learning-rate range test on train.py's setup.")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_with_error("lr_find.py runs on one process: run `python lr_find.py` without torchrun, "
                        "then start the torchrun job with --lr auto")
    out_dir = Path(cfg.out_dir)
    try:
        device = runtime.pick_device(cfg.device)
        torch.manual_seed(cfg.seed)
        batches, _, info = build_loaders(cfg, device)
        model = build_model(cfg, info.channels, info.num_classes, device)
    except UserError as err:
        exit_with_error(str(err))
    optimizer = build_optimizer(model, cfg, cfg.find_start_lr)
    amp_dtype, scaler = runtime.amp_setup(device, cfg.amp)
    stream = (batch for epoch in itertools.count() for batch in batches.epoch(epoch))
    bar = tqdm(total=cfg.find_iters, desc="lr_find", disable=not sys.stdout.isatty(), leave=False)

    def progress(i: int, lr: float, loss: float) -> None:
        bar.set_postfix(lr=f"{lr:.2e}", loss=f"{loss:.4f}", refresh=False)
        bar.update()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lr_find(
            model, optimizer, functools.partial(F.cross_entropy, label_smoothing=cfg.label_smoothing),
            stream, start_lr=cfg.find_start_lr, end_lr=cfg.find_end_lr, num_iter=cfg.find_iters,
            accum_steps=cfg.accum_steps, autocast_dtype=amp_dtype, scaler=scaler, device=device,
            method=cfg.find_method, progress=progress)
    bar.close()

    wrote = save_sweep(result, cfg.to_dict(), out_dir)
    plot_note = f", {wrote[1]}" if len(wrote) > 1 else " (no plot: pip install matplotlib)"

    print(f"lr_find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
          f"{result.stop_reason}; wrote {out_dir / 'lr_find.json'}{plot_note}")
    if result.suggestion is None:
        why = "; ".join(str(w.message) for w in caught) or "no usable points"
        exit_with_error(f"no learning rate suggested ({why}); widen --find-start-lr/--find-end-lr "
                        "or raise --find-iters, and look at lr_find.png", status=1)
    print(f"suggested lr: {result.suggestion:.3g} ({result.method})")
    print(f"next: {_next_command(argv)}")


if __name__ == "__main__":
    main()
