"""lr_find's suggestion rules: `python -m bench.lr_find_rules [--quick] [--seeds N] [--part P] [--json F]`.

Quality: on a task where the learning rate moves val accuracy by several points (synthetic, 100
classes of 1x8x8 images, 8192 train / 32768 val, resnet_small width 8, 2 epochs = 128 optimizer
steps), per optimizer (SGD-nesterov, AdamW) and seed, as `python lr_find.py --seed S` then
`python train.py --seed S --lr auto` would: one lr_find sweep with lr_find.py's defaults and one
torch-lr-finder range_test with its defaults (100 iterations to end_lr 10, steepest gradient of its
smoothed curve) on the same model and data, both timed; then onecycle and cosine training at every
rule's suggestion, at torch-lr-finder's, and at a 7-point grid half a decade apart. Gaps are means
over seeds, paired by seed, with the standard error of the paired differences.

Stability: the default setup (`python lr_find.py`: digits, resnet_small), same seeds, sweeps of 50
and 100 steps: how far the default suggestions move with the seed and with the sweep length.
Quality takes about 2.5 minutes a seed on 2 CPU cores (8 seeds by default).

torch-lr-finder is only the yardstick, never a dependency: `pip install --no-deps torch-lr-finder`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import task
from bench.speed import sync
from configs import Config, UserError, parse_config
from lr_find import DEFAULT_RULES, RULES, SuggestionCurve, lr_find, suggestion_curve
from machinery import processes
from machinery.stops import exit_with_error
from models import OPTIMIZERS, build_optimizer

# 32768 val images, not the usual quarter of the training set (2048): with 2048, about 60% of the
# variance of a paired difference between two rates was val sampling (sd 0.51 vs 0.31 pp, 16 seeds).
TASK = ["--dataset", "synthetic", "--num-classes", "100", "--channels", "1", "--image-size", "8",
        "--synthetic-size", "8192", "--synthetic-val-size", "32768", "--width", "8", "--epochs", "2"]
SCHEDULES = {"onecycle": "peak", "cosine": "base"}  # cosine stands for the schedules that start at their rate
GRIDS = {"sgd": [0.01, 0.0316, 0.1, 0.316, 1.0, 3.16, 10.0],
         "adamw": [0.001, 0.00316, 0.01, 0.0316, 0.1, 0.316, 1.0]}
TLF_RANGE_TEST = {"end_lr": 10, "num_iter": 100}  # its defaults; start_lr: the optimizer's lr
TLF_SKIP = (10, 5)  # skip_start, skip_end of torch-lr-finder's plot(suggest_lr=True)
TARGETS = {"default_gap_pp": ">= -0.15", "default_minus_tlf_pp": ">= 0", "time_ratio": "<= 0.6",
           "stability_ratio": "< 1.5"}
MISSING_TLF = ("bench/lr_find_rules.py: torch-lr-finder is not importable (needed for the comparison); "
               "run `pip install --no-deps torch-lr-finder`")


# --- candidate rules the bench measured against lr_find.py's and dropped (docs/lr_find.md, "How good")


def valley(curve: SuggestionCurve) -> float | None:
    """fastai's idea: in the longest stretch over which the loss keeps falling, the lr at which two
    thirds of its drop is done."""
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


def slope_per_decade(curve: SuggestionCurve) -> list[float]:
    """Central differences in log10(lr), one-sided at the ends; 0 where two points share an lr."""
    n, x = len(curve.lrs), [math.log10(lr) for lr in curve.lrs]
    ends = [(max(i - 1, 0), min(i + 1, n - 1)) for i in range(n)]
    return [(curve.loss[b] - curve.loss[a]) / (x[b] - x[a]) if x[b] > x[a] else 0.0 for a, b in ends]


def steepest(curve: SuggestionCurve) -> float | None:
    """torch-lr-finder's idea on lr_find.py's curve: where the loss falls fastest per decade, up to
    the lowest loss (a fall after a blow-up is no descent) and never in the last 5% (diverging)."""
    n, slope = len(curve.lrs), slope_per_decade(curve)
    i = min(range(curve.first, max(min(n - max(2, n // 20), curve.lowest + 1), curve.first + 1)),
            key=slope.__getitem__)
    return curve.lrs[i] if slope[i] < 0 else None


CANDIDATES = {**RULES, "valley": valley, "steepest": steepest}
METHODS = tuple(CANDIDATES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 1 epoch, 3-point grid")
    parser.add_argument("--seeds", type=int, default=0, help="seeds per optimizer (default 8, quick 1)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds run from here on: fresh seeds check a rule chosen on earlier ones")
    parser.add_argument("--part", choices=("all", "quality", "stability"), default="all")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset")
    parser.add_argument("--json", default="runs/bench_lr_find.json", help="where to write the results")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (1 if args.quick else 8)
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if args.seeds < 1 or not args.optimizers or set(args.optimizers) - set(OPTIMIZERS):
        parser.error(f"--seeds must be >= 1 and --optimizers a subset of {','.join(OPTIMIZERS)}")
    return args


def setup(cfg: Config, device: torch.device):
    """Model, optimizer (at find_start_lr), loss and endless batches, as lr_find.py's main() builds them."""
    import train

    torch.manual_seed(cfg.seed)
    splits, info, model = train.setup(cfg, task, device)
    batches = splits.train
    optimizer = build_optimizer(model, cfg, cfg.find_start_lr)
    stream = (batch for epoch in range(sys.maxsize) for batch in batches.epoch(epoch))

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # a batch mean, as criteria give
        return task.loss(outputs, targets, cfg, info) / task.normalizer(targets, cfg, info)

    return model, optimizer, loss, stream


def ours(cfg: Config, device: torch.device) -> tuple[dict, float]:
    """Every rule's pick from one sweep with lr_find.py's settings, and seconds to the suggestion."""
    model, optimizer, loss_fn, stream = setup(cfg, device)
    sync(device)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lr_find(model, optimizer, loss_fn, stream, start_lr=cfg.find_start_lr,
                         end_lr=cfg.find_end_lr, num_iter=cfg.find_iters, device=device)
        sync(device)
        seconds = time.perf_counter() - start
        curve = suggestion_curve(result.lrs, result.losses)
        picks = {name: None if curve.problem else rule(curve) for name, rule in CANDIDATES.items()}
    picks.update({f"default:{family}": lr for family, (lr, _) in result.suggestions.items()})
    return {"picks": picks, "steps": len(result.lrs), "stop_reason": result.stop_reason,
            "kind": result.optimizer_kind}, seconds


def tlf_suggestion(history: dict) -> float | None:
    """torch-lr-finder's plot(suggest_lr=True): argmin of np.gradient of the trimmed losses."""
    import numpy as np

    skip_start, skip_end = TLF_SKIP
    lrs, losses = history["lr"], history["loss"]
    if len(lrs) < skip_start + skip_end + 2:
        return None  # plot() raises here
    lrs, losses = lrs[skip_start:len(lrs) - skip_end], losses[skip_start:len(losses) - skip_end]
    return float(lrs[int(np.gradient(np.array(losses)).argmin())])


def theirs(cfg: Config, device: torch.device, tlf) -> tuple[dict, float]:
    """torch-lr-finder on the same model, optimizer and batches; timed from LRFinder() (which
    snapshots model and optimizer) through range_test, the suggestion and reset() (the restore)."""
    model, optimizer, loss_fn, stream = setup(cfg, device)
    sync(device)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        finder = tlf.LRFinder(model, optimizer, loss_fn, device=device)
        finder.range_test(tlf.TrainDataLoaderIter(stream), **TLF_RANGE_TEST)
        suggestion = tlf_suggestion(finder.history)
        finder.reset()
    sync(device)
    return {"picks": {"torch-lr-finder": suggestion}, "steps": len(finder.history["lr"])}, \
        time.perf_counter() - start


def train_acc(flags: list[str], schedule: str, lr: float, tmp: str) -> float:
    """Final val accuracy of train.train at this lr (a diverged run counts as 0)."""
    import train

    cfg = parse_config([*flags, "--schedule", schedule, "--lr", repr(lr), "--out-dir", tmp])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            acc = float(train.train(cfg)["val_acc"])
    except UserError as err:  # train.py's divergence guard stops such a run early
        if not str(err).startswith("training diverged"):
            raise
        return 0.0
    return acc if math.isfinite(acc) else 0.0


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a - b in percentage points and its standard error, pairing by seed."""
    diffs = [100 * (x - y) for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return statistics.fmean(diffs), se


def measure_quality(opt: str, args: argparse.Namespace, device: torch.device, tlf) -> dict:
    """Per seed: both sweeps (alternating which runs first), then training at every candidate."""
    grid = GRIDS[opt][::3] if args.quick else GRIDS[opt]
    task = [*TASK[:-1], "1"] if args.quick else TASK
    rows: dict[str, dict] = {}  # (schedule, candidate) -> per-seed lrs and accuracies
    sweeps: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-lr-find-") as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            flags = [*task, "--optimizer", opt, "--seed", str(seed), "--device", args.device]
            cfg = parse_config(flags)
            if seed % 2 == 0:  # alternate which sweep runs first, so drift hits both alike
                (mine, my_s), (other, their_s) = ours(cfg, device), theirs(cfg, device, tlf)
            else:
                (other, their_s), (mine, my_s) = theirs(cfg, device, tlf), ours(cfg, device)
            sweeps.append({"seed": seed, "ours_seconds": my_s, "theirs_seconds": their_s,
                           "ours_steps": mine["steps"], "theirs_steps": other["steps"],
                           "stop_reason": mine["stop_reason"], "kind": mine["kind"],
                           "picks": {**mine["picks"], **other["picks"]}})
            for schedule in SCHEDULES:
                candidates = {f"grid {lr:g}": lr for lr in grid}
                candidates.update({rule: mine["picks"][rule] for rule in METHODS})
                candidates["torch-lr-finder"] = other["picks"]["torch-lr-finder"]
                done: dict[float, float] = {}
                for name, lr in candidates.items():
                    if lr is not None and lr not in done:
                        done[lr] = train_acc(flags, schedule, lr, tmp)
                    row = rows.setdefault(f"{schedule}|{name}", {"lrs": [], "acc": []})
                    row["lrs"].append(lr)
                    row["acc"].append(done[lr] if lr is not None else 0.0)
            print(f"  {opt} seed {seed} done", flush=True)
    report: dict = {"sweeps": sweeps, "rows": rows, "grid": grid}
    for schedule, family in SCHEDULES.items():
        grid_rows = {lr: rows[f"{schedule}|grid {lr:g}"]["acc"] for lr in grid}
        best_lr = max(grid, key=lambda lr: statistics.fmean(grid_rows[lr]))
        default = DEFAULT_RULES[sweeps[0]["kind"]][family]
        table = {}
        for name in [*(f"grid {lr:g}" for lr in grid), *METHODS, "torch-lr-finder"]:
            row = rows[f"{schedule}|{name}"]
            good = [lr for lr in row["lrs"] if lr]
            table[name] = {"lr": math.exp(statistics.fmean(map(math.log, good))) if good else None,
                           "lr_min": min(good, default=None), "lr_max": max(good, default=None),
                           "acc": 100 * statistics.fmean(row["acc"]),
                           "gap": paired(row["acc"], grid_rows[best_lr]),
                           "vs_tlf": paired(row["acc"], rows[f"{schedule}|torch-lr-finder"]["acc"])}
        report[schedule] = {"best_grid_lr": best_lr, "default_rule": default, "table": table}
    report["time_ratio"] = (statistics.median(s["ours_seconds"] for s in sweeps)
                            / statistics.median(s["theirs_seconds"] for s in sweeps))
    return report


def quality_table(opt: str, q: dict) -> str:
    lines = []
    for schedule in SCHEDULES:
        s = q[schedule]
        lines += [f"\n{opt}, {schedule}: val accuracy %, mean of {len(q['sweeps'])} seeds; gap to the best "
                  f"grid lr ({s['best_grid_lr']:g}) and to torch-lr-finder, paired by seed, +- SE",
                  "| candidate | lr (geo. mean, range) | acc % | gap to best grid, pp "
                  "| vs torch-lr-finder, pp |",
                  "|---|---|---|---|---|"]
        for name, row in s["table"].items():
            lr = "none" if row["lr"] is None else f"{row['lr']:.3g}"
            if row["lr"] is not None and row["lr_min"] != row["lr_max"]:
                lr += f" ({row['lr_min']:.3g}-{row['lr_max']:.3g})"
            mark = " (default)" if name == s["default_rule"] else ""
            lines.append(f"| {name}{mark} | {lr} | {row['acc']:.2f} | {row['gap'][0]:+.2f} +- "
                         f"{row['gap'][1]:.2f} | {row['vs_tlf'][0]:+.2f} +- {row['vs_tlf'][1]:.2f} |")
    sweeps = q["sweeps"]
    lines.append(f"\n{opt}: seconds to a suggestion, median over seeds: ours "
                 f"{statistics.median(s['ours_seconds'] for s in sweeps):.2f} "
                 f"({statistics.fmean(s['ours_steps'] for s in sweeps):.0f} steps), torch-lr-finder "
                 f"{statistics.median(s['theirs_seconds'] for s in sweeps):.2f} "
                 f"({statistics.fmean(s['theirs_steps'] for s in sweeps):.0f} steps): ratio "
                 f"{q['time_ratio']:.2f} (target {TARGETS['time_ratio']})")
    return "\n".join(lines)


def measure_stability(opt: str, args: argparse.Namespace, device: torch.device) -> dict:
    """The default suggestions of `python lr_find.py [--find-iters 100] --seed S` (digits)."""
    out: dict = {}
    for iters in (50, 100):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            cfg = parse_config(["--optimizer", opt, "--seed", str(seed), "--find-iters", str(iters),
                                "--device", args.device])
            picks = ours(cfg, device)[0]["picks"]
            for family in ("peak", "base"):
                out.setdefault(family, {}).setdefault(iters, []).append(picks[f"default:{family}"])
    report = {}
    for family, by_length in out.items():
        a, b = by_length[50], by_length[100]
        report[family] = {"50": a, "100": b,
                          "seed_spread_50": max(a) / min(a) if all(a) else None,
                          "seed_spread_100": max(b) / min(b) if all(b) else None,
                          "length_ratio_max": max(max(x, y) / min(x, y) for x, y in zip(a, b, strict=True))
                          if all(a + b) else None}
    return report


def stability_table(opt: str, s: dict) -> str:
    def fmt(v: float | None) -> str:
        return "none" if v is None else f"{v:.2f}"

    lines = [f"\n{opt}, default setup (digits): default suggestions over seeds; spread = max/min",
             "| suggestion | 50 steps | 100 steps | seed spread 50 / 100 | 50 vs 100, worst seed |",
             "|---|---|---|---|---|"]
    for family, r in s.items():
        cells = [", ".join("none" if v is None else f"{v:.3g}" for v in r[k]) for k in ("50", "100")]
        lines.append(f"| {family} | {cells[0]} | {cells[1]} | {fmt(r['seed_spread_50'])} / "
                     f"{fmt(r['seed_spread_100'])} | {fmt(r['length_ratio_max'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch_lr_finder as tlf
    except ImportError:
        exit_with_error(MISSING_TLF)
    try:
        device = processes.pick_device(args.device)
    except UserError as err:
        exit_with_error(str(err))
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared core makes more threads noisy; seeds run one after another
    started = time.perf_counter()
    result: dict = {"targets": TARGETS, "task": TASK, "device": str(device), "quick": args.quick,
                    "torch_version": torch.__version__, "seeds": args.seeds, "first_seed": args.first_seed,
                    "torch_lr_finder_version": getattr(tlf, "__version__", "unknown"),
                    "load_1min_start": os.getloadavg()[0], "quality": {}, "stability": {}}
    try:
        for opt in args.optimizers:
            if args.part in ("all", "quality"):
                result["quality"][opt] = measure_quality(opt, args, device, tlf)
                print(quality_table(opt, result["quality"][opt]), flush=True)
            if args.part in ("all", "stability"):
                result["stability"][opt] = measure_stability(opt, args, device)
                print(stability_table(opt, result["stability"][opt]), flush=True)
    except UserError as err:
        exit_with_error(str(err))
    headline = {}
    for opt, q in result["quality"].items():
        row = q["onecycle"]["table"][q["onecycle"]["default_rule"]]
        headline[f"{opt}: default onecycle gap to best grid, pp"] = row["gap"]
        headline[f"{opt}: default onecycle minus torch-lr-finder, pp"] = row["vs_tlf"]
        headline[f"{opt}: time ratio ours/torch-lr-finder"] = (q["time_ratio"], math.nan)
    result["headline"] = {k: list(v) for k, v in headline.items()}
    result["seconds"] = time.perf_counter() - started
    result["load_1min_end"] = os.getloadavg()[0]
    print("\nheadline (value, SE): " + "; ".join(f"{k} {v[0]:+.2f} ({v[1]:.2f})"
                                                 for k, v in headline.items()))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=True))
    print(f"wrote {path} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
