"""`python lr_find.py` end to end, and `train.py --lr auto` picking up its suggestion."""

import json
import math

import pytest
from conftest import read_scalars

from lr_find import _next_command


def test_cli_on_digits_then_train_with_lr_auto(tmp_path, script):
    result = script("lr_find.py", "--out-dir", str(tmp_path), "--find-iters", "30")
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert {"lrs", "losses", "smoothed", "suggestion", "stop_reason", "config"} <= record.keys()
    assert record["lrs"][0] == record["config"]["find_start_lr"] == 1e-7
    suggestion = record["suggestion"]
    assert suggestion is not None and record["lrs"][0] < suggestion < record["lrs"][-1]
    assert (tmp_path / "lr_find.png").stat().st_size > 1000
    scalars = read_scalars(tmp_path)
    assert {"lr_find/loss", "lr_find/smoothed", "lr_find/lr"} <= scalars.keys()
    assert [v for _, v in scalars["lr_find/lr"]] == pytest.approx(record["lrs"], rel=1e-6)
    assert f"suggested lr: {suggestion:.3g}" in result.stdout
    assert f"python train.py --out-dir {tmp_path} --lr auto" in result.stdout

    trained = script("train.py", "--out-dir", str(tmp_path), "--lr", "auto", "--epochs", "1")
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert math.isclose(summary["lr"], suggestion)
    assert f"lr {suggestion:.4g}" in trained.stdout


def test_lr_auto_without_a_suggestion_says_run_lr_find_first(tmp_path, script):
    (tmp_path / "lr_find.json").write_text(json.dumps({"suggestion": None}))
    result = script("train.py", "--out-dir", str(tmp_path), "--lr", "auto")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "python lr_find.py" in result.stderr


def test_refuses_to_run_under_torchrun(script):
    result = script("lr_find.py", env={"WORLD_SIZE": "2", "RANK": "1"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "one process" in result.stderr


def test_bad_flags_exit_2(script):
    result = script("lr_find.py", "--find-start-lr", "5", "--find-end-lr", "1")
    assert result.returncode == 2 and "find_start_lr" in result.stderr


def test_next_command_keeps_flags_but_not_lr_or_sweep_settings():
    argv = ["--config", "configs/mnist.toml", "--lr", "0.3", "--find-iters=80", "--find-end-lr",
            "1", "--out-dir", "runs/a b"]
    assert _next_command(argv) == (
        "python train.py --config configs/mnist.toml --out-dir 'runs/a b' --lr auto")
