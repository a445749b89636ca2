"""Forks, as users make them: the template copied, task.py replaced (multi-label: BCE + F1; regression:
MSE + MAE) and a dataset entry added to data.py, or a dataset and a model entry for 1-D signals.
Nothing else is edited, and every command works: lr_find.py, --lr auto, Ctrl-C's SIGTERM and
--resume to the same weights, evaluate.py (--checkpoint and --predict), TensorBoard."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import make_fork, read_scalars
from PIL import Image
from test_resume import assert_same_state, final_state

FORKS = {  # task file, dataset entry, flags, the main metric and a value it must beat, --predict's columns
    "regression": ("regression", "regression_data",
                   ["--dataset", "square_positions", "--synthetic-size", "128", "--epochs", "12"], "mae",
                   lambda v: v < 0.2, "file,row,column"),
    "multilabel": ("multilabel", "multilabel_data", ["--dataset", "digit_facts", "--epochs", "4"], "f1",
                   lambda v: v > 0.6, "file,tags,even,above_4,prime"),
}
SMALL = ["--width", "8", "--batch-size", "32", "--device", "cpu", "--num-workers", "0", "--find-iters", "20"]


def run(project, *args, timeout=240):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=project, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def interrupted(project, *args) -> str:
    """train.py stopped by SIGTERM soon after its first save, as a scheduler's stop would."""
    out_dir = project / args[args.index("--out-dir") + 1]
    proc = subprocess.Popen([sys.executable, "train.py", *map(str, args)], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out_dir / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    return out


@pytest.mark.parametrize("name", FORKS)
def test_a_task_fork_changes_task_py_and_adds_a_dataset(name, tmp_path):
    task, dataset, flags, metric, good, columns = FORKS[name]
    project = make_fork(tmp_path, task, data=(dataset,))
    argv = [*flags, *SMALL, "--save-every", "2"]

    # python lr_find.py, then --lr auto, stopped by SIGTERM and resumed
    swept = run(project, "lr_find.py", *argv, "--out-dir", "a")
    assert "suggested lr" in swept
    record = json.loads((project / "a" / "lr_find.json").read_text())
    assert record["config"]["task"]["name"] == name
    assert "interrupted at step" in interrupted(project, *argv, "--lr", "auto", "--out-dir", "a")
    resumed = run(project, "train.py", "--resume", "--out-dir", "a")
    assert "resumed from" in resumed
    summary = json.loads((project / "a" / "summary.json").read_text())
    assert summary["lr"] == record["suggestion"] and good(summary[f"best_val_{metric}"]), summary

    # the same run without the stop ends with the same weights as the sweep, the stop and the resume
    run(project, "train.py", *argv, "--lr", repr(summary["lr"]), "--out-dir", "b")
    assert_same_state(final_state(project / "a" / "last.pt"), final_state(project / "b" / "last.pt"))

    # evaluate.py on best.pt gives the best val metric; TensorBoard has the task's curves, each step once
    run(project, "evaluate.py", "--checkpoint", "a/best.pt")
    report = json.loads((project / "a" / "eval.json").read_text())
    assert report[f"val_{metric}"] == pytest.approx(summary[f"best_val_{metric}"])
    scalars = read_scalars(project / "a")
    assert {"train/loss", "train/lr", "val/loss", f"val/{metric}"} <= scalars.keys()
    assert [step for step, _ in scalars["train/lr"]] == [step for step, _ in scalars["train/loss"]]

    # --predict: the fork's task.py says what a row of predictions.csv is
    (project / "new").mkdir()
    for i in range(3):
        Image.new("L", (8, 8), 40 * i).save(project / "new" / f"{i}.png")
    assert "3 files predicted -> a/predictions.csv" in run(project, "evaluate.py", "--predict", "new",
                                                             "--checkpoint", "a/best.pt")
    assert (project / "a" / "predictions.csv").read_text().splitlines()[0] == columns


def test_a_signal_fork_adds_a_dataset_and_a_model(tmp_path):
    """[N, 1, 256] float signals with a 1-D CNN: the default task, the image steps left out."""
    project = make_fork(tmp_path, "classification", data=("signals_data",), model=("signals_model",))
    argv = ["--dataset", "waves", "--synthetic-size", "512", "--model", "conv1dnet", *SMALL, "--epochs", "4",
            "--channels-last", "--out-dir", "run"]
    assert "suggested lr" in run(project, "lr_find.py", *argv)
    out = run(project, "train.py", *argv, "--lr", "auto")
    assert "inputs 1x256, 4 outputs" in out and "not uint8 images: no crop, flip" in out
    assert "no input or wrong-input pictures" in out
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["best_val_acc"] > 0.5  # four classes: chance is 0.25
    assert list(summary["per_class_acc"]) == ["2 Hz", "5 Hz", "8 Hz", "11 Hz"]
    assert torch.load(project / "run" / "best.pt", weights_only=True)["task"] == "classification"


# The machinery tests a fork's copy runs (each brings its own task and data, so task.py does not matter):
# accumulation and torchrun, host reads per step, the data contract, and the bad-input cases.
MACHINERY = ["tests/test_accumulation.py", "tests/test_sync.py", "tests/test_contract.py",
             "tests/test_faults.py::test_bad_input_is_one_line_and_touches_no_checkpoint"]


def test_a_task_fork_keeps_the_machinery_tests(tmp_path):
    """The README's regression fork, made in a copy of the template with its tests: task.py replaced, a
    dataset and a model added. The machinery tests pass there as here; those of the default task skip."""
    project = make_fork(tmp_path, "regression", data=("regression_data",), model=("signals_model",),
                        tests=True)
    result = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs", "-p",
                             "no:cacheprovider", *MACHINERY], cwd=project, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stdout[-3000:]
    said = re.findall(r"(\d+) (passed|skipped|failed|errors?)\b", result.stdout)
    counts = {word: int(n) for n, word in said}
    assert counts["passed"] > 60 and counts.keys() <= {"passed", "skipped"}, counts
    assert "task.py holds another task ('regression')" in result.stdout, result.stdout[-2000:]


def test_a_fork_of_two_inputs_adds_a_dataset_and_a_model(tmp_path):
    """Examples of an image and a table (tests/forks/two_inputs_*.py), a model that unpacks them: swept,
    trained with --lr auto, stopped by SIGTERM and resumed to a straight run's state, evaluated to the
    summary's best (--predict's refusal: tests/test_several_inputs.py)."""
    project = make_fork(tmp_path, "classification", data=("two_inputs_data",), model=("two_inputs_model",))
    argv = ["--dataset", "pairs", "--model", "twoinputnet", "--synthetic-size", "512", *SMALL, "--epochs",
            "6", "--save-every", "2", "--find-iters", "200"]  # fewer: the loss still falls at 10
    assert "suggested lr" in run(project, "lr_find.py", *argv, "--out-dir", "a")
    assert "interrupted at step" in interrupted(project, *argv, "--lr", "auto", "--out-dir", "a")
    assert "resumed from" in run(project, "train.py", "--resume", "--out-dir", "a")
    summary = json.loads((project / "a" / "summary.json").read_text())
    assert summary["best_val_acc"] > 0.8
    run(project, "train.py", *argv, "--lr", repr(summary["lr"]), "--out-dir", "b")
    assert_same_state(final_state(project / "a" / "last.pt"), final_state(project / "b" / "last.pt"))
    run(project, "evaluate.py", "--checkpoint", "a/best.pt")
    assert json.loads((project / "a" / "eval.json").read_text())["val_acc"] == summary["best_val_acc"]
