"""End to end: train.py on tiny data, its logs, its summary, and its one-line errors."""

import json
import math
import struct
import sys

import pytest
import torch
from conftest import read_scalars, run_evaluate

import models
import train
from configs import parse_config

TAGS = {"train/loss", "train/lr", "val/loss", "val/acc"}
SUMMARY_KEYS = {"val_acc", "val_loss", "best_val_acc", "epochs", "steps", "seconds",
                "examples_per_second"}


def check_outputs(out_dir, epochs: int = 1):
    summary = json.loads((out_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["epochs"] == epochs and summary["steps"] > 0
    assert 0 <= summary["val_acc"] <= 1 and summary["examples_per_second"] > 0
    scalars = read_scalars(out_dir)
    assert TAGS <= scalars.keys()
    assert len(scalars["val/acc"]) == epochs
    assert (out_dir / "last.pt").is_file() and (out_dir / "config.json").is_file()
    return summary, scalars


def run_train(tmp_path, *argv):
    return train.train(parse_config(["--out-dir", str(tmp_path), "--device", "cpu", *argv]))


def test_default_config_one_epoch_from_the_command_line(tmp_path, script):
    result = script("train.py", "--epochs", "1", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "digits" in result.stdout and "val acc" in result.stdout
    check_outputs(tmp_path)


def test_synthetic_learns(tmp_path):
    summary = run_train(tmp_path, "--dataset", "synthetic", "--synthetic-size", "512",
                        "--image-size", "8", "--epochs", "3", "--batch-size", "64", "--lr", "0.1",
                        "--width", "8")
    check_outputs(tmp_path, epochs=3)
    assert summary["val_acc"] > 0.5  # ten classes: chance is 0.1


def test_imagefolder_from_png_files(tmp_path):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    root = tmp_path / "images"
    for split, count in (("train", 24), ("val", 8)):
        for label, name in enumerate(("dark", "light")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for k in range(count):
                base = 40 + 150 * label
                pixels = (base + torch.randint(0, 60, (20, 20, 3), generator=g)).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{k}.png")
    out = tmp_path / "run"
    summary = run_train(out, "--dataset", "imagefolder", "--data-dir", str(root), "--image-size",
                        "16", "--epochs", "2", "--batch-size", "16", "--num-workers", "1",
                        "--width", "8", "--lr", "0.05")
    check_outputs(out, epochs=2)
    assert summary["best_val_acc"] >= 0.75


def write_idx(path, array: torch.Tensor, magic: int):
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.numpy().tobytes())


def test_mnist_from_tiny_idx_files(tmp_path, monkeypatch, capsys):
    """torchvision's MNIST files (made here, offline): val is held out of the training images, the
    official test split is run once through best.pt, and --evaluate --split test gives that number."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 96), ("t10k", 32)):
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        images = torch.zeros(n, 28, 28, dtype=torch.uint8)
        for i, label in enumerate(labels.tolist()):  # a bright bar whose position is the label
            images[i, 2 + 2 * label: 4 + 2 * label, 4:24] = 255
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images, 2051)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, 2049)
    out = tmp_path / "run"
    run_train(out, "--dataset", "mnist", "--data-dir", str(tmp_path / "data"), "--epochs", "1",
              "--batch-size", "8", "--width", "8")
    summary, scalars = check_outputs(out)
    assert summary["train_size"] + summary["val_size"] == 96 and summary["test_size"] == 32
    assert 6 <= summary["val_size"] <= 14  # a tenth of each class's
    assert scalars["test/acc"] == [(summary["steps"], pytest.approx(summary["test_acc"]))]
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", out / "best.pt", "--split", "test")
    report = json.loads((out / "eval.json").read_text())
    assert code == 0 and report["test_acc"] == summary["test_acc"] and report["test_size"] == 32, err


LR = 0.05


def onecycle_lr(k: int, total: int, peak: float = LR, pct_start: float = 0.25, div: float = 25.0,
                final_div: float = 1e4) -> float:
    """torch's one-cycle with cosine annealing: from peak/div up to peak at step pct*total - 1,
    then down to peak/div/final_div at the last step."""
    def anneal(start: float, end: float, t: float) -> float:
        return end + (start - end) / 2 * (1 + math.cos(math.pi * t))

    top = pct_start * total - 1
    if k <= top:
        return anneal(peak / div, peak, k / top)
    return anneal(peak, peak / div / final_div, (k - top) / (total - 1 - top))


def cosine_lr(k: int, total: int, warmup: int, min_ratio: float) -> float:
    if k < warmup:
        return LR * (k + 1) / warmup
    return LR * (min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * (k - warmup) / (total - warmup))) / 2)


# 200 examples in batches of 32: 6 batches per epoch; with --accum-steps a, ceil(6 / a) steps.
@pytest.mark.parametrize("schedule, extra, steps_per_epoch, lr_at", [
    ("cosine", ["--warmup-epochs", "1", "--min-lr-ratio", "0.1", "--accum-steps", "2"], 3,
     lambda k, total: cosine_lr(k, total, warmup=3, min_ratio=0.1)),
    ("onecycle", ["--accum-steps", "4"], 2, onecycle_lr),
    ("step", ["--step-size", "1", "--gamma", "0.5", "--accum-steps", "3"], 2,
     lambda k, total: LR * 0.5 ** (k // 2)),
    ("warmup", ["--warmup-epochs", "0.5"], 6, lambda k, total: LR * min(k + 1, 3) / 3),
], ids=["cosine", "onecycle", "step", "warmup"])
def test_logged_lr_equals_the_schedule(tmp_path, schedule, extra, steps_per_epoch, lr_at):
    """Expected rates from the schedules' formulas, counted in optimizer steps, not from train.py: the
    loss and the rate the step trained with, every --log-every steps and at epoch ends."""
    summary = run_train(tmp_path, "--dataset", "synthetic", "--synthetic-size", "200",
                        "--image-size", "8", "--epochs", "3", "--batch-size", "32", "--width", "4",
                        "--log-every", "4", "--schedule", schedule, "--lr", str(LR), *extra)
    scalars = read_scalars(tmp_path)
    logged = scalars["train/lr"]
    total = 3 * steps_per_epoch
    points = [k for k in range(1, total + 1) if k % 4 == 0 or k % steps_per_epoch == 0]
    assert summary["steps"] == total
    assert [s for s, _ in logged] == [s for s, _ in scalars["train/loss"]] == points
    assert [v for _, v in logged] == pytest.approx([lr_at(k - 1, total) for k in points], rel=1e-6)


BAD_INPUTS = [
    ["--epoch", "3"],
    ["--epochs", "two"],
    ["--lr", "-1"],
    ["--batch-size", "0"],
    ["--schedule", "cosin"],
    ["--dataset", "cifar"],
    ["--model", "resnet1"],
    ["--config", "configs/missing.toml"],
    ["--dataset", "imagefolder", "--data-dir", "/nonexistent/images"],
    ["--lr", "auto", "--out-dir", "/nonexistent/run"],
]


@pytest.mark.parametrize("argv", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_bad_input_from_the_real_command_line(script):
    result = script("train.py", "--epoch", "3")
    assert result.returncode == 2
    assert result.stderr == "error: unknown option --epoch; did you mean '--epochs'? (see --help)\n"
    assert "Traceback" not in result.stdout + result.stderr


def test_missing_dataset_offline_says_where_and_how(tmp_path, script):
    result = script("train.py", "--dataset", "cifar10", "--data-dir", str(tmp_path / "nothing"),
                    "--device", "cpu", "--out-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "cifar10" in line and str(tmp_path / "nothing") in line
    assert "Traceback" not in result.stderr


@pytest.fixture
def probe(monkeypatch):
    """What train.train's model received and returned while training, and the gradient norm
    the optimizer stepped with (after clipping and unscaling)."""
    seen = {"inputs_channels_last": set(), "weights_channels_last": None, "logits": set(),
            "grad_norms": []}

    def build_model(cfg, channels, num_classes, device="cpu", **options):
        model = models.build_model(cfg, channels, num_classes, device)
        kernel = next(p for p in model.parameters() if p.ndim == 4)
        seen["weights_channels_last"] = kernel.is_contiguous(memory_format=torch.channels_last)

        def inputs_hook(module, inputs):
            if module.training:
                seen["inputs_channels_last"].add(inputs[0].is_contiguous(memory_format=torch.channels_last))

        def output_hook(module, inputs, output):
            if module.training:
                seen["logits"].add(output.dtype)

        model.register_forward_pre_hook(inputs_hook)
        model.register_forward_hook(output_hook)
        return model

    def build_optimizer(model, cfg, lr):
        optimizer = models.build_optimizer(model, cfg, lr)
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def norm_hook(*_):
            norms = torch.stack([p.grad.norm() for p in params if p.grad is not None])
            seen["grad_norms"].append(torch.linalg.vector_norm(norms).item())

        optimizer.register_step_pre_hook(norm_hook)
        return optimizer

    monkeypatch.setattr(train, "build_model", build_model)
    monkeypatch.setattr(train, "build_optimizer", build_optimizer)
    return seen


CLIP = 0.05  # well below this model's gradient norm, so clipping acts on every step


@pytest.mark.parametrize("extra, logits, channels_last", [
    (["--amp", "fp16", "--accum-steps", "2", "--clip-grad", str(CLIP), "--label-smoothing", "0.1"],
     torch.float16, False),
    (["--amp", "bf16", "--channels-last", "--optimizer", "adamw", "--lr", "0.003"], torch.bfloat16, True),
    (["--loader", "dataloader", "--num-workers", "0", "--schedule", "warmup", "--warmup-epochs", "1"],
     torch.float32, False),
], ids=["fp16-accum-clip", "bf16-channels-last-adamw", "dataloader-warmup"])
def test_amp_accumulation_and_loader_variants_run(tmp_path, capsys, probe, extra, logits, channels_last):
    summary = run_train(tmp_path, "--dataset", "synthetic", "--synthetic-size", "256",
                        "--image-size", "8", "--epochs", "2", "--batch-size", "32", "--width", "8",
                        *extra)
    check_outputs(tmp_path, epochs=2)
    accum = 2 if "--accum-steps" in extra else 1
    assert summary["steps"] == 2 * -(-(256 // 32) // accum)
    assert math.isfinite(summary["val_loss"])
    assert probe["logits"] == {logits}, "autocast did not produce the dtype --amp asks for"
    assert probe["inputs_channels_last"] == {channels_last}
    assert probe["weights_channels_last"] is channels_last
    norms = probe["grad_norms"]
    assert norms, "the optimizer never stepped"
    if "--clip-grad" in extra:
        assert max(norms) <= CLIP * 1.001 and max(norms) >= CLIP * 0.999, norms
    else:
        assert max(norms) > 10 * CLIP, norms  # what the clipped run would have stepped with
    loader = "DataLoader with 0 workers" if "dataloader" in extra else "device-resident"
    assert f"via {loader}" in capsys.readouterr().out


def test_evaluate_leaves_the_model_in_the_mode_it_had(tmp_path):
    """Issue 54, 13: an --ema average (eval mode, never trained) stays in eval mode after each evaluation;
    the model being trained goes back to train mode."""
    from conftest import build_loaders

    import task

    cfg = parse_config(["--dataset", "synthetic", "--synthetic-size", "32", "--image-size", "8", "--width",
                        "4", "--batch-size", "8", "--device", "cpu"])
    _, val, _, info = build_loaders(cfg)
    model = models.build_model(cfg, 3, len(info.names))
    for training in (False, True):
        model.train(training)
        train.evaluate(model, val, task, cfg, info, None)
        assert model.training is training


def test_the_progress_bar_shows_the_rate_tensorboard_logs(tmp_path, monkeypatch):
    """Issue 54, 16: at each log point the bar shows the rate of the step just taken, the one logged as
    train/lr (it showed the next step's)."""
    from machinery import logs

    shown = []

    class Bar:
        n = 0

        def update(self, n):
            self.n += n

        def set_postfix(self, **values):
            shown.append(float(values["lr"]))

        def close(self):
            pass

    monkeypatch.setattr(logs, "progress_bar", lambda *args: Bar())
    run_train(tmp_path, "--dataset", "synthetic", "--synthetic-size", "64", "--image-size", "8", "--width",
              "4", "--batch-size", "16", "--epochs", "2", "--log-every", "1")
    logged = [value for _, value in read_scalars(tmp_path)["train/lr"]]
    assert len(shown) == len(logged) == 8 and shown == pytest.approx(logged, rel=5e-3)  # shown to 3 figures


def test_the_default_rate_on_other_data_than_digits_says_so_once(tmp_path, monkeypatch, capsys):
    """Issue 54, 19: a run on other data with the default --lr (chosen for digits) says so at start-up, with
    the lr_find.py command for this data; a rate given, or digits, says nothing of it."""
    from conftest import run_main

    tiny = ["--dataset", "synthetic", "--synthetic-size", "32", "--image-size", "8", "--width", "4",
            "--batch-size", "16", "--epochs", "1"]
    for extra, said in (([], True), (["--lr", "0.1"], False)):
        code, out, _ = run_main(monkeypatch, capsys, *tiny, *extra, "--out-dir", tmp_path / str(said))
        assert code == 0 and ("is the default, chosen for digits" in out) is said
        if said:
            line = next(line for line in out.splitlines() if "chosen for digits" in line)
            assert "`python lr_find.py --dataset synthetic" in line and line.endswith("--lr auto")
    code, out, _ = run_main(monkeypatch, capsys, "--epochs", "1", "--batch-size", "512", "--width", "4",
                            "--out-dir", tmp_path / "digits")
    assert code == 0 and "chosen for digits" not in out
