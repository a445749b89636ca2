"""From one command to the next (issue 16): --lr auto refuses a rate measured on another setup,
--lr find sweeps in the same process, --resume takes the checkpoint's config. And the first-hour
surprises of issue 17: warmup needs a length, --channels for image folders, a failed download's
folders, epochs counted from 1, summary.json's seconds over resumed parts."""

import json
import shlex

import pytest
import torch
from conftest import build_loaders, crash_at_step, fingerprint, run_main, run_script
from test_resume import assert_same_state, final_state

import configs
import task
import train
from configs import UserError, parse_config
from configs.resolve import KEEPS_LR, differences, resumed_config
from machinery import checkpoints, lr_auto, resume
from models import OPTIMIZERS

TINY = ["--dataset", "synthetic", "--synthetic-size", "128", "--image-size", "8", "--width", "4",
        "--batch-size", "16", "--epochs", "2", "--device", "cpu", "--num-workers", "0"]


def one_line(code, err: str) -> str:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    return err


def write_sweep(out_dir, suggestion: float | None, *argv, **extra) -> None:
    """lr_find.json as lr_find.py writes it, for the setup `argv` describes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = parse_config([*argv, "--out-dir", str(out_dir)]).to_dict()
    config["task"] = checkpoints.task_identity(task)
    families = {"peak": {"lr": suggestion, "method": "minimum", "schedules": ["onecycle"]},
                "base": {"lr": suggestion, "method": "min/3",
                         "schedules": ["constant", "step", "cosine", "warmup"]}}
    record = {"lrs": [1e-3, 1e-1], "losses": [2.3, 2.0], "smoothed": [2.3, 2.1], "method": "min/10",
              "stop_reason": "completed", "suggestion": suggestion, "config": config, "suggestions": families,
              **extra}
    (out_dir / "lr_find.json").write_text(json.dumps(record))


# ---------------------------------------------------------------- --lr auto checks the setup

@pytest.mark.parametrize("swept, shown", [
    (["--optimizer", "adamw"], "optimizer: 'adamw' -> 'sgd'"),
    (["--batch-size", "32"], "batch_size: 32 -> 16"),
    (["--accum-steps", "2"], "accum_steps: 2 -> 1"),
    (["--width", "8"], "width: 8 -> 4"),
    (["--model", "resnet9"], "model: 'resnet9' -> 'resnet_small'"),
    (["--dataset", "digits"], "dataset: 'digits' -> 'synthetic'"),
    (["--image-size", "16"], "image_size: 16 -> 8"),
    (["--weight-decay", "0.01"], "weight_decay: 0.01 -> 0.0005"),
    (["--momentum", "0.5"], "momentum: 0.5 -> 0.9"),
    (["--amp", "bf16"], "amp: 'bf16' -> 'auto'"),
])
def test_lr_auto_refuses_a_rate_measured_on_another_setup(swept, shown, tmp_path, monkeypatch, capsys):
    write_sweep(tmp_path, 0.05, *TINY, *swept)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--lr", "auto", "--out-dir", tmp_path)
    line = one_line(code, err)
    assert shown in line and "`python lr_find.py " in line and not list(tmp_path.glob("*.pt"))
    command = line.split("`")[1]  # the command the line says re-finds the rate for this setup
    assert command.startswith("python lr_find.py ")
    refound = parse_config(shlex.split(command)[2:])
    assert refound.out_dir == str(tmp_path)
    assert differences(refound.to_dict(), parse_config([*TINY, "--out-dir", str(tmp_path)]), KEEPS_LR) == []


def test_lr_auto_takes_the_rate_of_the_same_setup(tmp_path):
    write_sweep(tmp_path, 0.05, *TINY, "--epochs", "9", "--seed", "3", "--find-iters", "80")
    cfg = parse_config([*TINY, "--lr", "auto", "--out-dir", str(tmp_path)])
    # epochs, seed and the sweep's own settings do not count
    assert lr_auto.resolve_lr(cfg, task, OPTIMIZERS) == 0.05


def test_momentum_counts_only_for_sgd(tmp_path):
    """The optimizer registry says which settings each optimizer reads: two adamw sweeps ignore
    momentum and nesterov, two sgd ones do not."""
    write_sweep(tmp_path, 0.05, *TINY, "--optimizer", "adamw", "--momentum", "0.5", "--no-nesterov")
    assert lr_auto.resolve_lr(parse_config([*TINY, "--optimizer", "adamw", "--lr", "auto",
                                          "--out-dir", str(tmp_path)]), task, OPTIMIZERS) == 0.05
    write_sweep(tmp_path, 0.05, *TINY, "--no-nesterov")
    with pytest.raises(UserError, match="nesterov: False -> True"):
        lr_auto.resolve_lr(parse_config([*TINY, "--lr", "auto", "--out-dir", str(tmp_path)]), task,
                           OPTIMIZERS)


def test_lr_auto_with_a_suggestion_per_schedule_family(tmp_path):
    """lr_find.json holding one suggestion per schedule family: --lr auto takes its schedule's."""
    suggestions = {"peak": {"lr": 0.05, "method": "minimum", "schedules": ["onecycle"]},
                   "base": {"lr": 0.01, "method": "knee", "schedules": ["constant", "step", "cosine"]}}
    write_sweep(tmp_path, 0.05, *TINY, suggestions=suggestions)
    lr_of = {name: lr_auto.resolve_lr(parse_config([*TINY, "--lr", "auto", "--schedule", name,
                                                  "--out-dir", str(tmp_path)]), task, OPTIMIZERS)
             for name in ("onecycle", "cosine")}
    assert lr_of == {"onecycle": 0.05, "cosine": 0.01}
    with pytest.raises(UserError, match="schedule: none of its suggestions serves 'warmup'"):
        lr_auto.resolve_lr(parse_config([*TINY, "--lr", "auto", "--schedule", "warmup", "--warmup-epochs",
                                         "1", "--out-dir", str(tmp_path)]), task, OPTIMIZERS)


# ---------------------------------------------------------------- lr_find.py, then --lr auto

def test_lr_auto_trains_exactly_as_the_rate_lr_find_py_found(tmp_path, capsys):
    """`python lr_find.py` sweeps the run train.py would train (a worker-fed loader here) and writes its
    rate; --lr auto then trains bit-identical to a run started with that rate as a number."""
    import lr_find

    argv = [*TINY, "--dropout", "0.25", "--loader", "dataloader", "--num-workers", "1", "--find-iters", "15"]
    lr_find.main([*argv, "--out-dir", str(tmp_path / "find")])
    record = json.loads((tmp_path / "find" / "lr_find.json").read_text())
    assert len(record["lrs"]) == record["config"]["find_iters"] == 15
    assert (tmp_path / "find" / "lr_find.png").is_file()
    assert "--lr auto" in capsys.readouterr().out
    found = train.train(parse_config([*argv, "--lr", "auto", "--out-dir", str(tmp_path / "find")]))
    assert found["lr"] == record["suggestion"]
    plain = train.train(parse_config([*argv, "--lr", repr(found["lr"]), "--out-dir", str(tmp_path / "p")]))
    assert plain["lr"] == found["lr"]
    assert_same_state(final_state(tmp_path / "find" / "last.pt"), final_state(tmp_path / "p" / "last.pt"))


# ---------------------------------------------------------------- --resume takes the checkpoint's config

def test_resume_needs_only_the_out_dir(tmp_path, monkeypatch, capsys):
    argv = [*TINY, "--schedule", "constant", "--lr", "auto", "--width", "8", "--dropout", "0.25",
            "--save-every", "3", "--loader", "dataloader"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for folder in (straight, broken):
        write_sweep(folder, 0.05, *argv)
    train.train(parse_config([*argv, "--out-dir", str(straight)]))

    with crash_at_step(monkeypatch, 7):
        train.train(parse_config([*argv, "--out-dir", str(broken)]))
    saved = checkpoints.load_checkpoint(broken / "last.pt")
    assert saved["step"] == 6 and saved["config"]["lr"] == 0.05  # --lr auto saved as the number used
    (broken / "lr_find.json").unlink()  # a resume never reads it again

    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", broken, "--width", "16")
    assert "width: 8 -> 16" in one_line(code, err)  # what the run computes may not change
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", broken, "--log-every", "5",
                              "--lr", "auto")
    assert code == 0, err
    assert f"resumed from {broken / 'last.pt'} at step 6 (epoch 1/2 at batch 7/8)" in out
    assert json.loads((broken / "config.json").read_text())["log_every"] == 5  # how it is watched may
    assert_same_state(final_state(straight / "last.pt"), final_state(broken / "last.pt"))
    summary = json.loads((broken / "summary.json").read_text())
    assert summary["parts"] == 2 and summary["total_seconds"] > summary["seconds"] > 0
    assert "resumed" in summary["seconds_cover"] and summary["lr"] == 0.05

    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", broken, "--epochs", "3")
    assert "add --allow-more-epochs" in one_line(code, err)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", broken, "--epochs", "3",
                              "--allow-more-epochs")
    assert code == 0, err
    assert json.loads((broken / "summary.json").read_text())["steps"] == 24
    assert checkpoints.load_checkpoint(broken / "last.pt")["config"]["allow_more_epochs"] is True
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", broken, "--epochs", "4")
    assert "epochs: 3 -> 4" in one_line(code, err)  # the permission is never taken from a checkpoint


def test_resumed_config_layers():
    saved = parse_config(["--width", "8", "--out-dir", "runs/a", "--lr", "0.3"]).to_dict()
    saved["allow_more_epochs"] = True
    saved["retired_setting"] = 1  # a field since removed from Config is ignored
    cfg = resumed_config(saved, {"resume": "last", "out_dir": "runs/a", "lr": "auto"}, "runs/a/last.pt")
    assert (cfg.width, cfg.lr, cfg.out_dir, cfg.allow_more_epochs) == (8, 0.3, "runs/a", False)
    elsewhere = resumed_config(saved, {"resume": "copies/b/best.pt"}, "copies/b/best.pt")
    assert elsewhere.out_dir == "copies/b"  # --resume PATH continues in PATH's folder
    with pytest.raises(UserError, match="epochs must be a number > 0"):
        resumed_config(saved, {"resume": "last", "epochs": 0}, "runs/a/last.pt")



def test_a_checkpoint_whose_run_record_has_a_field_this_version_lacks_is_one_line(tmp_path, monkeypatch,
                                                                                   capsys):
    """Issue 49: a last.pt of a newer train.py (a checked-out older commit resumes it) names the field and
    the fix, where Progress(**run) raised a TypeError."""
    with crash_at_step(monkeypatch, 3):
        train.train(parse_config([*TINY, "--save-every", "2", "--out-dir", str(tmp_path)]))
    newer = checkpoints.load_checkpoint(tmp_path / "last.pt")
    newer["run"]["warmup_done"] = True
    checkpoints.write_checkpoint(newer, tmp_path / "last.pt")
    kept = fingerprint(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    line = one_line(code, err)
    assert "written by another version of train.py (its run record holds warmup_done" in line, line
    assert "check out that commit" in line and f"--init-from {tmp_path / 'last.pt'}" in line
    assert fingerprint(tmp_path) == kept

# ---------------------------------------------------------------- no silent no-ops; files and messages

def test_warmup_schedule_needs_a_warmup_length():
    with pytest.raises(UserError, match="needs --warmup-epochs > 0") as err:
        parse_config(["--schedule", "warmup"])
    assert "--schedule constant" in str(err.value)
    assert parse_config(["--schedule", "warmup", "--warmup-epochs", "0.5"]).warmup_epochs == 0.5


def test_channels_applies_to_image_folders(tmp_path):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / split / label).mkdir(parents=True)
            for k in range(4):
                pixels = torch.randint(0, 256, (8, 8, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(tmp_path / split / label / f"{k}.png")
    flags = ["--dataset", "imagefolder", "--data-dir", str(tmp_path), "--image-size", "8", "--no-augment",
             "--batch-size", "4", "--num-workers", "0"]
    gray, _, _, info = build_loaders(parse_config([*flags, "--channels", "1"]), torch.device("cpu"))
    rgb, _, _, _ = build_loaders(parse_config(flags), torch.device("cpu"))
    assert info.input_shape[0] == 1
    (x1, _), (x3, _) = next(gray.epoch(0)), next(rgb.epoch(0))
    assert x1.shape == (4, 1, 8, 8) and x3.shape == (4, 3, 8, 8)
    pixels_gray = x1 / gray.scale[None] + gray.shift[None] / gray.scale[None]  # back to 0..255 (None: the
    pixels_rgb = x3 / rgb.scale[None] + rgb.shift[None] / rgb.scale[None]  # one input's key)
    luma = (pixels_rgb * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    assert (pixels_gray - luma).abs().max() < 1.0  # PIL's "L": ITU-R 601-2 luma
    with pytest.raises(UserError, match="RGB .--channels 3. or grayscale .--channels 1."):
        build_loaders(parse_config([*flags, "--channels", "2"]), torch.device("cpu"))


OFFLINE = {name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}


def test_failed_download_leaves_no_folders_it_created(tmp_path):
    """Offline (every request goes to a closed local port): one line, and no empty data/MNIST/raw."""
    result = run_script("train.py", "--config", "configs/mnist.toml", "--device", "cpu",
                        "--data-dir", str(tmp_path / "new" / "data"), "--out-dir", str(tmp_path / "run"),
                        env={**OFFLINE, "no_proxy": "", "NO_PROXY": ""})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "could not be downloaded" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_resume_header_counts_epochs_from_1(tmp_path):
    assert resume.position(0, 0, 3, 8) == "epoch 1/3 at batch 1/8"
    assert resume.position(1, 8, 3, 8) == "epoch 2/3 trained, its evaluation next"
    # A complete run with its summary gets no header: the resume says it is complete first. Without its
    # summary (stopped in its test pass) it is resumed, to finish.
    cfg = parse_config([*TINY, "--epochs", "3", "--out-dir", str(tmp_path), "--resume"])
    checkpoints.write_checkpoint({"model": {}, "optimizer": {}, "scheduler": {}, "rng": {}, "data": {},
                                  "run": {"epoch": 3, "batch": 0, "step": 24, "part": 0, "run_id": "r1"},
                                  "config": cfg.to_dict(), "task": task.NAME}, tmp_path / "last.pt")
    assert resume.load_resume(cfg, None, task)[1].state["run"]["step"] == 24
    (tmp_path / "summary.json").write_text('{"steps": 24, "run_id": "another run"}')
    assert resume.load_resume(cfg, None, task)[1].state["run"]["step"] == 24
    (tmp_path / "summary.json").write_text('{"steps": 24, "run_id": "r1"}')
    with pytest.raises(UserError, match=r"holds a complete run \(3 epochs, step 24\)") as done:
        resume.load_resume(cfg, None, task)
    assert done.value.code == 0



def test_lr_auto_compares_every_setting_unless_it_is_named_as_keeping_the_rate():
    """A setting is compared unless KEEPS_LR names it (a new one too); the ones named cannot move the rate."""
    import dataclasses

    base = parse_config([*TINY])
    for field in dataclasses.fields(configs.Config):
        if field.name in KEEPS_LR or field.name in ("momentum", "nesterov"):
            continue
        swept = {**base.to_dict(), field.name: "something else"}
        shown = f"{field.name}: 'something else' -> {getattr(base, field.name)!r}"
        assert differences(swept, base, KEEPS_LR) == [shown], field.name
    assert set(KEEPS_LR) == {
        "data_dir", "synthetic_val_size", "loader", "num_workers", "image_cache", "lr", "schedule", "epochs",
        "warmup_epochs",
        "step_size", "gamma", "min_lr_ratio", "pct_start", "div_factor", "final_div_factor", "find_start_lr",
        "find_end_lr", "find_iters", "find_method", "device", "channels_last", "compile", "seed", "out_dir",
        "log_every", "save_every", "resume", "allow_more_epochs", "predict", "checkpoint", "top_k", "tta",
        "export", "early_stop", "min_delta", "ema", "split", "dist_timeout", "deterministic", "log_to",
        "log_model", "throughput", "peak_tflops", "profile", "keep_best", "average", "seeds"}
