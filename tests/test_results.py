"""Results you can publish (issue 33): early stopping on the task's main metric, and an exponential
moving average of the weights (--ema) that evaluation, best.pt, --evaluate and --predict use."""

import json

import pytest
import torch
from conftest import crash_at_step, run_main
from test_faults import TINY
from test_resume import assert_same_state, final_state

import task
import train
from configs import Config, parse_config, parse_given
from data import build_loaders
from models import build_model

CPU = torch.device("cpu")


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


def test_ema_resumes_bit_identical_and_is_what_evaluation_uses(tmp_path, monkeypatch, capsys):
    """--ema 0.9: a run crashed mid-epoch and resumed ends with every tensor of an uninterrupted one's,
    the average's too; its val loss is the average's (which differs from the raw weights'), and so is
    --evaluate's."""
    argv = [*TINY, "--epochs", "3", "--ema", "0.9", "--save-every", "3"]
    summary = train.train(parse_config([*argv, "--out-dir", str(tmp_path / "straight")]))
    with crash_at_step(monkeypatch, 6):
        train.train(parse_config([*argv, "--out-dir", str(tmp_path / "broken")]))
    given = parse_given(["--resume", "--out-dir", str(tmp_path / "broken")])
    train.train(Config(**given), given)
    saved = {run: tmp_path / run / "last.pt" for run in ("straight", "broken")}
    assert_same_state(final_state(saved["straight"]), final_state(saved["broken"]))
    straight, broken = (torch.load(path, weights_only=True) for path in saved.values())
    assert_same_state(straight["ema"], broken["ema"], "ema")

    cfg = parse_config(argv)
    _, val_batches, info = build_loaders(cfg, CPU)

    def val_loss(weights: dict) -> float:
        model = build_model(cfg, info.input_shape[0], len(info.names))
        model.load_state_dict(weights)
        return train.evaluate(model, val_batches, task, cfg, info, CPU, None).metrics["loss"]

    assert val_loss(straight["ema"]) == pytest.approx(summary["val_loss"], rel=1e-6)
    assert abs(val_loss(straight["model"]) - summary["val_loss"]) > 1e-3
    code, out, err = run_main(monkeypatch, capsys, "--evaluate", tmp_path / "straight" / "last.pt")
    assert code == 0, err
    report = json.loads((tmp_path / "straight" / "eval.json").read_text())
    assert report["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
