"""evaluate.py's own flags and other data (issue 49, items 4 and 5): it offers only what evaluation uses and
refuses a training flag, or a model or data flag that contradicts its checkpoint, in one line; it measures
a model on another folder, and counts the images there that are among the run's training images by their
pixels (a copy under another name too); SIGTERM to the group while it evaluates another folder with
DataLoader workers is one line."""

import json
import shutil
import signal

import pytest
import torch
from conftest import run_evaluate, run_main
from test_faults import assert_one_line_failure, save_png
from test_nothing_lost import FILES, terminated

import lr_find
import train
from configs import parse_config
from machinery import checkpoints

CPU = ["--device", "cpu", "--num-workers", "0"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two classes of PNG files, dark and light, 8 train and 4 val images each, every one its own."""
    root = tmp_path_factory.mktemp("images")
    for split, count in (("train", 8), ("val", 4)):
        for label, name in enumerate(("dark", "light")):
            for k in range(count):
                save_png(root / split / name / f"{k}.png", 12, 1000 * (split == "val") + 100 * label + k,
                         40 + 150 * label)
    return root


@pytest.fixture(scope="module")
def image_run(images, tmp_path_factory):
    """A one-epoch run on `images` (--image-size 8 --width 4 --batch-size 4)."""
    out = tmp_path_factory.mktemp("image_run")
    train.train(parse_config(["--dataset", "imagefolder", "--data-dir", str(images), *FILES, "--out-dir",
                              str(out)]))
    return out


def test_evaluate_offers_what_evaluation_uses_and_refuses_the_rest_in_one_line(image_run, images, tmp_path,
                                                                                 monkeypatch, capsys):
    code, out, _ = run_evaluate(monkeypatch, capsys, "--help")
    options = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert code == 0 and len(options) == 27, options
    assert {"--checkpoint", "--predict", "--average"} <= set(options)
    assert not {"--lr", "--epochs", "--augment", "--resume", "--log-to"} & set(options)
    code, out, _ = run_main(monkeypatch, capsys, "--help")
    trains = {line.split()[0] for line in out.splitlines() if line.startswith("  --")}
    assert code == 0 and {"--lr", "--epochs"} <= trains and not {"--checkpoint", "--predict"} & trains
    best = image_run / "best.pt"
    line = assert_one_line_failure(*run_evaluate(monkeypatch, capsys, "--checkpoint", best, "--lr", "5"))
    assert line.startswith("error: --lr is not an option here: evaluate.py trains nothing"), line
    line = assert_one_line_failure(*run_evaluate(monkeypatch, capsys, "--checkpoint", best, "--model",
                                                 "resnet18", *CPU))
    assert line.startswith("error: --model resnet18: the checkpoint's run was trained with model "
                           "'resnet_small'"), line
    line = assert_one_line_failure(*run_evaluate(monkeypatch, capsys, "--predict", images / "val",
                                                 "--checkpoint", best, "--width", "8", *CPU))
    assert "--width 8: the checkpoint's run was trained with width 4" in line, line
    assert not list(image_run.glob("eval*")) and not (image_run / "predictions.csv").exists()
    # the same settings again are the checkpoint's own; a plain state_dict takes them to build its model
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", best, "--model", "resnet_small",
                                "--width", "4", "--out-dir", tmp_path / "same", *CPU)
    assert code == 0, err
    ours = json.loads((tmp_path / "same" / "eval.json").read_text())
    torch.save(checkpoints.load_checkpoint(best)["model"], tmp_path / "weights.pt")
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "weights.pt", "--dataset",
                                "imagefolder", "--data-dir", images, "--image-size", "8", "--width", "4",
                                "--batch-size", "4", "--out-dir", tmp_path / "plain", *CPU)
    assert code == 0, err
    plain = json.loads((tmp_path / "plain" / "eval.json").read_text())
    assert code == 0 and plain["val_acc"] == ours["val_acc"] and plain["val_loss"] == ours["val_loss"], err
    with pytest.raises(SystemExit) as stopped:
        lr_find.main(["--predict", str(images / "val"), "--out-dir", str(tmp_path / "sweep")])
    line = assert_one_line_failure(stopped.value.code, *capsys.readouterr())
    assert line.startswith("error: --predict is not an option here: another script takes it"), line


def other_folder(images, folder):
    """A copy of `images` (no cache) whose val images have new names: the run's val images, renamed."""
    shutil.copytree(images, folder, ignore=shutil.ignore_patterns(".image-cache"))
    for file in sorted((folder / "val").glob("*/*.png")):
        file.rename(file.with_name(f"renamed-{file.name}"))
    return folder


def test_another_folder_is_measured_and_its_training_images_are_counted(image_run, images, tmp_path,
                                                                          monkeypatch, capsys):
    """The run's own val images under new names measure what they measured; two of its training images
    copied into val/ under new names are counted as such, in the output and in eval.json."""
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", image_run / "best.pt", "--out-dir",
                                tmp_path / "own", *CPU)
    own = json.loads((tmp_path / "own" / "eval.json").read_text())
    other = other_folder(images, tmp_path / "other")
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", image_run / "best.pt", "--data-dir",
                                  other, "--out-dir", tmp_path / "renamed", *CPU)
    renamed = json.loads((tmp_path / "renamed" / "eval.json").read_text())
    assert code == 0 and renamed["val_acc"] == own["val_acc"] and renamed["val_loss"] == own["val_loss"], err
    assert "--split val: 8 images, none of them among the run's 16 training images" in out, out
    for k in range(2):
        shutil.copy(images / "train" / "dark" / f"{k}.png", other / "val" / "dark" / f"copy-{k}.png")
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", image_run / "best.pt", "--data-dir",
                                  other, "--out-dir", tmp_path / "copies", *CPU)
    said = "--split val: 2 of its 10 images are among the run's 16 training images (the same pixels"
    assert code == 0 and said in out, (out, err)
    report = json.loads((tmp_path / "copies" / "eval.json").read_text())
    assert report["val_size"] == 10 and report["note"].startswith(said)


def test_sigterm_to_the_group_while_evaluating_another_folder_with_workers_is_one_line(image_run, images,
                                                                                       tmp_path):
    """Round three's check, evaluate.py's case: --data-dir of the run's images renamed, read by two
    DataLoader workers, SIGTERM to the process group once each reads an image (refused before it started,
    while another folder was refused)."""
    other = other_folder(images, tmp_path / "other")
    argv = ["--checkpoint", str(image_run / "best.pt"), "--data-dir", str(other), "--device", "cpu",
            "--loader", "dataloader", "--num-workers", "2", "--batch-size", "4", "--out-dir",
            str(tmp_path / "out")]
    as_the_script = "from machinery.stops import SIGNALS\nSIGNALS.pass_on = False\n"  # ends as it would
    command = f"{as_the_script}import evaluate\nsys.argv = ['evaluate.py', *{argv!r}]\nevaluate.main()\n"
    stopped = terminated(tmp_path, command)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert stopped.stderr.startswith("error: interrupted by SIGTERM") and stopped.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_another_folder_whose_training_split_is_smaller_than_a_batch_is_measured(image_run, images, tmp_path,
                                                                                   monkeypatch, capsys):
    """Issue 54, 3: evaluate.py --data-dir OTHER, OTHER/train holding fewer images than --batch-size, measures
    OTHER/val (it trains nothing: the refusal of a batch larger than the training set is train.py's), and
    gives what evaluating with a small enough batch gives."""
    other = tmp_path / "other"
    shutil.copytree(images / "val", other / "val")
    for name in ("dark", "light"):
        (other / "train" / name).mkdir(parents=True)
        shutil.copy(images / "train" / name / "0.png", other / "train" / name / "0.png")  # 2 images: < 4
    best = image_run / "best.pt"
    measured = {}
    for batch in ("4", "2"):
        out = tmp_path / f"batch{batch}"
        code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", best, "--data-dir", other, *CPU,
                                    "--batch-size", batch, "--out-dir", out)
        assert code == 0, err
        measured[batch] = json.loads((out / "eval.json").read_text())
    assert measured["4"]["val_size"] == 8 and measured["4"]["val_acc"] == measured["2"]["val_acc"]
    assert measured["4"]["val_loss"] == pytest.approx(measured["2"]["val_loss"], rel=1e-5)
