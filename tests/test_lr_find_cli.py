"""`python lr_find.py` end to end, and `train.py --lr auto` picking up its suggestion."""

import io
import json
import math
import os
import shlex
import signal
import subprocess

import pytest
from conftest import ROOT, TORCHRUN, read_scalars

import lr_find
import schedules
import task
from configs import parse_config
from machinery import checkpoints, lr_auto
from models import OPTIMIZERS


def tensorboard_image(log_dir, tag: str):
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return imread(io.BytesIO(acc.Images(tag)[-1].encoded_image_string), format="png")


def test_cli_on_digits_then_train_with_lr_auto(tmp_path, script):
    result = script("lr_find.py", "--out-dir", str(tmp_path), "--find-iters", "30")
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert {"lrs", "losses", "smoothed", "suggestion", "stop_reason", "config"} <= record.keys()
    assert record["lrs"][0] == record["config"]["find_start_lr"] == 1e-5
    suggestion = record["suggestion"]
    assert suggestion is not None and record["lrs"][0] < suggestion < record["lrs"][-1]
    peak, base = record["suggestions"]["peak"], record["suggestions"]["base"]
    assert record["schedule"] == "onecycle" and peak["schedules"] == ["onecycle"]
    assert (suggestion, record["method"]) == (peak["lr"], peak["method"]) == (peak["lr"], "minimum")
    assert base["method"] == "min/3" and base["lr"] == pytest.approx(peak["lr"] / 3)
    assert set(base["schedules"]) == {"constant", "step", "cosine", "warmup"}
    assert (tmp_path / "lr_find.png").stat().st_size > 1000
    from matplotlib.image import imread

    png = imread(tmp_path / "lr_find.png")
    tensorboard = tensorboard_image(tmp_path / "lr_find", "lr_find")
    assert (tensorboard == png[..., :3]).all(), "PNG and TensorBoard agree"
    assert not [t for t in read_scalars(tmp_path) if t.startswith("lr_find")], "no step-index scalars"
    assert f"suggested lr: {suggestion:.3g}" in result.stdout
    assert f"python train.py --out-dir {tmp_path} --lr auto" in result.stdout

    trained = script("train.py", "--out-dir", str(tmp_path), "--lr", "auto", "--epochs", "1")
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert math.isclose(summary["lr"], suggestion)
    assert f"lr {suggestion:.4g}" in trained.stdout
    assert "for --schedule onecycle (its peak, rule minimum)" in trained.stdout


SMALL = ["--dataset", "synthetic", "--synthetic-size", "256", "--find-iters", "10"]


def test_lr_auto_takes_the_saved_suggestion_for_its_schedule(tmp_path, capsys):
    """A sweep saved for cosine with --find-method min/10: each schedule's --lr auto takes its family's."""
    pytest.importorskip("matplotlib")
    lrs = [10 ** (-5 + 6 * i / 59) for i in range(60)]
    losses = [2.3 - math.tanh(2 * (math.log10(lr) + 2)) + max(0.0, math.log10(lr) + 1) ** 2 for lr in lrs]
    result = lr_find._result(lrs, losses, "cosine", "min/10", "sgd", smoothed=losses, stop_reason="completed")
    config = parse_config(["--out-dir", str(tmp_path), "--schedule", "cosine", "--find-method", "min/10"])
    lr_find.save_sweep(result, {**config.to_dict(), "task": checkpoints.task_identity(task)}, tmp_path,
                       schedules=schedules.SCHEDULES)
    record = json.loads((tmp_path / "lr_find.json").read_text())
    peak = record["suggestions"]["peak"]
    assert record["schedule"] == "cosine" and record["method"] == "min/10" and peak["method"] == "minimum"
    assert record["suggestion"] == pytest.approx(peak["lr"] / 10)
    for schedule, expected in (("cosine", record["suggestion"]), ("onecycle", peak["lr"]),
                               ("warmup", record["suggestion"])):
        cfg = parse_config(["--out-dir", str(tmp_path), "--lr", "auto", "--schedule", schedule,
                            "--warmup-epochs", "1" if schedule == "warmup" else "0"])
        capsys.readouterr()
        assert lr_auto.resolve_lr(cfg, task, OPTIMIZERS) == expected
        assert f"for --schedule {schedule}" in capsys.readouterr().out


def test_adamw_sweep_uses_the_adaptive_rules(tmp_path, capsys):
    lr_find.main(["--dataset", "synthetic", "--synthetic-size", "512", "--find-iters", "20",
                  "--optimizer", "adamw", "--out-dir", str(tmp_path)])
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert record["optimizer_kind"] == "adaptive"
    assert {f: s["method"] for f, s in record["suggestions"].items()} == lr_find.DEFAULT_RULES["adaptive"]
    said = capsys.readouterr().out
    assert f"suggested lr: {record['suggestion']:.3g} (min/3) for --schedule onecycle" in said


@pytest.mark.parametrize(("argv", "message"), [
    (["--from-json", "{d}"], "unknown option --from-json"),
    (["--out-dir", "{d}/a_file/sub"], "cannot write --out-dir"),
    (["--find-iters", "5", "--out-dir", "{d}/x", "--dataset", "synthetic", "--synthetic-size", "256"],
     "find_iters"),
])
def test_bad_cases_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stop:
        lr_find.main([a.format(d=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "x" / "lr_find.json").exists()


def test_a_failed_write_names_the_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "lr_find.png").mkdir()
    with pytest.raises(SystemExit) as stop:
        lr_find.main([*SMALL, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and str(tmp_path / "lr_find.png") in err
    assert "move the folder in the way" in err


def test_under_torchrun_rank_0_sweeps_once_and_nothing_fails(tmp_path):
    """A non-zero exit makes torchrun print its own traceback; one sweep is all that is needed."""
    command = [*TORCHRUN, "lr_find.py", "--dataset", "synthetic", "--synthetic-size", "256",
               "--image-size", "8", "--width", "4", "--find-iters", "12", "--device", "cpu",
               "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("rank 0 runs it") == 1 and result.stdout.count("lr_find: ") == 1
    assert "Traceback" not in result.stderr and "error" not in result.stderr.lower()
    assert json.loads((tmp_path / "lr_find.json").read_text())["suggestion"]


def test_lr_auto_without_a_suggestion_says_run_lr_find_first(tmp_path, script):
    (tmp_path / "lr_find.json").write_text(json.dumps({"suggestion": None}))
    result = script("train.py", "--out-dir", str(tmp_path), "--lr", "auto")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "python lr_find.py" in result.stderr


def test_bad_flags_exit_2(script):
    result = script("lr_find.py", "--find-start-lr", "5", "--find-end-lr", "1")
    assert result.returncode == 2 and "find_start_lr" in result.stderr


def test_the_next_command_trains_the_swept_setup_with_lr_auto(tmp_path, capsys):
    lr_find.main(["--dataset", "synthetic", "--synthetic-size", "512", "--find-iters", "20", "--lr", "0.3",
                  "--find-end-lr", "3", "--width", "8", "--out-dir", str(tmp_path / "a b")])
    said = capsys.readouterr().out.splitlines()[-1]
    assert said == (f"next: python train.py --dataset synthetic --synthetic-size 512 --width 8 "
                    f"--out-dir '{tmp_path / 'a b'}' --lr auto")
    saved = json.loads((tmp_path / "a b" / "lr_find.json").read_text())
    assert lr_auto.resolve_lr(parse_config(shlex.split(said)[3:]), task, OPTIMIZERS) == saved["suggestion"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_sweep_is_one_line_and_leaves_nothing(signals_end_the_run, tmp_path, capsys,
                                                                  monkeypatch, signum):
    """The signal arrives for real, mid-sweep: the sweep puts everything back, writes nothing, and main
    ends in one line with 128 + the signal's number."""
    real, seen = lr_find.lr_find, []

    def signalled_at_step_3(*args, progress, **kwargs):
        def progress_then_signal(i, lr, loss):
            seen.append(i)
            if i == 3:
                os.kill(os.getpid(), signum)
            progress(i, lr, loss)
        return real(*args, progress=progress_then_signal, **kwargs)

    monkeypatch.setattr(lr_find, "lr_find", signalled_at_step_3)
    with pytest.raises(SystemExit) as stop:
        lr_find.main([*SMALL, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 128 + signum and err.count("\n") == 1, err
    name = signal.Signals(signum).name
    assert err == (f"error: interrupted by {name}; lr_find wrote nothing and the model is as it was: run "
                   "the command again\n")
    assert max(seen) <= 4 and not (tmp_path / "lr_find.json").exists()


def test_a_known_failure_during_the_sweep_is_one_line(tmp_path, capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(a long report follows)")

    monkeypatch.setattr(lr_find, "lr_find", out_of_memory)
    with pytest.raises(SystemExit) as stop:
        lr_find.main([*SMALL, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1
    assert "out of memory" in err and "lower --batch-size" in err


def test_a_bounded_loss_gets_a_suggestion_and_the_line_says_how_it_was_read(tmp_path, capsys, monkeypatch):
    """Issue 49: the sweep of a loss that cannot blow up (test_lr_find.bounded) suggests a rate, where it
    said "no learning rate suggested" and to raise --find-end-lr, which gave the same line again."""
    from test_lr_find import bounded

    real = lr_find.lr_find

    def bounded_sweep(model, optimizer, loss_fn, *args, **kwargs):
        def loss(outputs, targets):  # bounded(lr) exactly, with gradients too small to move the weights far
            tiny = outputs.sum() * 1e-9
            return tiny - tiny.detach() + bounded(optimizer.param_groups[0]["lr"])

        return real(model, optimizer, loss, *args, **kwargs)

    monkeypatch.setattr(lr_find, "lr_find", bounded_sweep)
    lr_find.main([*SMALL, "--width", "4", "--image-size", "8", "--find-iters", "50", "--find-end-lr", "100",
                  "--out-dir", str(tmp_path)])
    said = capsys.readouterr().out
    assert "completed; the loss rose after " in said and "read the curve up to that rise" in said, said
    assert "suggested lr: " in said and "next: python train.py" in said
