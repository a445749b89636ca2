"""Results you can publish (issue 33): val chooses, the test split reports once; early stopping on the
task's main metric; an exponential moving average of the weights (--ema) that evaluation, best.pt,
evaluate.py (and --predict) and the test report use."""

import json

import pytest
import torch
from conftest import build_loaders, crash_at_step, run_evaluate, run_main
from test_faults import TINY, save_png
from test_images import FLAGS
from test_resume import assert_same_state, final_state

import task
import train
from configs import Config, UserError, parse_config, parse_given
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
    # the test split, once, through best.pt: what --evaluate --split test gives, to the bit
    assert f"test acc {100 * summary['test_acc']:.2f}% (best.pt)" in out.splitlines()[-1]
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "best.pt", "--split", "test")
    report = json.loads((tmp_path / "eval.json").read_text())
    assert code == 0 and report["split"] == "test" and report["test_size"] == summary["test_size"] == 16, err
    assert (report["test_acc"], report["test_loss"]) == (summary["test_acc"], summary["test_loss"])
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
    _, val_batches, _, info = build_loaders(cfg, CPU)

    def val_loss(weights: dict) -> float:
        model = build_model(cfg, info.input_shape[0], len(info.names))
        model.load_state_dict(weights)
        return train.evaluate(model, val_batches, task, cfg, info, None).metrics["loss"]

    assert val_loss(straight["ema"]) == pytest.approx(summary["val_loss"], rel=1e-6)
    assert abs(val_loss(straight["model"]) - summary["val_loss"]) > 1e-3
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "straight" / "last.pt")
    assert code == 0, err
    report = json.loads((tmp_path / "straight" / "eval.json").read_text())
    assert report["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    best = torch.load(tmp_path / "straight" / "best.pt", weights_only=True)
    _, _, test_batches, _ = build_loaders(cfg, CPU)
    model = build_model(cfg, info.input_shape[0], len(info.names))
    model.load_state_dict(best["ema"])  # the test report is best.pt's average
    test = train.evaluate(model, test_batches, task, cfg, info, None).metrics
    assert test["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)


# ---------------------------------------------------------------- three splits

def image_folder(root, counts: dict[str, int]) -> None:
    """Two classes of 8 px PNG files, dark (a) and light (b), `counts[split]` of each in root/split."""
    for split, count in counts.items():
        for label, name in enumerate("ab"):
            for k in range(count):
                save_png(root / split / name / f"{k}.png", 8, k, base=40 + 150 * label)


def splits_of(*argv: str):
    """The (train, val, test) labels build_loaders serves for `argv`, in order."""
    loaders = build_loaders(parse_config([*argv, "--device", "cpu"]), CPU)
    return [torch.cat([y for _, y in batches.epoch(0)]) if batches else None for batches in loaders[1:3]], \
        loaders[3]


def test_digits_val_is_held_out_of_the_training_split_by_class_the_same_for_every_seed():
    """digits: a fixed 360-image test split; val is --val-fraction of each class of the other 1437."""
    from data import digits, hold_out

    source = digits(parse_config([]))
    (train_x, train_y), (val_x, val_y), (test_x, test_y) = source.train, source.val, source.test
    assert (len(train_y), len(val_y), len(test_y)) == (1293, 144, 360) and len(train_y) + len(val_y) == 1437
    rows = {tuple(x.flatten().tolist()) for x in torch.cat([train_x, val_x, test_x])}
    assert len(rows) >= 1797 - 10  # no example in two splits (digits repeats a few images itself)
    counts = [torch.bincount(y, minlength=10) for y in (val_y, torch.cat([train_y, val_y]))]
    per_class = counts[0] / counts[1]
    assert per_class.min() > 0.08 and per_class.max() < 0.12  # a tenth of each class, not of the whole
    other = digits(parse_config(["--seed", "7"]))
    assert torch.equal(other.val[1], val_y) and torch.equal(other.test[1], test_y)
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    kept, held = hold_out(labels, 0.5, "x")
    assert held.tolist() == sorted(held.tolist()) and labels[held].tolist() == [0, 0, 1, 1, 1]
    assert sorted(kept.tolist() + held.tolist()) == list(range(10))
    with pytest.raises(UserError, match=r"x: 4 training examples are too few to hold out a --val-fraction "
                                        r"of 0.1 \(none of them would be\)"):
        hold_out(torch.tensor([0, 0, 1, 1]), 0.1, "x")


def test_image_folders_and_csv_files_may_bring_a_test_split(tmp_path):
    """imagefolder: a test/ beside train/ and val/; csv: a test.csv. Without them: no test split, and
    --evaluate --split test says how to add one."""
    root = tmp_path / "folder"
    image_folder(root, {"train": 4, "val": 4, "test": 3})
    (val, test), info = splits_of("--dataset", "imagefolder", "--data-dir", str(root), *FLAGS)
    assert (info.train_size, info.val_size, info.test_size) == (8, 8, 6)
    assert test.tolist() == [0, 0, 0, 1, 1, 1]
    rows = [f"{split}/{name}/{k}.png,{name}" for split in ("train", "val", "test") for name in "ab"
            for k in range(3)]
    (root / "train.csv").write_text("file,label\n" + "\n".join(rows[:6]) + "\n")
    (root / "test.csv").write_text("file,label\n" + "\n".join(rows[12:]) + "\n")
    (_, test), info = splits_of("--dataset", "csv", "--data-dir", str(root), *FLAGS, "--val-fraction", "0.34")
    assert (info.train_size, info.val_size, info.test_size) == (4, 2, 6)
    assert test.tolist() == [0, 0, 0, 1, 1, 1]
    (root / "test.csv").write_text("file,label\ntest/a/0.png,c\n")
    with pytest.raises(UserError, match=r"csv: test labels \['c'\] are in no training row"):
        splits_of("--dataset", "csv", "--data-dir", str(root), *FLAGS, "--val-fraction", "0.34")
    (root / "test" / "c").mkdir()
    with pytest.raises(UserError, match=r"imagefolder: train classes \['a', 'b'\] differ from test "
                                        r"\['a', 'b', 'c'\]"):
        splits_of("--dataset", "imagefolder", "--data-dir", str(root), *FLAGS)


def test_evaluate_split_test_on_data_without_one_is_one_line(tmp_path, monkeypatch, capsys):
    image_folder(tmp_path / "data", {"train": 4, "val": 4})
    data = ["--dataset", "imagefolder", "--data-dir", tmp_path / "data", *FLAGS]
    code, out, err = run_main(monkeypatch, capsys, *data, "--epochs", "1", "--out-dir", tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert code == 0 and summary["test_size"] is None and "test_acc" not in summary, err
    assert ", test acc" not in out.splitlines()[-1] and "val acc" in out.splitlines()[-1]
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "run" / "best.pt",
                              "--split", "test")
    assert code == 2 and err == ("error: --split test: imagefolder here has no test split (imagefolder: "
                                 "a test/ folder beside train/ and val/; csv: a test.csv); use --split "
                                 "val\n")


def test_a_resume_on_other_splits_is_refused(tmp_path, monkeypatch, capsys):
    """The checkpoint records each split's size: a val split that changed under a run is refused."""
    image_folder(tmp_path / "data", {"train": 4, "val": 4})
    data = ["--dataset", "imagefolder", "--data-dir", tmp_path / "data", *FLAGS,
            "--out-dir", tmp_path / "run"]
    with crash_at_step(monkeypatch, 6):  # in epoch 2 of 4 steps each: last.pt holds epoch 1
        run_main(monkeypatch, capsys, *data, "--epochs", "2")
    save_png(tmp_path / "data" / "val" / "a" / "4.png", 8, 4)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path / "run")
    assert code == 2 and "was trained on other data (val size 8 -> 9)" in err, err


def test_ema_moves_only_after_a_step_that_was_taken(tmp_path, monkeypatch):
    """--ema under fp16 (on CPU): the step whose gradients a hook makes inf is skipped by GradScaler, and
    the average skips it too: it counts the steps taken, and it is the same before and after the skipped
    one. A loop that also averaged after a skipped step fails both."""
    backward, history, emas = [0], [], []  # history: per step, taken and the average before it
    real_build, real_step = train.build_model, train.optimizer_step

    def build_model(*args, **kwargs):
        model = real_build(*args, **kwargs)

        def poison(grad):  # the 4th backward through the model (the check at start-up may count too)
            backward[0] += 1
            return grad * float("inf") if backward[0] == 4 else grad

        next(model.parameters()).register_hook(poison)
        return model

    from machinery import precision  # train.averaged builds its Ema there, only for --ema

    class Recorded(precision.Ema):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            emas.append(self)

    def optimizer_step(optimizer, *args, **kwargs):
        before = [t.clone() for t in emas[0].average.state_dict().values()]
        history.append((real_step(optimizer, *args, **kwargs), before))
        return history[-1][0]

    monkeypatch.setattr(train, "build_model", build_model)
    monkeypatch.setattr(precision, "Ema", Recorded)
    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    train.train(parse_config([*TINY, "--epochs", "2", "--amp", "fp16", "--ema", "0.5",
                              "--out-dir", str(tmp_path)]))
    taken = [was_taken for was_taken, _ in history]
    assert taken.count(False) == 1 and 0 < taken.index(False) < len(taken) - 1, taken
    skipped = taken.index(False)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["run"]["averaged"] == len(taken) - 1
    assert_same_state(history[skipped][1], history[skipped + 1][1], "the average over the skipped step")
    before, after = history[skipped - 1][1], history[skipped][1]
    assert not all(map(torch.equal, before, after)), "a step taken moves the average"
