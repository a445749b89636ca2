"""Issue 43: runs you can compare. --deterministic: two runs give the same weights; the setting is
recorded and a resume may not change it; an op with no deterministic kernel is one line naming it; our
models have none such (resnet9's global max pool runs as amax)."""

import csv
import json
import os
import time

import pytest
import torch
from conftest import crash_at_step, read_scalars, run_main
from test_work_kept import TINY, one_line
from torch.utils._python_dispatch import TorchDispatchMode

import models
import train
from configs import Config, parse_config, parse_given
from machinery import checkpoints, logs, resume, stops


@pytest.fixture
def deterministic_after():
    """--deterministic sets torch's global switch for the process: put it back for the next test."""
    yield
    torch.use_deterministic_algorithms(False)


def test_two_deterministic_runs_give_the_same_weights(deterministic_after, tmp_path, monkeypatch, capsys):
    weights = []
    for run in ("a", "b"):
        code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "1", "--deterministic", "--dropout",
                                  "0.2", "--out-dir", tmp_path / run)
        assert code == 0 and "--deterministic: on cpu the kernels already repeat" in out, err
        assert json.loads((tmp_path / run / "config.json").read_text())["deterministic"] is True
        weights.append(checkpoints.load_checkpoint(tmp_path / run / "last.pt")["model"])
    assert torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path / "a",
                              "--no-deterministic")
    assert "(deterministic: True -> False)" in one_line(code, err)


def test_an_op_without_a_deterministic_kernel_is_one_line_naming_it():
    err = RuntimeError("adaptive_max_pool2d_backward_cuda does not have a deterministic implementation, but "
                       "you set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism ...")
    line, status = stops.failure_line(err, "")
    assert line.startswith("--deterministic: adaptive_max_pool2d_backward_cuda has no deterministic kernel")
    assert status == 2 and "\n" not in line


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["resnet_small", "resnet9"])
def test_our_models_use_no_op_that_cuda_runs_without_a_deterministic_kernel(name):
    model = models.MODELS[name](3, 10, 8)
    x = torch.randn(2, 3, 32, 32)
    with Ops() as ops:
        model(x).sum().backward()
    assert not {op for op in ops.names if "adaptive_max_pool" in op or "adaptive_avg_pool" in op}, ops.names
    assert torch.equal(models.GlobalMax()(x), torch.nn.AdaptiveMaxPool2d(1)(x))


def metric_rows(out_dir) -> list[tuple[int, str, float]]:
    with open(out_dir / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "tag", "value", "wall_time"]
    return [(int(step), tag, float(value)) for step, tag, value, _ in rows[1:]]


def test_metrics_csv_holds_every_point_once_across_a_crash_and_resume(tmp_path, monkeypatch):
    argv = [*TINY, "--epochs", "2", "--log-every", "1", "--save-every", "3"]
    train.train(parse_config([*argv, "--out-dir", str(tmp_path / "straight")]))
    straight = metric_rows(tmp_path / "straight")
    scalars = read_scalars(tmp_path / "straight")  # the same points as TensorBoard's
    assert sorted(straight) == sorted((step, tag, pytest.approx(value)) for tag, points in scalars.items()
                                      for step, value in points)
    assert {tag for _, tag, _ in straight} >= {"train/loss", "train/lr", "val/acc", "val/loss", "test/acc"}
    with crash_at_step(monkeypatch, 5):  # last.pt at step 3; the rows of step 4 are on disk, past it
        train.train(parse_config([*argv, "--out-dir", str(tmp_path / "broken")]))
    assert max(step for step, _, _ in metric_rows(tmp_path / "broken")) == 4
    given = parse_given(["--resume", "--out-dir", str(tmp_path / "broken")])
    train.train(Config(**given), given)
    assert metric_rows(tmp_path / "broken") == straight  # each (step, tag) once, with the same values


def test_a_resume_between_two_log_points_logs_the_loss_an_uninterrupted_run_logs(tmp_path, monkeypatch):
    """Issue 49 (there: --save-every 7 --log-every 5, step 25): last.pt at step 4, a crash at step 6, log
    points every 3 steps: step 6's train/loss is the mean over steps 4 to 6, as without the crash (last.pt
    keeps the losses since the last log point)."""
    argv = [*TINY, "--batch-size", "8", "--epochs", "1", "--log-every", "3", "--save-every", "4"]  # 8 steps
    train.train(parse_config([*argv, "--out-dir", str(tmp_path / "straight")]))
    with crash_at_step(monkeypatch, 6):
        train.train(parse_config([*argv, "--out-dir", str(tmp_path / "broken")]))
    assert checkpoints.load_checkpoint(tmp_path / "broken" / "last.pt")["step"] == 4
    given = parse_given(["--resume", "--out-dir", str(tmp_path / "broken")])
    train.train(Config(**given), given)
    logged = {}
    for run in ("straight", "broken"):
        in_csv = [value for *point, value in metric_rows(tmp_path / run) if point == [6, "train/loss"]]
        in_tensorboard = dict(read_scalars(tmp_path / run)["train/loss"])[6]
        logged[run] = in_csv, in_tensorboard
    assert logged["broken"] == logged["straight"]


def test_the_unlogged_losses_and_their_normalizers_survive_a_weights_only_checkpoint(tmp_path):
    losses, counts = [torch.tensor(1.5), torch.tensor(2.25)], [torch.tensor(3.0), torch.tensor(4.0)]
    checkpoints.write_checkpoint({"unlogged": checkpoints.unlogged(losses, counts)}, tmp_path / "x.pt")
    resumed = resume.Resumed(tmp_path / "x.pt", checkpoints.load_checkpoint(tmp_path / "x.pt"))
    kept, normalizers = resumed.unlogged(torch.device("cpu"))
    assert torch.equal(torch.stack(kept), torch.stack(losses)) and normalizers == counts
    assert checkpoints.unlogged([], [8, 8])["counts"] == [8, 8]
    assert resume.Resumed(tmp_path / "older.pt", {}).unlogged(torch.device("cpu")) == ([], [])  # none kept


def test_a_new_run_moves_a_csv_runs_logs_into_a_folder_named_after_that_runs_start(tmp_path, monkeypatch):
    """Issue 49: with --log-to csv there is no event file to date the old run by; its metrics.csv's first
    row does (its first log point), or, with no row yet, the file's time, not the time of the move."""
    argv = [*TINY, "--epochs", "1", "--log-to", "csv", "--out-dir", str(tmp_path)]
    train.train(parse_config(argv))
    then = time.mktime((2025, 1, 31, 12, 0, 5, 0, 0, -1))  # that run, as if it had started then
    rows = [[step, tag, value, then + int(step)] for step, tag, value in metric_rows(tmp_path)]
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        csv.writer(f).writerows([["step", "tag", "value", "wall_time"], *rows])
    train.train(parse_config(argv))
    first = time.strftime("%Y%m%d-%H%M%S", time.localtime(rows[0][3]))  # its first row: the first log point
    assert first > "20250131-120005" and [p.name for p in tmp_path.iterdir() if p.is_dir()] == [first]
    (tmp_path / "metrics.csv").write_text("step,tag,value,wall_time\n")  # a run stopped before its first row
    os.utime(tmp_path / "metrics.csv", (then, then))
    assert logs.run_start([], tmp_path) == then
