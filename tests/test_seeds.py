"""Seed repeats (`train.py --seeds N`, machinery/seeds.py) and their paired comparison (compare_seeds.py):
the statistics against a computation by hand, one real tiny repeat interrupted and continued, and each
refusal in one line. The statistics run on summary.json files a stand-in for train() writes."""

import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import fingerprint, run_main
from test_work_kept import TINY, one_line

import compare_seeds
import task
import train
from configs import Config
from machinery import seeds
from machinery.intervals import spread, t_quantile

# Student's t, P(T <= t) = 0.975, by degrees of freedom, as printed in the tables (3 decimals)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 99: 1.984, 120: 1.980}


def test_t_quantiles_are_the_tables_to_3_decimals_and_scipys_to_1e_12():
    for df, printed in T975.items():
        assert round(t_quantile(0.975, df), 3) == printed, df
    stats = pytest.importorskip("scipy.stats")  # not a requirement: where it is installed, all of 1 to 100
    for df in range(1, 101):
        assert t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-12), df
    assert t_quantile(0.95, 7) == pytest.approx(stats.t.ppf(0.95, 7), rel=1e-12)
    with pytest.raises(ValueError):
        t_quantile(0.975, 0)


def by_hand(values: list[float]) -> tuple[float, float, float, float]:
    """mean, sample std, and the 95% interval with the table's t."""
    mean, std = statistics.mean(values), statistics.stdev(values)
    half = T975[len(values) - 1] * std / math.sqrt(len(values))
    return mean, std, mean - half, mean + half


def fake_train(values: dict[int, dict], ran: list):
    """A stand-in for train.train(): a seed's config.json and summary.json, its numbers from `values`."""
    def run(cfg: Config, given: dict) -> dict:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict()))
        summary = {**values[cfg.seed], "val_size": 16, "test_size": 16, "device": "cpu",
                   "ranks_in_sync": True}
        (out / "summary.json").write_text(json.dumps(summary))
        ran.append((cfg.seed, given["seed"], given["out_dir"]))
        return summary
    return run


def made(folder: Path, accs: dict[int, float], settings: dict | None = None, the_task=task) -> dict:
    """A repeat in `folder` of the seeds in `accs`, each its val acc (and a loss of 1 - acc)."""
    values = {s: {"val_acc": acc, "val_loss": 1 - acc, "steps": 4} for s, acc in accs.items()}
    given = {"seeds": len(accs), "seed": min(accs), "out_dir": str(folder), **(settings or {})}
    return seeds.repeat(fake_train(values, []), given, the_task)


def test_the_seed_summary_is_the_mean_std_and_t_interval_of_the_seeds_summaries(tmp_path, capsys):
    accs = {5: 0.81, 6: 0.9, 7: 0.72, 8: 0.86}
    values, ran = {s: {"val_acc": a, "val_loss": 1 - a, "steps": 4} for s, a in accs.items()}, []
    kept = tmp_path / "rep" / "seed-6"
    fake_train(values, [])(Config(seed=6, out_dir=str(kept)), {"seed": 6, "out_dir": str(kept)})
    record = seeds.repeat(fake_train(values, ran), {"seeds": 4, "seed": 5, "out_dir": str(tmp_path / "rep")},
                          task)
    assert [seed for seed, _, _ in ran] == [5, 7, 8], "seed 6 had its summary.json: not run again"
    assert all(given == seed and folder.endswith(f"seed-{seed}") for seed, given, folder in ran)
    assert record == json.loads((tmp_path / "rep" / "seeds.json").read_text())
    assert record["seeds"] == [5, 6, 7, 8] and record["main_metric"] == "acc" and record["higher_is_better"]
    for name, values_of in (("val_acc", list(accs.values())), ("val_loss", [1 - a for a in accs.values()])):
        mean, std, low, high = by_hand(values_of)
        row = record["metrics"][name]
        assert (row["n"], row["min"], row["max"]) == (4, min(values_of), max(values_of))
        assert (row["mean"], row["std"]) == (pytest.approx(mean, rel=1e-12), pytest.approx(std, rel=1e-12))
        assert (row["low"], row["high"]) == (pytest.approx(low, rel=1e-3), pytest.approx(high, rel=1e-3))
    assert record["metrics"]["steps"] == spread([4, 4, 4, 4]) and "ranks_in_sync" not in record["metrics"]
    printed = capsys.readouterr().out
    table = printed[printed.index("4 seeds (5-8)"):]
    assert "seed 6 (2 of 4): finished before, kept" in printed and "Student's t, 3 df" in table
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["val_acc", "val_loss"], (
        "the task's metrics, and other numbers only where they differ between seeds")
    assert seeds.spread([0.5])["std"] is None and seeds.spread([0.5])["low"] is None  # one seed: no spread


def test_an_interrupted_seed_continues_and_a_finished_one_is_not_run_again(tmp_path, monkeypatch, capsys):
    """The one real repeat: 2 seeds of 2 epochs (8 steps each), seed 1 stopped at its step 3 (last.pt at 2);
    the same command again keeps seed 0 as it was and resumes seed 1 to its end."""
    out = tmp_path / "rep"
    command = [*TINY, "--epochs", "2", "--save-every", "2", "--seeds", "2", "--out-dir", out]
    real, calls = train.optimizer_step, [0]

    def crash(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 8 + 3:
            raise RuntimeError("the machine went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", crash)
    with pytest.raises(RuntimeError, match="went away"):
        run_main(monkeypatch, capsys, *command)
    monkeypatch.setattr(train, "optimizer_step", real)
    first = json.loads((out / "seed-0" / "summary.json").read_text())
    kept = fingerprint(out / "seed-0")
    assert not (out / "seed-1" / "summary.json").exists() and not (out / "seeds.json").exists()

    code, printed, err = run_main(monkeypatch, capsys, *command)
    assert code == 0, err
    assert "seed 0 (1 of 2): finished before, kept" in printed
    assert f"resumed from {out / 'seed-1' / 'last.pt'} at step 2" in printed
    assert fingerprint(out / "seed-0") == kept
    assert json.loads((out / "seed-0" / "summary.json").read_text()) == first
    second = json.loads((out / "seed-1" / "summary.json").read_text())
    assert (second["steps"], second["parts"]) == (8, 2)
    assert [json.loads((out / f"seed-{s}" / "config.json").read_text())["seed"] for s in (0, 1)] == [0, 1]
    record = json.loads((out / "seeds.json").read_text())
    for name in ("val_acc", "val_loss", "test_acc"):
        pair = [first[name], second[name]]
        mean, std = statistics.mean(pair), statistics.stdev(pair)
        row = record["metrics"][name]
        assert (row["mean"], row["std"]) == (pytest.approx(mean, rel=1e-12), pytest.approx(std, abs=1e-12))
        assert row["high"] - row["mean"] == pytest.approx(T975[1] * std / math.sqrt(2), rel=1e-3, abs=1e-12)
    assert record["config"]["epochs"] == 2 and "seed" not in record["config"]


def test_the_comparison_pairs_by_seed(tmp_path, capsys):
    a = {0: 0.80, 1: 0.85, 2: 0.90, 3: 0.70}
    gains = {1: 0.02, 2: -0.01, 3: 0.03, 4: 0.0}  # B ran seeds 1 to 4: seeds 1 to 3 pair
    made(tmp_path / "a", a)
    made(tmp_path / "b", {s: a.get(s, 0.5) + gain for s, gain in gains.items()}, {"lr": 0.1, "ema": 0.9})
    capsys.readouterr()
    result = compare_seeds.main([str(tmp_path / "a"), str(tmp_path / "b")])
    diffs = [0.02, -0.01, 0.03]
    mean, std, low, high = by_hand(diffs)
    row = result["differences"]["val_acc"]
    assert result["seeds"] == [1, 2, 3] and row["n"] == 3
    assert (row["mean"], row["std"]) == (pytest.approx(mean, rel=1e-9), pytest.approx(std, rel=1e-9))
    assert (row["low"], row["high"]) == (pytest.approx(low, rel=1e-3), pytest.approx(high, rel=1e-3))
    assert (row["better"], row["worse"]) == (2, 1)
    assert "better" not in result["differences"]["val_loss"], "only the main metric has a direction"
    assert result["differences"]["val_loss"]["mean"] == pytest.approx(-mean, rel=1e-9)
    assert result["changed"] == ["lr 0.2 -> 0.1", "ema 0.0 -> 0.9"], "the change measured, in Config's order"
    printed = capsys.readouterr().out
    assert "paired by seed over 3 seeds (1-3)" in printed and "2 of 3 (1 worse, 0 tied)" in printed

    lower = SimpleNamespace(NAME="classification", MAIN_METRIC="acc", HIGHER_IS_BETTER=False)
    made(tmp_path / "c", a, the_task=lower)
    made(tmp_path / "d", {s: a.get(s, 0.5) + gain for s, gain in gains.items()}, the_task=lower)
    row = seeds.compare(tmp_path / "c", tmp_path / "d")["differences"]["val_acc"]
    assert (row["better"], row["worse"]) == (1, 2), "lower is better: B's higher acc loses"


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        compare_seeds.main([str(a) for a in argv])
    return one_line(stop.value.code, capsys.readouterr().err)


def test_the_comparison_refuses_what_does_not_pair(tmp_path, capsys):
    made(tmp_path / "a", {0: 0.8, 1: 0.9})
    made(tmp_path / "far", {7: 0.8, 8: 0.9})
    made(tmp_path / "other", {0: 0.8, 1: 0.9}, {"dataset": "synthetic", "val_fraction": 0.2})
    made(tmp_path / "regression", {0: 0.8, 1: 0.9},
         the_task=SimpleNamespace(NAME="regression", MAIN_METRIC="acc", HIGHER_IS_BETTER=True))
    (tmp_path / "plain").mkdir()
    (tmp_path / "unfinished" / "seed-0").mkdir(parents=True)
    (tmp_path / "unfinished" / "seed-0" / "config.json").write_text("{}")
    a = tmp_path / "a"
    assert "is not a seed repeat (no seeds.json)" in refused(capsys, a, tmp_path / "plain")
    assert "is a seed repeat not finished yet" in refused(capsys, tmp_path / "unfinished", a)
    assert "are one folder" in refused(capsys, a, a)
    assert "holds classification runs" in refused(capsys, a, tmp_path / "regression")
    line = refused(capsys, a, tmp_path / "other")
    assert "measured on other examples (dataset 'digits' -> 'synthetic'; val_fraction 0.1 -> 0.2)" in line
    line = refused(capsys, a, tmp_path / "far")
    assert "ran seeds 0-1" in line and "7-8: no seed in common to pair" in line


def test_a_repeat_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text("{}")
    code, _, err = run_main(monkeypatch, capsys, *TINY, "--seeds", "2", "--out-dir", single)
    assert "holds a single run (config.json)" in one_line(code, err)
    code, _, err = run_main(monkeypatch, capsys, *TINY, "--seeds", "2", "--resume", single / "last.pt")
    assert "a --seeds repeat continues by itself" in one_line(code, err)
    code, _, err = run_main(monkeypatch, capsys, *TINY, "--seeds", "2", "--seed", str(2**32 - 1))
    assert "runs past the last seed" in one_line(code, err)
    made(tmp_path / "rep", {0: 0.8, 1: 0.9})  # its seeds ran with lr 0.2 and the default epochs
    code, _, err = run_main(monkeypatch, capsys, *TINY, "--seeds", "2", "--epochs", "3", "--out-dir",
                            tmp_path / "rep")
    line = one_line(code, err)
    assert f"{tmp_path / 'rep' / 'seed-0'} holds a run of another config (" in line
    assert "epochs: 10 -> 3" in line and "seed:" not in line and "seeds:" not in line
    code, _, err = run_main(monkeypatch, capsys, *TINY, "--seeds", "-1")
    assert "seeds must be a number >= 0, got -1" in one_line(code, err)


def test_lr_auto_reads_the_repeats_one_sweep_for_every_seed(tmp_path, capsys):
    """`lr_find.py --out-dir R` then `train.py --seeds N --lr auto --out-dir R`: each seed trains at
    R/lr_find.json's rate (a seed's own folder holds no sweep)."""
    import lr_find
    from configs import parse_given
    from models import OPTIMIZERS

    folder = tmp_path / "rep"
    lr_find.main([*TINY, "--out-dir", str(folder)])
    swept = json.loads((folder / "lr_find.json").read_text())["suggestions"]["peak"]["lr"]
    ran = []
    values = {s: {"val_acc": 0.5, "val_loss": 0.5, "steps": 4} for s in (0, 1)}
    given = parse_given([*TINY, "--seeds", "2", "--lr", "auto", "--out-dir", str(folder)])
    seeds.repeat(lambda cfg, settings: ran.append(settings["lr"]) or fake_train(values, [])(cfg, settings),
                 given, task, OPTIMIZERS)
    assert ran == [swept, swept]


def test_under_torchrun_each_seed_is_one_distributed_run_and_rank_0_keeps_the_best(tmp_path):
    """`torchrun --nproc_per_node 2 train.py --seeds 2 --keep-best 2`: each seed one run of two processes
    (one group for both), one table, and in each seed's folder the two best checkpoints that best-k.json
    ranks, written and pruned by rank 0 alone (a second writer would race it: its own unit test is
    test_kept_best.py's rank test)."""
    from test_resume import torchrun

    folder = tmp_path / "rep"
    result = torchrun(*TINY, "--epochs", "3", "--seeds", "2", "--keep-best", "2", "--out-dir", str(folder))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done:") == 2 and result.stdout.count("seed 1 (2 of 2)") == 1, result.stdout
    record = json.loads((folder / seeds.RECORD).read_text())
    assert record["seeds"] == [0, 1] and record["metrics"]["val_acc"]["n"] == 2
    for seed in (0, 1):
        run = seeds.seed_folder(folder, seed)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["ranks_in_sync"] is True and summary["steps"] == 12
        ranked = json.loads((run / "best-k.json").read_text())["ranked"]
        assert len(ranked) == 2 and sorted(p.name for p in run.glob("best-step*.pt")) == sorted(
            entry["file"] for entry in ranked)
        assert json.loads((run / "config.json").read_text())["seed"] == seed
