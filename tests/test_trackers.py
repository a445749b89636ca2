"""Issue 43: --log-to's trackers. An unknown name or a missing package is one line with nothing written;
W&B (offline) keeps one run across a SIGTERM and --resume; MLflow (on SQLite, read back with MlflowClient)
keeps one run whose points are each there once, with the lr as a parameter."""

import json
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, crash_at_step, run_main, run_script
from forks import classification
from test_faults import assert_one_line_failure
from test_work_kept import TINY, interrupt

import train
from configs import Config, parse_config, parse_given
from machinery import checkpoints, trackers


def test_an_unknown_tracker_or_a_missing_package_is_one_line_with_nothing_written(tmp_path, monkeypatch,
                                                                                  capsys):
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--log-to", "tensorbord", "--out-dir",
                              tmp_path / "a")
    line = assert_one_line_failure(code, out, err)
    assert "unknown --log-to 'tensorbord'; did you mean 'tensorboard'?" in line
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: its import fails
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--log-to", "tensorboard,wandb", "--out-dir",
                              tmp_path / "b")
    assert "the wandb package is not installed; pip install wandb" in assert_one_line_failure(code, out, err)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_wandb_offline_keeps_one_run_across_a_sigterm_and_resume(tmp_path):
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    argv = [*TINY, "--epochs", "30", "--save-every", "3", "--log-to", "tensorboard,csv,wandb"]
    stopped = interrupt(argv, tmp_path, signal.SIGTERM, env=env)
    assert stopped.returncode == 128 + signal.SIGTERM and stopped.stderr == "", stopped.stderr[-2000:]
    first = checkpoints.load_checkpoint(tmp_path / "last.pt")["trackers"]["wandb"]
    done = run_script("train.py", "--resume", "--out-dir", str(tmp_path), "--log-model", env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["trackers"] == {"wandb": first}
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{first}") for name in runs), runs


def test_mlflow_keeps_one_run_and_each_point_once_across_a_crash_and_resume(tmp_path, monkeypatch):
    """With the kept classification task, named (machinery tests bring their own: a fork's task.py may log
    no val/acc)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "runs" / "x"
    argv = [*TINY, "--epochs", "2", "--log-every", "1", "--save-every", "3", "--log-to", "mlflow",
            "--log-model", "--out-dir", str(out)]
    with crash_at_step(monkeypatch, 6):  # last.pt at step 3; MLflow has points of steps 4 and 5
        train.train(parse_config(argv), None, classification)
    given = parse_given(["--resume", "--out-dir", str(out)])
    summary = train.train(Config(**given), given, classification)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("torch-template")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "x" and run.info.status == "FINISHED"
    assert float(run.data.params["lr"]) == summary["lr"]
    main = classification.MAIN_METRIC
    for tag in ("train/loss", f"val/{main}", f"test/{main}"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert [m.step for m in client.get_metric_history(run.info.run_id, f"val/{main}")] == [4, 8]
    assert client.get_metric_history(run.info.run_id, f"val/{main}")[-1].value == summary[f"val_{main}"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 8
    artifacts = {p.name: p for p in (tmp_path / "runs" / "mlruns").rglob("*") if p.is_file()}
    assert {"summary.json", "config.json", "best.pt"} <= set(artifacts) and not (ROOT / "mlruns").exists()
    assert artifacts["best.pt"].read_bytes() == (out / "best.pt").read_bytes()


START_AT_ONCE = """
import sys, time
from pathlib import Path
from machinery import trackers
import mlflow.tracking  # imported first: the runs then create the store at the same moment
folder, ready = Path(sys.argv[1]), Path(sys.argv[1]).parent / "ready"
ready.mkdir(exist_ok=True)
(ready / folder.name).touch()
while len(list(ready.iterdir())) < 2:
    time.sleep(0.001)
print(trackers.open_mlflow(folder, {"lr": 0.1}, None, False).run_id)
"""


def test_runs_started_at_once_beside_a_new_mlflow_store_each_start_their_run(tmp_path, monkeypatch):
    """Issue 49: MLflow creates a new store's tables by migrations that break when two processes run them at
    once; the runs beside one mlflow.db create it one after the other (trackers.one_at_a_time)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = [subprocess.Popen([sys.executable, "-c", START_AT_ONCE, str(tmp_path / f"run{i}")], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    ended = [run.communicate(timeout=120) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-300:] for _, err in ended]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("torch-template").experiment_id])
    assert sorted(run.info.run_id for run in found) == sorted(out.strip() for out, _ in ended)


def test_a_tracker_that_cannot_start_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    def migration_race(*args):
        raise RuntimeError("Online migration expected to match one row when updating '90e64c465722' to "
                           "'181f10493468' in 'alembic_version'; 0 found")

    monkeypatch.setitem(trackers.OPENERS, "mlflow", migration_race)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--log-to", "tensorboard,csv,mlflow", "--out-dir",
                              tmp_path / "run")
    line = assert_one_line_failure(code, out, err)
    assert "--log-to mlflow: its run could not start (Online migration expected to match one row" in line
    assert not (tmp_path / "run").exists()
