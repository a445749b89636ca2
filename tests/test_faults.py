"""Bad input and faults: each ends with a non-zero exit, one line on stderr, no traceback, and no
checkpoint damaged. Also: short runs train with every schedule, and booleans take the values
people type."""

import dataclasses
import errno
import io
import json
import math
import os
import random
import shlex
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import build_loaders, fingerprint, run_main, run_script

import task
import train
from configs import Config, parse_config, parse_given
from machinery import checkpoints, files
from machinery.batches import epoch_plan

TINY = ["--dataset", "synthetic", "--synthetic-size", "64", "--num-classes", "2", "--image-size", "8",
        "--width", "4", "--batch-size", "16", "--epochs", "1", "--device", "cpu", "--num-workers", "0"]


def assert_one_line_failure(code, out: str, err: str) -> str:
    assert code not in (0, None), (code, err)
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    return err


def save_png(path: Path, size: int, seed: int, base: int = 40) -> None:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = (base + torch.randint(0, 60, (size, size, 3), generator=g)).to(torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.numpy()).save(path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (last.pt, best.pt) that no bad input may touch."""
    out = tmp_path_factory.mktemp("finished")
    train.train(parse_config([*TINY, "--out-dir", str(out)]))
    assert {"last.pt", "best.pt"} <= set(fingerprint(out))
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two classes of PNG files, dark and light: 8 train and 4 val images each."""
    root = tmp_path_factory.mktemp("images")
    for split, count in (("train", 8), ("val", 4)):
        for label, name in enumerate(("dark", "light")):
            for k in range(count):
                save_png(root / split / name / f"{k}.png", 12, 100 * label + k, 40 + 150 * label)
    return root


# ---------------------------------------------------------------- bad input: flags, TOML, checkpoints, data

def toml(ctx, content: str | bytes) -> list[str]:
    path = ctx.tmp / "bad.toml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return ["--config", path]


def resume_from(ctx, content) -> list[str]:
    """--resume a file holding `content`: raw bytes, or anything torch.save can write."""
    path = ctx.tmp / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    return ["--resume", path]


def changed_checkpoint(ctx, change) -> dict:
    ckpt = checkpoints.load_checkpoint(ctx.run / "last.pt")
    change(ckpt)
    return ckpt


class Trap:
    """Unpickling this would create a file: code hidden in a checkpoint."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def image_folder(ctx, layout: dict[str, list[str]]) -> list[str]:
    """A data folder with the given class folders per split; names ending in .png get an image."""
    root = ctx.tmp / "folder"
    for split, entries in layout.items():
        (root / split).mkdir(parents=True)
        for entry in entries:
            if entry.endswith(".png"):
                save_png(root / split / entry, 12, len(entry))
            else:
                (root / split / entry).mkdir(parents=True)
    return ["--dataset", "imagefolder", "--data-dir", root]


def nan_weight(ckpt):
    next(iter(ckpt["model"].values())).view(-1)[0] = float("nan")


def wrong_shape(ckpt):
    key = next(iter(ckpt["model"]))
    ckpt["model"][key] = torch.zeros(3)
    ckpt["run"]["epoch"] = 0  # mid-run: a complete run's resume has nothing to do, shapes or not


def unfinished(ctx) -> list[str]:
    """A fresh run pointed at an unfinished run's out_dir."""
    folder = ctx.tmp / "unfinished"
    folder.mkdir()
    ckpt = changed_checkpoint(ctx, lambda c: c.update(step=1))
    checkpoints.write_checkpoint(ckpt, folder / "last.pt")
    ctx.watched = folder
    return ["--out-dir", folder]


BAD_INPUTS = {
    # flags
    "flag typo": lambda ctx: ["--epoch", "3"],
    "epochs as a word": lambda ctx: ["--epochs", "two"],
    "zero epochs": lambda ctx: ["--epochs", "0"],
    "negative lr": lambda ctx: ["--lr", "-1"],
    "lr as a word": lambda ctx: ["--lr", "fast"],
    "zero batch size": lambda ctx: ["--batch-size", "0"],
    "batch larger than the data": lambda ctx: ["--batch-size", "1000"],
    "negative accumulation": lambda ctx: ["--accum-steps", "-1"],
    "schedule typo": lambda ctx: ["--schedule", "cosin"],
    "dataset typo": lambda ctx: ["--dataset", "cifar"],
    "model typo": lambda ctx: ["--model", "resnet1"],
    "device that does not exist": lambda ctx: ["--device", "tpu"],
    "boolean as a word": lambda ctx: ["--augment", "maybe"],
    "--no-flag with a value": lambda ctx: ["--no-flip", "false"],
    "label smoothing above 1": lambda ctx: ["--label-smoothing", "2"],
    "pct_start of 1": lambda ctx: ["--pct-start", "1"],
    "warmup with onecycle": lambda ctx: ["--warmup-epochs", "1"],
    "warmup longer than the run": lambda ctx: ["--schedule", "cosine", "--warmup-epochs", "5"],
    "warmup schedule without a warmup": lambda ctx: ["--schedule", "warmup"],
    "step decay of 0": lambda ctx: ["--schedule", "step", "--gamma", "0"],
    "lr_find range reversed": lambda ctx: ["--find-start-lr", "5", "--find-end-lr", "1"],
    "stray word": lambda ctx: ["stray"],
    "--lr auto before lr_find.py": lambda ctx: ["--lr", "auto"],
    "fresh run over an unfinished one": unfinished,
    # TOML files
    "TOML file missing": lambda ctx: ["--config", ctx.tmp / "missing.toml"],
    "TOML is a folder": lambda ctx: ["--config", ctx.tmp],
    "TOML syntax": lambda ctx: toml(ctx, "epochs = \n"),
    "TOML unknown key": lambda ctx: toml(ctx, "epoch = 3\n"),
    "TOML wrong type": lambda ctx: toml(ctx, 'epochs = "many"\n'),
    "TOML bad boolean": lambda ctx: toml(ctx, 'augment = "maybe"\n'),
    "TOML resume key": lambda ctx: toml(ctx, 'resume = "auto"\n'),
    "TOML lr of 0": lambda ctx: toml(ctx, "lr = 0\n"),
    "TOML not UTF-8": lambda ctx: toml(ctx, b"epochs = 3 # \xff\xfe\n"),
    # checkpoints
    "checkpoint missing": lambda ctx: ["--resume", ctx.tmp / "none.pt"],
    "checkpoint is a folder": lambda ctx: ["--resume", ctx.tmp],
    "checkpoint empty": lambda ctx: resume_from(ctx, b""),
    "checkpoint random bytes": lambda ctx: resume_from(ctx, random.Random(0).randbytes(4096)),
    "checkpoint truncated": lambda ctx: resume_from(ctx, (ctx.run / "last.pt").read_bytes()[:1500]),
    "checkpoint runs code": lambda ctx: resume_from(ctx, {"model": {}, "x": Trap(ctx.tmp / "pwned")}),
    "checkpoint not a dict": lambda ctx: resume_from(ctx, [1, 2, 3]),
    "checkpoint missing keys": lambda ctx: resume_from(ctx, {"config": Config().to_dict()}),
    "checkpoint other config": lambda ctx: [
        *resume_from(ctx, checkpoints.load_checkpoint(ctx.run / "last.pt")), "--width", "8"],
    "checkpoint nan weights": lambda ctx: resume_from(ctx, changed_checkpoint(ctx, nan_weight)),
    "checkpoint wrong shapes": lambda ctx: resume_from(ctx, changed_checkpoint(ctx, wrong_shape)),
    # data folders
    "data folder missing": lambda ctx: ["--dataset", "imagefolder", "--data-dir", ctx.tmp / "none"],
    "data folder without val": lambda ctx: image_folder(ctx, {"train": ["a/1.png", "b/1.png"]}),
    "data folder without images": lambda ctx: image_folder(ctx, {"train": ["a"], "val": ["a"]}),
    "data folder classes differ": lambda ctx: image_folder(
        ctx, {"train": ["a/1.png", "b/1.png"], "val": ["a/1.png", "c/1.png"]}),
    "data folder on the device loader": lambda ctx: [
        *image_folder(ctx, {"train": ["a/1.png"], "val": ["a/1.png"]}), "--loader", "device"],
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line_and_touches_no_checkpoint(name, finished, tmp_path, monkeypatch, capsys):
    ctx = SimpleNamespace(tmp=tmp_path, run=finished, watched=finished)
    argv = BAD_INPUTS[name](ctx)
    watched = {ctx.watched: fingerprint(ctx.watched), finished: fingerprint(finished)}
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", finished, *argv)
    assert code == 2
    assert_one_line_failure(code, out, err)
    for folder, prints in watched.items():
        assert fingerprint(folder) == prints, f"{name} changed a checkpoint in {folder}"
    assert not (tmp_path / "pwned").exists()


def test_bad_input_count_in_readme_and_docs():
    for page in ("README.md", "docs/testing.md"):
        text = (Path(__file__).resolve().parents[1] / page).read_text()
        assert f"{len(BAD_INPUTS)} bad inputs" in text and f"{len(FAULTS)} faults" in text, page


# ---------------------------------------------------------------- faults during a run

FAULTS = []


def fault(test):
    """Marks a test as one of the faults the README counts."""
    FAULTS.append(test.__name__)
    return test


@fault
def test_diverging_lr_stops_with_a_line_and_saves_nothing(tmp_path, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "3", "--lr", "1e4",
                              "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert "diverged at step" in line and "a lower --lr than 1e+04 in a new folder" in line
    assert "--lr 1000.0 " in line and f"--out-dir {tmp_path}-lr1000`" in line
    assert "python lr_find.py" in line and "no checkpoint" in line
    assert not list(tmp_path.glob("*.pt"))


@fault
def test_nan_mid_run_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    step = train.optimizer_step
    count = [0]

    def poisoned(optimizer, *args, **kwargs):
        count[0] += 1
        if count[0] == 5:  # after the save at step 4, before the log point at step 6
            optimizer.param_groups[0]["params"][0].data.fill_(float("nan"))
        return step(optimizer, *args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", poisoned)
    run = [*TINY, "--epochs", "3", "--log-every", "3", "--save-every", "2", "--out-dir", tmp_path]
    code, out, err = run_main(monkeypatch, capsys, *run)
    line = assert_one_line_failure(code, out, err)
    assert "diverged at step" in line and "still holds step 4" in line
    saved = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 4 and checkpoints.all_finite(saved["model"].values())
    monkeypatch.setattr(train, "optimizer_step", step)
    summary = train.train(parse_config([*run[:-2], "--out-dir", str(tmp_path), "--resume"]))
    assert summary["steps"] == 12 and math.isfinite(summary["val_loss"])


@fault
def test_loss_far_above_its_start_stops_the_run(tmp_path, monkeypatch, capsys):
    real = task.loss
    calls = [0]

    def exploding(*args, **kwargs):  # the task's loss: the start-up check's batch and training's first 4,
        calls[0] += 1                 # then 100 times larger (val's too)
        return real(*args, **kwargs) * (1 if calls[0] <= 5 else 100)

    monkeypatch.setattr(task, "loss", exploding)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--log-every", "2",
                              "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert "diverged at step 6" in line and "over 4x the first batch's" in line


@fault
def test_nan_val_loss_is_reported_and_not_saved(tmp_path, monkeypatch, capsys):
    real, calls = train.evaluate, [0]

    def evaluate(*args):
        calls[0] += 1
        result = real(*args)
        nan = {"loss": float("nan"), "acc": 0.9}
        return dataclasses.replace(result, metrics=nan) if calls[0] == 2 else result

    monkeypatch.setattr(train, "evaluate", evaluate)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert "val loss nan after epoch 2" in line and "still holds step 4" in line
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 4
    assert checkpoints.load_checkpoint(tmp_path / "best.pt")["step"] == 4



def test_the_divergence_line_gives_a_command_that_runs(tmp_path, monkeypatch, capsys):
    """Issue 49: a lower --lr in the same --out-dir is refused (its last.pt holds the unfinished run), so the
    line's command names a new folder beside it; run as given, it trains."""
    real, calls = train.evaluate, [0]

    def evaluate(*args):
        calls[0] += 1
        result = real(*args)
        inf = {"loss": math.inf, "acc": 0.5}
        return dataclasses.replace(result, metrics=inf) if calls[0] == 2 else result

    monkeypatch.setattr(train, "evaluate", evaluate)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "3", "--out-dir", tmp_path / "run")
    line = assert_one_line_failure(code, out, err)
    assert "still holds step 4" in line and "try a lower --lr than 0.2 in a new folder, e.g. `python" in line
    command = shlex.split(line.split("`")[1])
    given = parse_given(command[2:])
    assert command[:2] == ["python", "train.py"] and (given["lr"], given["out_dir"]) == (
        0.02, str(tmp_path / "run-lr0.02"))
    monkeypatch.setattr(train, "evaluate", real)
    code, out, err = run_main(monkeypatch, capsys, *command[2:])
    assert code == 0 and err == "", err
    assert json.loads((tmp_path / "run-lr0.02" / "summary.json").read_text())["lr"] == 0.02

def imagefolder_run(images, tmp_path, *extra) -> tuple[Path, list]:
    root = tmp_path / "images"
    shutil.copytree(images, root)
    run = [*TINY, "--dataset", "imagefolder", "--data-dir", root, "--batch-size", "4",
           "--epochs", "2", "--out-dir", tmp_path / "run", *extra]
    return root, run


@fault
def test_unreadable_image_in_a_worker_saves_and_resumes(images, tmp_path, monkeypatch, capsys):
    root, run = imagefolder_run(images, tmp_path, "--num-workers", "1", "--loader", "dataloader")
    files = sorted((root / "train").glob("*/*.png"))  # ImageFolder's order
    order, _, _ = epoch_plan(len(files), 0, 0)
    bad = files[order[9]]  # read in the third batch of four: after two optimizer steps
    bad.write_bytes(random.Random(1).randbytes(100))
    code, out, err = run_main(monkeypatch, capsys, *run)
    line = assert_one_line_failure(code, out, err)
    assert f"cannot read image {bad} (class folder '{bad.parent.name}')" in line and "--resume" in line
    saved = checkpoints.load_checkpoint(tmp_path / "run" / "last.pt")
    assert (saved["run"]["epoch"], saved["run"]["batch"], saved["step"]) == (0, 2, 2)
    assert "holds step 2" in line
    save_png(bad, 12, 5)
    summary = train.train(parse_config([*map(str, run), "--resume"]))
    assert summary["epochs"] == 2 and math.isfinite(summary["val_loss"])


@fault
def test_truncated_image_in_val_saves_at_the_epoch_end(images, tmp_path, monkeypatch, capsys):
    root, run = imagefolder_run(images, tmp_path, "--loader", "dataloader")  # files read every epoch
    save_png(root / "val" / "dark" / "big.png", 64, 7)
    data = (root / "val" / "dark" / "big.png").read_bytes()
    (root / "val" / "dark" / "big.png").write_bytes(data[: len(data) // 2])
    code, out, err = run_main(monkeypatch, capsys, *run)
    line = assert_one_line_failure(code, out, err)
    assert "big.png (class folder 'dark')" in line
    saved = checkpoints.load_checkpoint(tmp_path / "run" / "last.pt")
    assert (saved["run"]["epoch"], saved["run"]["batch"], saved["step"]) == (0, 4, 4)


@fault
def test_out_dir_under_a_file_is_refused_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path / "file" / "run")
    line = assert_one_line_failure(code, out, err)
    assert f"--out-dir {tmp_path / 'file' / 'run'}" in line and "not a directory" in line
    assert out == ""  # refused before the data was even loaded


@fault
def test_out_dir_without_permission_is_refused(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores the mode: inject the refusal instead
        write_bytes = Path.write_bytes

        def refuse(self, data):
            if self.name.startswith(".write-test"):
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return write_bytes(self, data)

        monkeypatch.setattr(Path, "write_bytes", refuse)
    try:
        code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", locked / "run")
    finally:
        locked.chmod(0o700)
    line = assert_one_line_failure(code, out, err)
    assert f"cannot write --out-dir {locked / 'run'}: permission denied" in line and "free" in line
    assert not (locked / "run").exists()


class DiskFull(io.RawIOBase):
    """A file that takes `room` bytes and then fails as a full disk does."""

    def __init__(self, room: int):
        self.room = room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return len(data)


def fail_writes(monkeypatch, name: str, error: int, after: int = 0, room: int = 1000):
    """Make machinery/files.py's writes of `name` fail with `error` from the (after+1)-th on."""
    real_open, seen = open, [0]

    def fake_open(path, mode="r", *args, **kwargs):
        if Path(path).name.startswith(f".{name}.") and "w" in mode:
            seen[0] += 1
            if seen[0] > after:
                if error == errno.ENOSPC:
                    return io.BufferedWriter(DiskFull(room))
                raise OSError(error, os.strerror(error), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", fake_open, raising=False)


@fault
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    fail_writes(monkeypatch, "last.pt", errno.ENOSPC, after=1)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert f"cannot write {tmp_path / 'last.pt'}: no space left on device (needs " in line
    assert " free)" in line and "last.pt is unchanged" in line
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 4
    assert sorted(p.name for p in tmp_path.glob("*.pt*")) == ["best.pt", "last.pt"]


@fault
def test_read_only_disk_for_config_json(tmp_path, monkeypatch, capsys):
    fail_writes(monkeypatch, "config.json", errno.EROFS)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert "config.json: read-only file system" in line and "use a writable disk" in line
    assert not list(tmp_path.glob("*.pt"))


@fault
def test_disk_full_for_summary_json_after_training(tmp_path, monkeypatch, capsys):
    fail_writes(monkeypatch, "summary.json", errno.ENOSPC, room=10)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert "summary.json: no space left on device" in line
    assert not (tmp_path / "summary.json").exists()
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 4


@fault
@pytest.mark.parametrize("after", [0, 3])  # at start-up, or in the writer thread mid-run
def test_tensorboard_write_error(after, tmp_path, monkeypatch, capsys):
    from tensorboard.summary.writer.record_writer import RecordWriter

    real, calls = RecordWriter.write, [0]

    def full(self, data):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(RecordWriter, "write", full)
    thread_reports = []  # what Python would print as "Exception in thread ...: Traceback"
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_reports.append(args.exc_type))
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert f"TensorBoard logs in {tmp_path}: no space left on device" in line
    assert calls[0] > after and thread_reports == []


@fault
def test_too_little_space_for_a_checkpoint_is_found_at_start_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=500))
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    line = assert_one_line_failure(code, out, err)
    assert "has 500 bytes free but a checkpoint needs about" in line
    assert not list(tmp_path.glob("*.pt"))


@fault
def test_a_schedule_value_error_is_one_line(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise ValueError("gamma must be a number > 0; got -1")

    monkeypatch.setattr(train, "build_scheduler", refuse)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    assert code == 2
    line = assert_one_line_failure(code, out, err)
    assert "onecycle schedule does not fit this run of 4 optimizer steps: gamma" in line


# ---------------------------------------------------------------- the same, as a user runs them

def test_real_command_lines(tmp_path, images):
    """Two of the faults above as a user meets them: the issue's lr 100, and a broken PNG read by a worker."""
    diverging = run_script("train.py", "--lr", "100", "--epochs", "3", "--width", "8",
                           "--out-dir", str(tmp_path / "a"))
    root = tmp_path / "images"
    shutil.copytree(images, root)
    (root / "train" / "dark" / "bad.png").write_bytes(b"not a png")
    unreadable = run_script("train.py", "--dataset", "imagefolder", "--data-dir", str(root),
                            "--num-workers", "1", "--batch-size", "4", "--width", "4", "--epochs", "2",
                            "--image-size", "8", "--out-dir", str(tmp_path / "b"))
    for result in (diverging, unreadable):
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.stdout + result.stderr
    assert "diverged at step 10" in diverging.stderr and not list((tmp_path / "a").glob("*.pt"))
    assert "bad.png (class folder 'dark')" in unreadable.stderr


# ---------------------------------------------------------------- short runs train with every schedule

SCHEDULE_FLAGS = {
    "constant": [],
    "warmup": ["--warmup-epochs", "0.5"],
    "step": ["--step-size", "0.25"],
    "cosine": ["--warmup-epochs", "0.3"],
    "onecycle": [],
}


@pytest.mark.parametrize("schedule", SCHEDULE_FLAGS)
@pytest.mark.parametrize("total", range(1, 13))
def test_every_schedule_trains_from_one_to_twelve_steps(schedule, total):
    variants = [SCHEDULE_FLAGS[schedule]]
    if schedule == "onecycle" and total > 1:  # pct_start x steps == 1: torch's OneCycleLR divides by 0
        variants.append(["--pct-start", str(1 / total)])
    for flags in variants:
        cfg = parse_config(["--schedule", schedule, "--epochs", "1", *flags])
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2, momentum=0.9)
        scheduler, steps = train.make_scheduler(cfg, optimizer, total)
        assert steps == total
        lrs = []
        for _ in range(total):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert all(0 < lr <= 0.2 + 1e-12 for lr in lrs), (flags, lrs)
        if schedule == "onecycle" and float(cfg.pct_start * total) == 1:
            assert lrs[0] == pytest.approx(0.2 / cfg.div_factor)  # the one warm step, then down
            assert lrs[1:] == sorted(lrs[1:], reverse=True)


@pytest.mark.parametrize("schedule", SCHEDULE_FLAGS)
def test_a_one_step_run_trains(schedule, tmp_path):
    summary = train.train(parse_config([*TINY, "--synthetic-size", "16", "--schedule", schedule,
                                        *SCHEDULE_FLAGS[schedule], "--out-dir", str(tmp_path)]))
    assert summary["steps"] == 1 and math.isfinite(summary["val_loss"])


def test_the_four_step_onecycle_run_from_the_issue(tmp_path):
    """512 images in batches of 128 for one epoch: 4 steps, pct_start 0.25 x 4 == 1."""
    summary = train.train(parse_config([*TINY, "--synthetic-size", "256", "--batch-size", "64",
                                        "--out-dir", str(tmp_path)]))
    assert summary["steps"] == 4 and math.isfinite(summary["val_loss"])


# ---------------------------------------------------------------- flags as people type them

BOOLEANS = [name for name, value in Config().to_dict().items() if isinstance(value, bool)]


@pytest.mark.parametrize("name", BOOLEANS)
def test_every_boolean_takes_the_values_people_type(name):
    flag = "--" + name.replace("_", "-")
    for text, value in [("false", False), ("true", True), ("0", False), ("1", True), ("no", False),
                        ("yes", True), ("off", False), ("ON", True)]:
        assert getattr(parse_config([flag, text]), name) is value
        assert getattr(parse_config([f"{flag}={text}", "--epochs", "2"]), name) is value
    assert getattr(parse_config([flag, "--epochs", "2"]), name) is True
    assert getattr(parse_config([f"--no-{flag[2:]}"]), name) is False
    assert getattr(parse_config([f"--no-{flag[2:]}", flag]), name) is True


def test_resume_flag_keeps_its_forms():
    assert parse_config(["--resume", "--no-augment"]).resume == "last"
    assert parse_config(["--resume", "auto"]).resume == "auto"
    assert parse_config(["--resume", "runs/a/last.pt"]).resume == "runs/a/last.pt"


@pytest.mark.parametrize("dataset, argv, pad, flip", [
    ("imagefolder", [], 1, True),
    ("imagefolder", ["--no-flip"], 1, False),
    ("imagefolder", ["--flip", "false"], 1, False),
    ("imagefolder", ["--no-augment"], 0, False),
    ("digits", [], 1, False),
    ("digits", ["--flip"], 1, False),  # flipping digits changes their meaning: never
])
def test_crop_and_flip_are_chosen_apart(dataset, argv, pad, flip, images):
    cfg = parse_config(["--dataset", dataset, "--data-dir", str(images), "--image-size", "8",
                        "--batch-size", "4", *argv])
    batches, _, _, _ = build_loaders(cfg, torch.device("cpu"))
    assert (batches.image.pad, batches.image.flip) == (pad, flip)


def test_the_divergence_guard_reads_the_device_only_at_log_points(tmp_path, monkeypatch):
    """Host reads of tensors in a whole run do not grow with its number of steps."""
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            reads.append(1)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = {}
    for batch_size in (128, 64):  # digits: 10 and 20 optimizer steps
        reads.clear()
        summary = train.train(parse_config(["--epochs", "1", "--batch-size", str(batch_size), "--width",
                                            "4", "--log-every", "1000", "--device", "cpu",
                                            "--out-dir", str(tmp_path / str(batch_size))]))
        counts[summary["steps"]] = len(reads)
    assert list(counts) == [10, 20] and counts[10] == counts[20], counts


@fault
def test_free_space_is_sized_for_a_save_at_its_peak(tmp_path, monkeypatch, capsys):
    """Issue 54, 17: last.pt, best.pt and the temporary file written beside them (with --ema, its average
    in each): room for one last.pt alone is refused at start-up, before any file."""
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--ema", "0.9", "--out-dir", tmp_path / "sized")
    assert code == 0, err
    one = (tmp_path / "sized" / "last.pt").stat().st_size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=int(1.5 * one)))
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--ema", "0.9", "--out-dir", tmp_path / "tight")
    line = assert_one_line_failure(code, out, err)
    assert "and a save up to" in line and not list((tmp_path / "tight").glob("*.pt"))
