"""Results you can publish (issue 33): early stopping on the task's main metric."""

import json

import torch
from conftest import run_main
from test_faults import TINY


def test_early_stop_ends_a_run_that_cannot_improve_and_says_so(tmp_path, monkeypatch, capsys):
    """--early-stop 2 with a --min-delta no epoch reaches: the first evaluation is the best, two more
    without a gain stop the run after epoch 3 of 10, in one line; summary.json says why, best.pt holds
    the best, a resume says the run is complete, and a new run may take the folder."""
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "10", "--early-stop", "2",
                              "--min-delta", "0.9", "--out-dir", tmp_path)
    assert code == 0, err
    assert "early stop after epoch 3/10: val acc did not improve by more than 0.9 in 2 evaluations" in out
    assert "stopped early after epoch 3" in out.splitlines()[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs_run"] == 3 and "(--early-stop 2)" in summary["stopped"] and summary["steps"] == 12
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 12
    assert torch.load(tmp_path / "best.pt", weights_only=True)["run"]["best"] == summary["best_val_acc"]
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    assert code == 0 and "holds a run that stopped early at epoch 3" in out, err
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    assert code == 0, err  # a stopped run is a finished one: not refused as unfinished


def test_early_stop_waits_for_its_patience(tmp_path, monkeypatch, capsys):
    """Without a gain threshold, a run that keeps improving now and then runs to its end."""
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "3", "--early-stop", "3",
                              "--out-dir", tmp_path)
    assert code == 0 and "early stop" not in out, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs_run"] == 3 and summary["stopped"] is None
