"""Issue 42: the inputs and targets a fork brings. A task whose TARGETS is "any" takes its targets as the
data gives them (a binned regression's [N] floats for 10 outputs) and reports exact figures; per-position
class ids on inputs that are not images are no one class per example (--balance-classes is one line);
crops and flips asked of inputs that are not images are one line."""

import pytest
import torch
from conftest import add_entries, build_loaders, run_main
from forks import binned
from test_faults import assert_one_line_failure

import data
import train
from configs import parse_config
from evaluate import load_trained

SMALL = ["--width", "4", "--device", "cpu", "--num-workers", "0"]


def test_a_binned_regression_trains_on_its_own_targets_with_exact_figures(tmp_path, monkeypatch, capsys):
    add_entries(monkeypatch, "binned_data")
    cfg = parse_config(["--dataset", "brightness", *SMALL, "--synthetic-size", "96", "--batch-size", "32",
                        "--epochs", "2", "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, binned)
    assert "targets checked: 96 train, 24 val, as the data gives them" in capsys.readouterr().out
    model, _ = load_trained(tmp_path / "last.pt")
    _, val, _, _ = build_loaders(cfg, targets="any")
    total, right, count = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets in val.epoch(0):
            assert targets.shape == (len(inputs),) and targets.dtype == torch.float32  # as the data gave
            outputs = model(inputs)
            total += binned.loss(outputs, targets, cfg, None).item()
            right += int((outputs.argmax(1) == binned.bins(targets)).sum())
            count += len(targets)
    assert summary["val_loss"] == pytest.approx(total / count, rel=1e-5)
    assert summary["val_acc"] == right / count


def tokens(cfg, *, pad: int = 0, flip: bool = False):
    """[N, 6] token ids in, one class id per token out (5 classes): per-position targets on no image."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (64, 6), generator=g)
    return data.Source((x.float(), x), (x[:16].float(), x[:16]), list("abcde"), pad=pad, flip=flip)


def test_balanced_classes_on_per_position_ids_is_one_line_with_nothing_written(tmp_path, monkeypatch,
                                                                               capsys):
    monkeypatch.setitem(data.DATASETS, "tokens", tokens)
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "tokens", "--balance-classes", *SMALL,
                              "--out-dir", tmp_path / "run")
    assert "training targets are not one class id per example" in assert_one_line_failure(code, out, err)
    assert not (tmp_path / "run").exists()


def test_crops_and_flips_asked_of_clips_are_one_line(tmp_path, monkeypatch, capsys):
    def clips(cfg):
        video = torch.randint(0, 255, (32, 3, 4, 8, 8), dtype=torch.uint8)  # [N, C, T, H, W]
        labels = torch.arange(32) % 2
        return data.Source((video, labels), (video[:8], labels[:8]), ["a", "b"], pad=2, flip=True)

    monkeypatch.setitem(data.DATASETS, "clips", clips)
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "clips", *SMALL, "--out-dir",
                              tmp_path / "run")
    line = assert_one_line_failure(code, out, err)
    assert "clips's Source asks for crops and flips (pad=2, flip=True)" in line and "[3, 4, 8, 8]" in line
    assert "not uint8 [C, H, W] images" in line and not (tmp_path / "run").exists()
