"""Seed repeats. `train.py --seeds N` runs one config with the seeds --seed, --seed + 1, ..., each a whole run
in <out-dir>/seed-<s>/, then writes the spread of each number of their summary.json files to
<out-dir>/seeds.json and prints it; `compare_seeds.py A B` pairs two repeats seed by seed. The same command
again continues a repeat: a finished seed (its summary.json there) is kept, an interrupted one resumes from
its last.pt. The run is train.py's train(), passed in: the machinery imports no front."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from configs import OUT_DIR_RESUMES, Config, UserError, validate
from configs.resolve import MAY_CHANGE_ON_RESUME, differences
from machinery import processes
from machinery.files import write_json_atomic
from machinery.intervals import spread
from machinery.lr_auto import resolve_lr

RECORD = "seeds.json"  # in <out-dir>: the repeat's statistics, which compare_seeds.py reads
PER_RUN = ("seed", "seeds", "out_dir", "resume")  # the settings in which the runs of one repeat differ
METRIC_PREFIXES = ("val_", "test_", "best_val_")  # summary.json's task metrics; its other numbers: facts
SPLITS = ("train_size", "val_size", "test_size")
# Paired by seed, A and B must be measured on the same examples: these settings choose them.
SAME_EXAMPLES = ("dataset", "num_classes", "synthetic_size", "synthetic_val_size", "val_fraction")


def repeat(train: Callable, given: dict, task, optimizers: dict | None = None) -> dict:
    """The runs of the settings `given`, one a seed, each train(cfg, given) in its own folder (under torchrun
    every process runs each seed in turn: one distributed run a seed), then their statistics: written to
    seeds.json and printed by rank 0, and returned (rank 0; the others return {}). `optimizers`:
    models.OPTIMIZERS, for --lr auto."""
    cfg = validate(Config(**given))  # the ranges (each run checks its own choices)
    out_dir, seeds = Path(cfg.out_dir), range(cfg.seed, cfg.seed + cfg.seeds)
    check_repeat(cfg, out_dir)
    if cfg.lr == "auto":  # one sweep for every seed: <out-dir>/lr_find.json, read once, its rate in each run
        given = {**given, "lr": resolve_lr(cfg, task, optimizers)}
    for seed in seeds:  # before any run: a kept seed of another config would be averaged with these
        check_kept(seed_folder(out_dir, seed), Config(**run_settings(given, out_dir, seed)))
    for number, seed in enumerate(seeds, 1):
        folder = seed_folder(out_dir, seed)
        if (folder / "summary.json").is_file():
            processes.say(f"seed {seed} ({number} of {len(seeds)}): finished before, kept ({folder})")
            continue
        processes.say(f"seed {seed} ({number} of {len(seeds)}): {folder}")
        settings = run_settings(given, out_dir, seed)
        train(Config(**settings), settings)
    if processes.rank() != 0:
        return {}
    record = summarize([seed_folder(out_dir, seed) for seed in seeds], list(seeds), task)
    write_json_atomic(out_dir / RECORD, record)
    print(spread_table(record, out_dir))
    return record


def seed_folder(out_dir: Path, seed: int) -> Path:
    return out_dir / f"seed-{seed}"


def run_settings(given: dict, out_dir: Path, seed: int) -> dict:
    """One seed's run: the settings given, with its seed and folder, resumed where its last.pt is (the run's
    own --resume: the checkpoint's config, refused if the settings given now differ)."""
    folder = seed_folder(out_dir, seed)
    settings = {name: value for name, value in given.items() if name not in ("seeds", "resume")}
    resume = {"resume": "last"} if (folder / "last.pt").is_file() else {}
    return {**settings, "seed": seed, "out_dir": str(folder), **resume}


def check_repeat(cfg: Config, out_dir: Path) -> None:
    """A repeat's own folder, of seeds a seed may take; --resume PATH names one run, not a repeat."""
    if cfg.resume and cfg.resume not in OUT_DIR_RESUMES:
        raise UserError(f"--resume {cfg.resume} continues one run; a --seeds repeat continues by itself: run "
                        "the same command again (without --resume)")
    if cfg.seed + cfg.seeds > 2**32:
        raise UserError(f"--seed {cfg.seed} with --seeds {cfg.seeds} runs past the last seed, 2**32 - 1; "
                        "lower --seed")
    if held := [name for name in ("last.pt", "summary.json", "config.json") if (out_dir / name).exists()]:
        raise UserError(f"{out_dir} holds a single run ({', '.join(held)}), and a --seeds repeat puts its "
                        "runs in seed-<s>/ folders of a folder of its own: pick another --out-dir")


def check_kept(folder: Path, cfg: Config) -> None:
    """A seed folder run before (its config.json) must hold a run of this config: one line naming what
    differs. --lr auto is the number its run resolved it to."""
    if not (folder / "config.json").is_file():
        return
    saved = read_json(folder / "config.json", "the seed's config")
    allowed = (*MAY_CHANGE_ON_RESUME, *(("lr",) if cfg.lr == "auto" else ()))
    if diffs := differences(saved, cfg, allowed):
        raise UserError(f"{folder} holds a run of another config ({'; '.join(diffs)}); run the repeat with "
                        "its settings, or pick another --out-dir")


def read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{what} {path} cannot be read ({err}); run its command again") from None
    if not isinstance(value, dict):
        raise UserError(f"{what} {path} is not a JSON object; run its command again")
    return value


def numbers(summary: dict) -> dict:
    """A summary's numbers (not true/false)."""
    return {k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def summarize(folders: list[Path], seeds: list[int], task) -> dict:
    """seeds.json: the spread of each number that every seed's summary.json holds, each seed's numbers, the
    config the seeds share, the task whose metrics they are, and the splits' sizes."""
    summaries = [numbers(read_json(folder / "summary.json", "summary")) for folder in folders]
    shared = [name for name in summaries[0] if all(name in summary for summary in summaries)]
    config = read_json(folders[0] / "config.json", "the seed's config")
    return {"seeds": seeds, "task": task.NAME, "main_metric": task.MAIN_METRIC,
            "higher_is_better": task.HIGHER_IS_BETTER,
            "config": {k: v for k, v in config.items() if k not in PER_RUN},
            "splits": {k: summaries[0][k] for k in SPLITS if k in summaries[0]},
            "metrics": {name: spread([summary[name] for summary in summaries]) for name in shared},
            "per_seed": {str(seed): {name: summary[name] for name in shared}
                         for seed, summary in zip(seeds, summaries, strict=True)}}


def spread_table(record: dict, out_dir: Path) -> str:
    """The printed table: the task's metrics, and the other numbers where they differ between seeds."""
    seeds, rows = record["seeds"], []
    for name, row in record["metrics"].items():
        if is_metric(name) or row["min"] != row["max"]:
            std = "" if row["std"] is None else f" ± {row['std']:.4g}"
            rows.append([name, f"{row['mean']:.4g}{std}", interval(row), str(row["n"]), f"{row['min']:.4g}",
                         f"{row['max']:.4g}"])
    head = (f"{len(seeds)} seeds ({shown_seeds(seeds)}) in {out_dir}: mean ± std (sample), the 95% interval "
            f"of the mean (Student's t, {len(seeds) - 1} df); all numbers in {out_dir / RECORD}")
    return head + "\n" + aligned([["", "mean ± std", "95% interval", "n", "min", "max"], *rows])


def is_metric(name: str) -> bool:
    return name.startswith(METRIC_PREFIXES) and name not in SPLITS


def interval(row: dict, sign: str = "") -> str:
    return "-" if row["low"] is None else f"[{row['low']:{sign}.4g}, {row['high']:{sign}.4g}]"


def shown_seeds(seeds: list[int]) -> str:
    whole = seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    return f"{seeds[0]}-{seeds[-1]}" if whole and len(seeds) > 1 else ", ".join(map(str, seeds))


def aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


# ---------------------------------------------------------------- two repeats, seed by seed


def compare(first: Path, second: Path) -> dict:
    """B - A for each number both repeats hold, over the seeds they share: its mean, 95% interval and, for the
    task's main metric, on how many seeds B did better (the task's HIGHER_IS_BETTER) or worse. The settings
    in which B differs from A are listed: the change being measured."""
    a, b = read_record(first), read_record(second)
    shared = check_pairs(a, b, first, second)
    changed = [f"{k} {a['config'].get(k)!r} -> {b['config'].get(k)!r}" for k in {**a["config"], **b["config"]}
               if a["config"].get(k) != b["config"].get(k)]
    main = [f"{prefix}{a['main_metric']}" for prefix in METRIC_PREFIXES]
    rows = {}
    for name in (name for name in a["metrics"] if name in b["metrics"]):
        diffs = [b["per_seed"][str(s)][name] - a["per_seed"][str(s)][name] for s in shared]
        rows[name] = spread(diffs)
        if name in main:
            better = [d if a["higher_is_better"] else -d for d in diffs]
            rows[name] |= {"better": sum(d > 0 for d in better), "worse": sum(d < 0 for d in better)}
    return {"a": str(first), "b": str(second), "seeds": shared, "changed": changed, "differences": rows,
            "main_metric": a["main_metric"], "higher_is_better": a["higher_is_better"]}


def check_pairs(a: dict, b: dict, first: Path, second: Path) -> list[int]:
    """The seeds two repeats share, or one line: one folder twice, two tasks, other examples (the data
    settings or the splits' sizes differ), no seed in common."""
    if first.resolve() == second.resolve():
        raise UserError(f"{first} and {second} are one folder; compare two repeats")
    if (a["task"], a["main_metric"]) != (b["task"], b["main_metric"]):
        raise UserError(f"{first} holds {a['task']} runs and {second} {b['task']} runs: no metric compares")
    data = [f"{k} {a['config'].get(k)!r} -> {b['config'].get(k)!r}" for k in SAME_EXAMPLES
            if a["config"].get(k) != b["config"].get(k)]
    data += [f"{k} {size} -> {b['splits'].get(k)}" for k, size in a["splits"].items()
             if size != b["splits"].get(k)]
    if data:
        raise UserError(f"{first} and {second} were measured on other examples ({'; '.join(data)}): seed by "
                        "seed they do not pair; compare repeats on the same data")
    if not (shared := sorted(set(a["seeds"]) & set(b["seeds"]))):
        raise UserError(f"{first} ran seeds {shown_seeds(a['seeds'])}, {second} {shown_seeds(b['seeds'])}: "
                        "no seed in common to pair; run one with the other's --seed")
    return shared


def read_record(folder: Path) -> dict:
    """A finished repeat's seeds.json, or one line: not a repeat, or one whose command has not finished."""
    path = folder / RECORD
    if not path.is_file():
        started = any(folder.glob("seed-*/config.json"))
        raise UserError(f"{folder} is a seed repeat not finished yet: run its train.py --seeds command again"
                        if started else f"{folder} is not a seed repeat (no {RECORD}): make one with "
                        f"`python train.py --seeds N --out-dir {folder}`")
    record = read_json(path, "the repeat's record")
    if not {"seeds", "task", "main_metric", "config", "splits", "metrics", "per_seed"} <= set(record):
        raise UserError(f"{path} is not a train.py --seeds record; run its command again")
    return record


def comparison_table(result: dict) -> str:
    """The printed comparison: what B changes, then B - A per metric of the task."""
    seeds, direction = result["seeds"], "higher" if result["higher_is_better"] else "lower"
    rows = [["B - A", "mean", "95% interval", "n", "B better (main metric)"]]
    for name, row in result["differences"].items():
        if is_metric(name):
            better = "" if "better" not in row else (f"{row['better']} of {row['n']} ({row['worse']} worse, "
                                                     f"{row['n'] - row['better'] - row['worse']} tied)")
            rows.append([name, f"{row['mean']:+.4g}", interval(row, "+"), str(row["n"]), better])
    return "\n".join([f"A {result['a']}, B {result['b']}: paired by seed over {len(seeds)} seeds "
                      f"({shown_seeds(seeds)}); the main metric, {result['main_metric']}: {direction} is "
                      "better",
                      f"B changes: {', '.join(result['changed']) or 'no setting (the code, then?)'}",
                      aligned(rows)])
