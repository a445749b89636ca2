"""Nothing lost, round four (issue 41, 7 and 12-15): the files users have. A held-out fraction keeps every
class in training; Excel's CSVs (a byte-order mark, ';' between fields) read as they look; a preset that
sets a key twice, or holds a [section], is one line that says so."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_faults
import test_nothing_lost
from conftest import ROOT, run_evaluate
from test_nothing_lost import FILES, csv_folder, csv_source, files_of

import data
import train
from configs import UserError, parse_config
from machinery import resume

images = test_faults.images  # the fixture: two classes of PNG files, 8 train and 4 val images each
image_run = test_nothing_lost.image_run  # a one-epoch run on them


def test_a_held_out_fraction_leaves_every_class_a_training_example(tmp_path):
    rows = ["file,label", *[f"{k}.png,{'abc'[k % 3]}" for k in range(21)], "21.png,d"]
    source = csv_source(csv_folder(tmp_path, rows, count=22), "--val-fraction", "0.3")
    assert str(tmp_path / "21.png") in files_of(source.train)  # d's only row: held out, d would be untrained
    assert len(source.val) == 7 and {label for _, label in source.val.items} == {0, 1, 2}
    one_each = ["file,label", *[f"{k}.png,{'abcdefghij'[k]}" for k in range(10)]]
    with pytest.raises(UserError, match="every class has one training example"):
        csv_source(csv_folder(tmp_path / "one", one_each), "--val-fraction", "0.3")


def test_excel_csv_files_read_as_they_look(tmp_path):
    rows = [f"{k}.png,{'ab'[k % 2]}" for k in range(10)]
    root = csv_folder(tmp_path, [])
    (root / "train.csv").write_bytes(("\n".join(rows) + "\n").encode("utf-8-sig"))  # "CSV UTF-8": a BOM
    source = csv_source(root)
    assert len(source.train) + len(source.val) == 10, "the first row is data, not a header"
    (root / "train.csv").write_text("file;label\n" + "\n".join(row.replace(",", ";") for row in rows) + "\n")
    source = csv_source(root)
    assert len(source.train) + len(source.val) == 10 and source.names == ["a", "b"]
    assert f"csv: {root / 'train.csv'} separates its fields with ';'" in source.notes[0]


@pytest.mark.parametrize("preset, said", [
    ("batch-size = 64\nbatch_size = 32\n", "'batch-size' and 'batch_size' both set batch_size; keep one"),
    ("epochs = 2\n[train]\nlr = 0.1\n", "[train] is a section, and a preset's settings are read from"),
], ids=["a-key-twice", "a-section"])
def test_a_preset_that_says_a_setting_twice_or_in_a_section_is_one_line(preset, said, tmp_path):
    (tmp_path / "preset.toml").write_text(preset)
    with pytest.raises(UserError, match="^" + str(tmp_path / "preset.toml")) as refused:
        parse_config(["--config", str(tmp_path / "preset.toml")])
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_evaluate_names_its_split_and_says_what_it_shares_with_the_training_files(tmp_path, monkeypatch,
                                                                                   capsys):
    """A test.csv that lists training rows is said; a val split that took training rows since (rows
    reordered: others held out) is measured, and how many of its images the run trained on is said (issue
    49, 5: it was refused, as was any other folder)."""
    rows = ["file,label", *[f"{k}.png,{'ab'[k % 2]}" for k in range(20)]]
    root = csv_folder(tmp_path / "data", rows, count=24)
    (root / "test.csv").write_text("\n".join(["file,label", *rows[17:], "20.png,a", "21.png,b", "22.png,a",
                                               "23.png,b"]))  # 4 training rows, 4 of its own
    out = tmp_path / "run"
    train.train(parse_config(["--dataset", "csv", "--data-dir", str(root), *FILES, "--out-dir", str(out)]))
    capsys.readouterr()
    code, said, err = run_evaluate(monkeypatch, capsys, "--checkpoint", out / "best.pt", "--split", "test")
    assert code == 0 and "test loss" in said and "val loss" not in said, (code, said, err)
    assert "csv: test.csv lists 4 of train.csv's files too" in said, said
    assert "no held-out measure" in json.loads((out / "eval.json").read_text())["note"]
    trained = {file for file, _ in data.csv_images(parse_config(["--dataset", "csv", "--data-dir",
                                                                  str(root)])).train.items}
    (root / "train.csv").write_text("\n".join([rows[0], *reversed(rows[1:])]) + "\n")  # other rows held out
    held = {file for file, _ in data.csv_images(parse_config(["--dataset", "csv", "--data-dir",
                                                               str(root)])).val.items}
    code, said, err = run_evaluate(monkeypatch, capsys, "--checkpoint", out / "best.pt")
    assert code == 0 and 0 < len(held & trained), (err, held & trained)
    assert (f"--split val: {len(held & trained)} of its {len(held)} images are among the run's "
            f"{len(trained)} training images") in said, said


def test_an_empty_test_folder_is_said_to_be_empty(images, tmp_path):
    shutil.copytree(images, tmp_path / "data")
    (tmp_path / "data" / "test").mkdir()
    with pytest.raises(UserError, match="test is empty; give it a folder per class as train/ has .dark, light"
                                       "., or remove it: a test split is optional"):
        data.image_folder(parse_config(["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data")]))


def test_a_resume_on_other_files_of_the_same_sizes_is_refused():
    saved = {"train_size": 18, "val_size": 2, "test_size": None, "batches": 4, "names": ["a", "b"],
             "files": {"train": "0f", "val": "1e"}}
    resumed = resume.Resumed(Path("run/last.pt"), {"data": saved})
    with pytest.raises(UserError, match=r"trained on other data \(other val files\)"):
        resume.check_same_data(resumed, {**saved, "files": {"train": "0f", "val": "2d"}})
    resume.check_same_data(resumed, saved)
    older = resume.Resumed(Path("run/last.pt"), {"data": {**saved, "files": None}})  # before the lists
    resume.check_same_data(older, {**saved, "files": {"train": "0f", "val": "2d"}})


def test_predict_keeps_latin_1_names_follows_links_and_names_what_it_skipped(image_run, images, tmp_path,
                                                                              monkeypatch, capsys):
    """Names as Windows zips leave them (bytes, not UTF-8), a linked folder and a broken link: every image
    predicted, its name written as the disk has it; the broken link counted and named."""
    folder = tmp_path / "new"
    folder.mkdir()
    latin_1 = folder / os.fsdecode(b"caf\xe9.png")  # a lone surrogate in Python's str
    shutil.copy(next((images / "val" / "dark").glob("*.png")), latin_1)
    (folder / "linked").symlink_to(images / "val" / "light", target_is_directory=True)
    (folder / "gone.png").symlink_to(tmp_path / "nowhere.png")
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", folder, "--checkpoint",
                                  image_run / "best.pt", "--out-dir", tmp_path)
    assert code == 0 and err == "", (code, err)
    written = (tmp_path / "predictions.csv").read_bytes()
    assert b"caf\xe9.png" in written and written.count(b"\n") == 1 + 1 + 4
    assert "5 files predicted" in out and "1 skipped (broken links: gone.png)" in out, out


def test_a_dataloader_worker_says_nothing_of_the_connection_a_stopping_main_process_dropped():
    """SIGTERM to the group during --predict with workers: the main process stops in one line, and a
    worker's thread that was handing it a batch (multiprocessing's resource_sharer reports through
    sys.excepthook) found the connection reset; about 1 run in 3 printed that in 20 lines. Errors of
    other kinds still show."""
    code = """if True:
        import signal, sys
        from machinery import workers
        signal.signal(signal.SIGTERM, lambda *_: None)  # the main process's handler, as workers inherit it
        workers.worker_init(0)
        for error in (ConnectionResetError(104, "Connection reset by peer"), ValueError("a real one")):
            try:
                raise error
            except Exception:
                sys.excepthook(*sys.exc_info())
    """
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "ConnectionResetError" not in done.stderr, done.stderr
    assert "ValueError: a real one" in done.stderr
