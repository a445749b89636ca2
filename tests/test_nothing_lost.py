"""Nothing lost, round three (issue 32): data that would train on a wrong split or class list, presets of
the wrong type, and faults that ended in tracebacks, each now refused or said in one line, most of them at
start-up: repeated and conflicting CSV rows, a val.csv sharing train.csv's files, image folders one level
too high (and single-label CSVs), rows without a label, headerless CSVs (train.csv, val.csv, --predict's),
TOML values of the wrong type, empty splits, a small /dev/shm, SIGTERM to the process group of --predict
and lr_find.py with DataLoader workers, and lr_find.json beside another sweep's lr_find.png."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_faults
import torch
from conftest import ROOT, add_entries, run_evaluate, run_main
from test_faults import TINY, assert_one_line_failure, save_png

import data
import lr_find
import task
import train
from configs import UserError, parse_config
from machinery import batches, checkpoints, lr_auto
from machinery.image_files import ImageFiles
from models import OPTIMIZERS

images = test_faults.images  # the fixture: two classes of PNG files, 8 train and 4 val images each
CPU_FLAGS = ["--device", "cpu", "--num-workers", "0"]
FILES = ["--image-size", "8", "--width", "4", "--batch-size", "4", "--epochs", "1", "--device", "cpu",
         "--num-workers", "0"]


@pytest.fixture(scope="module")
def image_run(images, tmp_path_factory) -> Path:
    """A one-epoch run on `images`: its best.pt predicts."""
    out = tmp_path_factory.mktemp("image_run")
    train.train(parse_config(["--dataset", "imagefolder", "--data-dir", str(images), *FILES, "--out-dir",
                              str(out)]))
    return out


def csv_folder(root: Path, lines: list[str], count: int = 10, val: list[str] | None = None) -> Path:
    """root/0.png ... root/{count-1}.png, and train.csv (and val.csv) holding `lines` as they are."""
    for k in range(count):
        save_png(root / f"{k}.png", 12, k, 40 + 15 * k)
    (root / "train.csv").write_text("\n".join(lines) + "\n")
    if val is not None:
        (root / "val.csv").write_text("\n".join(val) + "\n")
    return root


def csv_source(root: Path, *flags: str) -> data.Source:
    return data.csv_images(parse_config(["--dataset", "csv", "--data-dir", str(root), *flags]))


def files_of(split) -> set[str]:
    return {str(file) for file, _ in split.items}


def refused(monkeypatch, capsys, out_dir: Path, *argv) -> str:
    """train.py ARGV ends in one line, having written nothing into out_dir."""
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", out_dir)
    line = assert_one_line_failure(code, out, err)
    assert code == 2 and not out_dir.exists(), (line, list(out_dir.iterdir()) if out_dir.exists() else None)
    return line


# ---------------------------------------------------------------- 1: repeated rows never cross the split

def test_repeated_csv_rows_stay_on_one_side_of_the_split(tmp_path):
    rows = [f"{k}.png,{'ab'[k % 2]}" for k in range(10)]
    root = csv_folder(tmp_path, ["file,label", *(row for row in rows for _ in range(3))])
    source = csv_source(root)
    trained, held = files_of(source.train), files_of(source.val)
    assert not trained & held and len(trained | held) == 10 and (len(trained), len(held)) == (9, 1)
    assert source.notes == [f"csv: {root / 'train.csv'} repeats rows: dropped 20 repeats of a file and its "
                            "label, each file is read once"]


def test_a_file_with_two_labels_is_refused_naming_both(tmp_path):
    root = csv_folder(tmp_path, ["file,label", *(f"{k}.png,{'ab'[k % 2]}" for k in range(10)), "3.png,a"])
    with pytest.raises(UserError) as err:
        csv_source(root)
    assert str(err.value) == (f"csv: {root / 'train.csv'} lists {root / '3.png'} with two labels ('b' and "
                              "'a'); keep one row per file, with its class")


def test_a_val_csv_listing_training_files_is_said(tmp_path):
    """My call: a val.csv is the user's own split: its files shared with train.csv are said, not refused."""
    rows = [f"{k}.png,{'ab'[k % 2]}" for k in range(10)]
    root = csv_folder(tmp_path, ["file,label", *rows[:8]], val=["file,label", *rows[6:]])
    source = csv_source(root)
    assert (len(source.train), len(source.val)) == (8, 4)
    assert source.notes == [f"csv: val.csv lists 2 of train.csv's files too ({root / '6.png'}, "
                            f"{root / '7.png'}): their val scores are no held-out measure; list each file in "
                            "one of them"]


# ---------------------------------------------------------------- 2: fewer than two classes

def one_level_too_high(root: Path, images: Path, both: bool) -> Path:
    """root/train/pets/{dark,light}/*.png (and root/val/pets/... with both): the classes a level too deep."""
    shutil.copytree(images / "train", root / "train" / "pets")
    shutil.copytree(images / "val", root / "val" / ("pets" if both else ""), dirs_exist_ok=True)
    return root


@pytest.mark.parametrize("both", [True, False], ids=["train-and-val", "train"])
def test_an_image_folder_one_level_too_high_is_refused(both, images, tmp_path, monkeypatch, capsys):
    root = one_level_too_high(tmp_path / "data", images, both)
    line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "imagefolder", "--data-dir", root,
                   *FILES)
    assert line == (f"error: imagefolder: {root / 'train'} holds 1 class folder ('pets'); a classifier needs "
                    "two or more: point --data-dir at the folder that holds train/ and val/ with one folder "
                    "per class\n")


def test_a_val_folder_one_level_too_high_is_refused(images, tmp_path, monkeypatch, capsys):
    shutil.copytree(images / "train", tmp_path / "data" / "train")
    shutil.copytree(images / "val", tmp_path / "data" / "val" / "pets")
    line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "imagefolder", "--data-dir",
                   tmp_path / "data", *FILES)
    assert f"{tmp_path / 'data' / 'val'} holds 1 class folder ('pets')" in line


def test_a_csv_of_one_label_is_refused(tmp_path, monkeypatch, capsys):
    root = csv_folder(tmp_path / "data", ["file,label", *(f"{k}.png,cat" for k in range(10))])
    line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "csv", "--data-dir", root, *FILES)
    assert line == (f"error: csv: {root / 'train.csv'} has 1 label ('cat'); a classifier needs two or more: "
                    "give each row its class after the file (file,label)\n")


def test_a_dataset_for_workers_on_the_device_loader_is_one_line(tmp_path, monkeypatch, capsys):
    """Image files go on the device decoded (issue 48); a Dataset of a fork's, which only workers can read,
    is refused on --loader device and host."""
    add_entries(monkeypatch, "two_inputs_data", "two_inputs_model")
    for mode in ("device", "host"):
        line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "pairs_dataset", "--model",
                       "twoinputnet", "--synthetic-size", "32", "--loader", mode)
        assert line == (f"error: --loader {mode} holds tensors or image files, and this dataset's Dataset is "
                        "read by DataLoader workers; use --loader auto or dataloader\n")


# ---------------------------------------------------------------- 3: rows without a label

def test_csv_rows_without_a_label_are_refused_by_their_row_numbers(tmp_path, monkeypatch, capsys):
    lines = ["file,label", *(f"{k}.png,{'ab'[k % 2]}" for k in range(10))]
    lines[3], lines[6], lines[7] = "2.png,", "5.png", "6.png,  "  # rows 4, 7 and 8 as a spreadsheet shows
    root = csv_folder(tmp_path / "data", lines)
    line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "csv", "--data-dir", root, *FILES)
    assert line == (f"error: csv: {root / 'train.csv'} has rows without a label: rows 4, 7, 8 (the header is "
                    "row 1); give each its class after the file (file,label)\n")


# ---------------------------------------------------------------- 4: a CSV without a header

def test_a_headerless_train_and_val_csv_keep_their_first_rows(tmp_path):
    rows = [f"{k}.png,{'ab'[k % 2]}" for k in range(10)]
    root = csv_folder(tmp_path, rows[:7], val=rows[7:])
    source = csv_source(root)
    assert files_of(source.train) == {str(root / f"{k}.png") for k in range(7)}
    assert files_of(source.val) == {str(root / f"{k}.png") for k in range(7, 10)}
    assert source.notes == [f"csv: {root / name} has no header (its first row names a file): read as data"
                            for name in ("train.csv", "val.csv")]
    (root / "val.csv").unlink()  # with a header, as before: the first row is not read
    (root / "train.csv").write_text("path,class\n" + "\n".join(rows) + "\n")
    assert len(csv_source(root).train) + len(csv_source(root).val) == 10 and csv_source(root).notes == []


def test_a_headerless_predict_csv_keeps_its_first_row(image_run, images, tmp_path, monkeypatch, capsys):
    files = sorted((images / "val").glob("*/*.png"))
    (tmp_path / "list.csv").write_text("".join(f"{file}\n" for file in files))
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", tmp_path / "list.csv", "--checkpoint",
                              image_run / "best.pt", "--out-dir", tmp_path, *CPU_FLAGS)
    assert code == 0, err
    predicted = (tmp_path / "predictions.csv").read_text().splitlines()[1:]
    assert [line.split(",")[0] for line in predicted] == list(map(str, files))
    note = f"{tmp_path / 'list.csv'} has no header (its first row names a file): read as data"
    assert out.splitlines()[-1].endswith(f"; {note}")


# ---------------------------------------------------------------- 6: empty splits, refused at start-up

def test_a_val_folder_without_readable_images_is_refused_at_start_up(images, tmp_path, monkeypatch, capsys):
    """Issue item 9: .HEIC files alone in val/ trained a whole epoch, then divided by zero."""
    root = tmp_path / "data"
    shutil.copytree(images, root)
    for png in sorted((root / "val").glob("*/*.png")):
        png.rename(png.with_suffix(".HEIC"))
    line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "imagefolder", "--data-dir", root,
                   *FILES)
    assert line.startswith(f"error: imagefolder: {root / 'val'} holds no images (skipped 8 in val/ - "
                           "not images: 8 (dark/0.HEIC, dark/1.HEIC, dark/2.HEIC)); the val split needs some")


@pytest.mark.parametrize("empty", ["train", "val"])
def test_an_empty_split_of_any_dataset_is_refused_at_start_up(empty, tmp_path, monkeypatch, capsys):
    """A fork's dataset entry whose split holds no examples (the generic check in build_loaders)."""
    def hollow(cfg) -> data.Source:
        sizes = {"train": 16, "val": 16, empty: 0}
        splits = {split: (torch.zeros(n, 3, 8, 8, dtype=torch.uint8), torch.zeros(n, dtype=torch.long))
                  for split, n in sizes.items()}
        return data.Source(splits["train"], splits["val"], ["a", "b"], notes=["hollow: skipped 8 files"])

    monkeypatch.setitem(data.DATASETS, "hollow", hollow)
    line = refused(monkeypatch, capsys, tmp_path / "run", *TINY, "--dataset", "hollow")
    assert line == (f"error: hollow: the {empty} split holds no examples (hollow: skipped 8 files); give it "
                    "some (its dataset entry in data.py, or the files in --data-dir)\n")


# ---------------------------------------------------------------- 5: TOML values of the wrong type

@pytest.mark.parametrize("line, shown", [
    ('out_dir = ["run"]', "out_dir expects a string, got a list: ['run']"),  # made a folder named "['run']"
    ("out_dir = 3", "out_dir expects a string, got a number: 3"),
    ("seed = { value = 1 }", "seed expects an integer, got a table: {'value': 1}"),
    ('epochs = "3"', "epochs expects an integer, got a string: '3'"),
    ('augment = "false"', "augment expects true or false, got a string: 'false'"),
    ("lr = [0.1, 0.2]", "lr expects a number or 'auto', got a list: [0.1, 0.2]"),
    ("batch-size = 1979-05-27", "batch-size expects an integer, got a date: datetime.date(1979, 5, 27)"),
])
def test_a_preset_value_of_the_wrong_type_is_one_line(line, shown, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where a relative out_dir would land
    (tmp_path / "preset.toml").write_text(line + "\n")
    code, out, err = run_main(monkeypatch, capsys, "--config", "preset.toml", *TINY)
    assert assert_one_line_failure(code, out, err) == f"error: preset.toml: {shown}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["preset.toml"]


def test_preset_values_of_their_type_still_load(tmp_path):
    (tmp_path / "preset.toml").write_text('epochs = 3.0\nlr = "auto"\nmomentum = 1\naugment = false\n'
                                          'out_dir = "runs/x"\n')
    cfg = parse_config(["--config", str(tmp_path / "preset.toml")])
    assert (cfg.epochs, cfg.lr, cfg.momentum, cfg.augment, cfg.out_dir) == (3, "auto", 1.0, False, "runs/x")


# ---------------------------------------------------------------- 7: a small /dev/shm and DataLoader workers

SHM = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here (not Linux)")


@SHM
@pytest.mark.parametrize("free, said", [(1000, "refused"), (3000, "a note"), (10**9, "nothing")])
def test_too_little_shared_memory_for_the_workers_is_found_at_start_up(free, said, images, tmp_path,
                                                                       monkeypatch, capsys):
    """Batches of 4 images 3x8x8 (768 bytes), one worker: 3 in flight (2304 bytes); twice that is ample."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: SimpleNamespace(free=free) if str(path) == "/dev/shm" else real(path))
    argv = ["--dataset", "imagefolder", "--data-dir", images, *FILES, "--num-workers", "1", "--loader",
            "dataloader"]
    advice = "use --num-workers 0, or give the container more shared memory (docker run --shm-size=2g)"
    if said == "refused":
        line = refused(monkeypatch, capsys, tmp_path / "run", *argv)
        assert line == ("error: /dev/shm has 0.0 MiB free and the DataLoader's batches in flight need about "
                        f"0.0 MiB; {advice}\n")
        return
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "run")
    assert code == 0, err
    assert (f"if workers fail for want of shared memory, {advice}" in out) == (said == "a note"), out


def test_workers_out_of_shared_memory_mid_run_is_one_line_and_keeps_the_checkpoint(images, tmp_path,
                                                                                    monkeypatch, capsys):
    """As torch reports it in the loop: a worker's RuntimeError, its traceback as text (54 lines in all)."""
    order, _, _ = batches.epoch_plan(16, 0, 0)
    bad, real = int(order[9]), ImageFiles.__getitem__  # in the third batch of four: after two steps

    def getitem(self, i):  # in the worker process
        if len(self.items) == 16 and i == bad:
            raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: No space "
                               "left on device (28)")
        return real(self, i)

    monkeypatch.setattr(ImageFiles, "__getitem__", getitem)
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "imagefolder", "--data-dir", images, *FILES,
                              "--num-workers", "1", "--loader", "dataloader", "--save-every", "1",
                              "--out-dir", tmp_path)
    assert assert_one_line_failure(code, out, err) == (
        "error: DataLoader workers ran out of shared memory (RuntimeError: unable to allocate shared "
        "memory(shm) for file </torch_1_2_0>: No space left on device (28)); use --num-workers 0, or give "
        "the container more shared memory (docker run --shm-size=2g); the checkpoints on disk are as they "
        "were\n")
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 2


# ---------------------------------------------------------------- 8: SIGTERM to the group, workers included

SLOW_WORKERS = """
import sys, time
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from forks import classification  # the tests' task, whatever task.py holds (conftest.py)
sys.modules["task"] = classification
import torch
from machinery.image_files import ImageFiles
real = ImageFiles.__getitem__

def slow(self, i):  # in a DataLoader worker: says it reads, then reads slowly
    if worker := torch.utils.data.get_worker_info():
        open({marker!r} + str(worker.id), "a").close()
        time.sleep(0.2)
    return real(self, i)

ImageFiles.__getitem__ = slow
"""


def terminated(tmp_path: Path, command: str, workers: int = 2) -> subprocess.CompletedProcess:
    """`command` after SLOW_WORKERS in a process of its own group, sent SIGTERM (to the whole group, as
    systemd, Slurm or kill -TERM -PGID do) once each of its DataLoader workers reads an image."""
    marker = str(tmp_path / "reading-")
    code = SLOW_WORKERS.format(root=str(ROOT), marker=marker) + command
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and not all(
            Path(marker + str(worker)).exists() for worker in range(workers)):
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_to_the_group_during_predict_with_workers_is_one_line(image_run, images, tmp_path):
    argv = ["--predict", str(images), "--checkpoint", str(image_run / "best.pt"), "--device", "cpu",
            "--num-workers", "2", "--batch-size", "4", "--out-dir", str(tmp_path / "out")]
    as_the_script = "from machinery.stops import SIGNALS\nSIGNALS.pass_on = False\n"  # ends as it would
    command = f"{as_the_script}import evaluate\nsys.argv = ['evaluate.py', *{argv!r}]\nevaluate.main()\n"
    stopped = terminated(tmp_path, command)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert stopped.stderr.startswith("error: interrupted by SIGTERM") and stopped.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()  # no predictions.csv, whole or half


def test_sigterm_to_the_group_during_lr_find_with_workers_is_one_line(images, tmp_path):
    argv = ["--dataset", "imagefolder", "--data-dir", str(images), *FILES, "--num-workers", "2",
            "--loader", "dataloader", "--find-iters", "200", "--out-dir", str(tmp_path / "out")]
    as_the_script = "from machinery.stops import SIGNALS\nSIGNALS.pass_on = False\n"  # ends as it would
    stopped = terminated(tmp_path, f"{as_the_script}import lr_find\nlr_find.main({argv!r})\n")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert stopped.stderr == ("error: interrupted by SIGTERM; lr_find wrote nothing and the model is as it "
                              "was: run the command again\n")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 9: lr_find.json and lr_find.png, one unit

class Killed(BaseException):
    """kill -9: nothing after it runs, no handler catches it."""


def a_sweep(lowest: float) -> lr_find.LRFindResult:
    """A sweep whose loss bottoms out at lr `lowest`: 60 steps from 1e-5 to 10."""
    lrs = [10 ** (-5 + 6 * i / 59) for i in range(60)]
    losses = [2 - math.tanh(2 * math.log10(lr / lowest) + 4) + max(0.0, math.log10(lr / lowest)) ** 2
              for lr in lrs]
    return lr_find._result(lrs, losses, "onecycle", None, "sgd", smoothed=losses, stop_reason="completed")


@pytest.mark.parametrize("after", ["lr_find.json", "lr_find.png"])
def test_a_sweep_killed_between_its_files_is_told_by_lr_auto(after, tmp_path, monkeypatch, capsys):
    """Both files name their sweep: a kill -9 between their writes leaves one sweep's pair, or a record
    beside another sweep's picture, which --lr auto says in one line (and trains with the record)."""
    pytest.importorskip("matplotlib")
    cfg = parse_config(["--out-dir", str(tmp_path), "--lr", "auto"])
    config = {**cfg.to_dict(), "task": checkpoints.task_identity(task)}
    lr_find.save_sweep(a_sweep(0.1), config, tmp_path)
    real = lr_find._write_atomically

    def write(path, data):
        real(path, data)
        if path.name == after:
            raise Killed

    monkeypatch.setattr(lr_find, "_write_atomically", write)
    with pytest.raises(Killed):
        lr_find.save_sweep(a_sweep(0.01), config, tmp_path)  # the next sweep, killed after `after`
    capsys.readouterr()
    lr_auto.resolve_lr(cfg, task, OPTIMIZERS)
    said = capsys.readouterr().out.splitlines()
    record = json.loads((tmp_path / "lr_find.json").read_text())
    one_unit = lr_auto.png_text(tmp_path / "lr_find.png").get(lr_find.PNG_SWEEP_KEY) == record.get("sweep")
    assert one_unit == (after == "lr_find.json") and len(said) == 2 - one_unit, said
    assert one_unit or said[1].startswith(f"lr auto: {tmp_path / 'lr_find.png'} is not the picture of this "
                                          "sweep (a sweep stopped between writing the two")
