"""No traceback from any value, round two: hand-edited files, numbers that overflow, models that cannot
train at a batch size, data too large, devices that are not there, --compile without a compiler, and
torchrun. Each ends with a non-zero exit and exactly one stderr line, and no checkpoint touched."""

import json
import math
import os
import subprocess

import pytest
from conftest import LAUNCH, ROOT, TORCHRUN, fingerprint, run_main

import task
import train
from configs import parse_config
from machinery import checkpoints

TINY = ["--dataset", "synthetic", "--synthetic-size", "64", "--num-classes", "2", "--image-size", "8",
        "--width", "4", "--batch-size", "16", "--epochs", "1", "--device", "cpu", "--num-workers", "0"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    train.train(parse_config([*TINY, "--out-dir", str(out)]))
    return out


def one_line(code, out: str, err: str) -> str:
    assert code not in (0, None) and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    assert "Traceback" not in out + err
    return err


@pytest.mark.parametrize("suggestion", ["0.1", -0.1, math.nan, math.inf, True, None])
def test_a_hand_edited_suggestion_is_refused(suggestion, finished, monkeypatch, capsys):
    config = parse_config([*TINY, "--out-dir", str(finished)]).to_dict()
    config["task"] = checkpoints.task_identity(task)
    families = {"peak": {"lr": suggestion, "method": "minimum", "schedules": ["onecycle"]}}
    (finished / "lr_find.json").write_text(json.dumps({"config": config, "suggestions": families}))
    kept = fingerprint(finished)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--lr", "auto", "--out-dir", finished)
    assert "holds no usable suggestion for --schedule onecycle" in one_line(code, out, err)
    assert fingerprint(finished) == kept


@pytest.mark.parametrize("damage, shown", [
    (lambda ckpt: ckpt["config"].update(epochs="ten"), "config is damaged (epochs expects an integer"),
    (lambda ckpt: ckpt["run"].update(step=3.5), "run counters"),
    (lambda ckpt: ckpt.update(run=[1, 2]), "run counters"),
])
def test_a_damaged_checkpoint_is_refused(damage, shown, finished, tmp_path, monkeypatch, capsys):
    ckpt = checkpoints.load_checkpoint(finished / "last.pt")
    damage(ckpt)
    checkpoints.write_checkpoint(ckpt, tmp_path / "last.pt")
    kept = fingerprint(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    assert shown in one_line(code, out, err)
    assert fingerprint(tmp_path) == kept


@pytest.mark.parametrize("argv, shown", [
    (["--seed", "20000000000000"], "seed must be a number in [0, 2**32)"),
    (["--lr", "inf"], "lr must be a number > 0"),
    (["--momentum", "inf"], "momentum must be a number >= 0, got inf"),
    (["--weight-decay", "nan"], "weight_decay must be a number >= 0, got nan"),
    (["--weight-decay", "1e308"], "too large for float32"),
    (["--div-factor", "1e-300"], "too large for float32"),
    (["--batch-size", "1", "--model", "resnet9"], "BatchNorm gets one value per channel"),
    (["--batch-size", "1", "--model", "resnet18", "--image-size", "32"], "BatchNorm gets one value"),
    (["--image-size", "200000"], "out of memory"),  # refused at its first allocation, not after 10 GB
    (["--device", "mps"], "--device mps is not on this machine"),
    (["--device", "xpu"], "--device xpu is not on this machine"),
    (["--device", "meta"], "--device 'meta' is not a device to train on"),
], ids=["seed", "lr-inf", "momentum-inf", "decay-nan", "decay-huge", "div-tiny", "bn-resnet9",
        "bn-resnet18", "too-large", "mps", "xpu", "meta"])
def test_a_value_that_cannot_train_is_one_line(argv, shown, finished, monkeypatch, capsys):
    kept = fingerprint(finished)
    code, out, err = run_main(monkeypatch, capsys, *TINY, *argv, "--out-dir", finished / "other")
    assert shown in one_line(code, out, err)
    assert fingerprint(finished) == kept and not list((finished / "other").glob("*.pt"))


def test_compile_without_a_cpp_compiler_is_one_line(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()  # a PATH without g++, c++ or clang++
    env = {"PATH": str(path), "HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    command = [*LAUNCH, "train.py", *TINY, "--compile", "--out-dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "--compile failed" in result.stderr and "run without --compile" in result.stderr


def test_under_torchrun_the_error_is_the_root_cause(tmp_path):
    """torchrun always prints its own traceback and summary when a worker fails; the summary's root
    cause is the one line, from the error file torchrun reads. Every rank refuses alike, and the others
    wait for rank 0's line, even where rank 0 is the slower (--rank0-late)."""
    late = ["--rank0-late", "1.5"]
    command = [*TORCHRUN, *late, "train.py", *TINY, "--epochs", "0", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert result.stderr.startswith("error: epochs must be a number > 0, got 0\n")
    assert result.stderr.count("error: epochs must be") == 2  # the line, then torchrun's root cause
    assert "traceback : error: epochs must be a number > 0, got 0" in result.stderr


def test_lr_find_in_train_py_is_one_line_naming_lr_find_py(tmp_path, monkeypatch, capsys):
    """The range test is a command of its own: `--lr find` says which, and writes nothing."""
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--lr", "find", "--out-dir", tmp_path)
    line = one_line(code, out, err)
    assert "`python lr_find.py`" in line and "--lr auto" in line
    assert not list(tmp_path.iterdir())


def test_compile_reduce_overhead_is_recorded_and_says_what_runs_off_cuda(tmp_path, monkeypatch, capsys):
    """--compile MODE is torch.compile's mode, recorded in config.json; off CUDA, where there are no CUDA
    graphs, one start-up line says the default mode runs instead. (torch.compile is recorded, not run: a
    real compile takes a C++ compiler and tens of seconds; tests/test_compile.py traces with dynamo's eager
    backend, tests/test_cuda.py compiles for real.)"""
    import json

    import torch

    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: modes.append(kwargs["mode"]) or fn)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--compile", "reduce-overhead", "--out-dir",
                              tmp_path)
    assert code == 0, err
    assert modes == ["default", "default"]  # the training forward, the evaluation forward
    assert ("--compile reduce-overhead: CUDA graphs need a CUDA device; on cpu, torch.compile's default "
            "mode runs instead") in out
    assert json.loads((tmp_path / "config.json").read_text())["compile"] == "reduce-overhead"
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--compile", "--out-dir", tmp_path / "plain")
    assert code == 0 and modes == ["default"] * 4 and "CUDA graphs" not in out
