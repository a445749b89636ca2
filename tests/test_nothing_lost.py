"""Nothing lost, round three (issue 32): data that would train on a wrong split or class list, presets of
the wrong type, and faults that ended in tracebacks, each refused or said in one line at start-up:
repeated and conflicting CSV rows, a val.csv sharing train.csv's files, image folders one level too high
(and single-label CSVs), rows without a label, headerless CSVs (train.csv, val.csv, --predict's), TOML
values of the wrong type, empty splits, a small /dev/shm, SIGTERM to the process group of --predict and
lr_find.py with DataLoader workers, and lr_find.json beside another sweep's lr_find.png."""

import shutil
from pathlib import Path

import pytest
import test_faults
import torch
from conftest import run_main
from test_faults import assert_one_line_failure, save_png

import data
from configs import parse_config

CPU = torch.device("cpu")
images = test_faults.images  # the fixture: two classes of PNG files, 8 train and 4 val images each
FILES = ["--image-size", "8", "--width", "4", "--batch-size", "4", "--epochs", "1", "--device", "cpu",
         "--num-workers", "0"]


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


def test_two_classes_on_the_device_loader_still_ask_for_workers(images, tmp_path, monkeypatch, capsys):
    """test_faults' "data folder on the device loader" has one class, which is now refused first."""
    line = refused(monkeypatch, capsys, tmp_path / "run", "--dataset", "imagefolder", "--data-dir", images,
                   *FILES, "--loader", "device")
    assert "imagefolder reads files through workers; use --loader dataloader" in line


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
