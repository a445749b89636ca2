"""TensorBoard: the pictures people look at, and one set of curves per run, also after kill -9."""

import io
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, build_loaders, read_scalars
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import task
import train
from configs import parse_config
from machinery import checkpoints, logs
from machinery.contract import IGNORE_INDEX
from models import build_model


def events(log_dir, purge: bool = True) -> EventAccumulator:
    """Every event of one run; purge=False also keeps what TensorBoard drops on a restart."""
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0},
                           purge_orphaned_data=purge)
    acc.Reload()
    return acc


def picture(event) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(event.encoded_image_string))))


def test_a_default_run_shows_its_inputs_its_confusion_and_its_worst_mistakes(tmp_path):
    cfg = parse_config(["--epochs", "2", "--device", "cpu", "--out-dir", str(tmp_path)])
    summary = train.train(cfg)
    acc = events(tmp_path)
    images = {tag: acc.Images(tag) for tag in acc.Tags()["images"]}
    epoch_ends = [step for step, _ in read_scalars(tmp_path)["val/acc"]]
    assert epoch_ends == [10, 20]
    assert [e.step for e in images["inputs"]] == [0]
    assert [e.step for e in images["val/confusion"]] == epoch_ends
    assert [e.step for e in images["val/most_confidently_wrong"]] == epoch_ends

    # The grid's first tile is the first training image exactly as the model received it: cropped
    # on the device, back in pixels, enlarged 8x from 8 px (nearest), gray as RGB.
    train_batches, val_batches, _, info = build_loaders(cfg, torch.device("cpu"))
    inputs, _ = next(iter(train_batches.epoch(0)))
    first = (train_batches.denormalize(inputs[:1]) * 255).round().to(torch.uint8)
    expected = first[0, 0].repeat_interleave(8, 0).repeat_interleave(8, 1)
    grid = picture(images["inputs"][0])
    assert grid.shape[0] > 4 * 64 and grid.shape[1] > 8 * 64  # 32 tiles of 64 px
    assert torch.equal(grid[4:68, 4:68, 0], expected) and torch.equal(grid[4:68, 4:68, 2], expected)

    # summary.json's per-class accuracy is what the saved model gets on each class.
    model = build_model(cfg, info.input_shape[0], len(info.names))
    model.load_state_dict(checkpoints.load_checkpoint(tmp_path / "last.pt")["model"])
    model.eval()
    right, seen = torch.zeros(10), torch.zeros(10)
    with torch.no_grad():
        for x, y in val_batches:
            right += F.one_hot(y[model(x).argmax(1) == y], 10).sum(0)
            seen += F.one_hot(y, 10).sum(0)
    assert list(summary["per_class_acc"]) == [str(d) for d in range(10)]
    assert list(summary["per_class_acc"].values()) == pytest.approx((right / seen).tolist())
    last = picture(images["val/confusion"][-1])
    assert torch.equal(torch.from_numpy(np.array(Image.open(tmp_path / "confusion.png"))), last)

    # HPARAMS: the run's own session, its metrics the val curves; no one-point hparam/* charts.
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    assert not [tag for tag in acc.Tags()["scalars"] if tag.startswith("hparam")]
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_tally_counts_on_the_device_and_keeps_the_most_confident_mistakes():
    info = SimpleNamespace(names=["a", "b", "c"], class_counts=None)  # what a Tally reads of data.DataInfo
    tally = task.Tally(parse_config([]), info, torch.device("cpu"), keep=2)
    logits = torch.tensor([[5.0, 0, 0], [0, 4, 0], [0, 0, 9], [1, 0, 0], [0, 0, 3]])
    targets = torch.tensor([0, 0, 1, 2, 2])
    images = torch.arange(5.0).view(5, 1, 1, 1)
    tally.add(logits[:3], targets[:3], images[:3])  # two batches: the mistakes are 1, 2 and 3
    tally.add(logits[3:], targets[3:], images[3:])
    result = tally.result()
    assert result.details["confusion"] == [[1, 1, 0], [0, 0, 1], [1, 0, 1]]
    assert result.metrics["acc"] == 2 / 5
    assert result.details["per_class_acc"] == {"a": 0.5, "b": 0.0, "c": 0.5}
    assert result.metrics["loss"] == pytest.approx(F.cross_entropy(logits, targets).item())
    confidence, inputs, truth, predicted = result.worst
    assert inputs.flatten().tolist() == [2.0, 1.0]  # p = 0.9998 and 0.96; image 3's 0.58 is not kept
    assert truth.tolist() == [1, 0] and predicted.tolist() == [2, 1]


def test_input_picture_of_per_pixel_targets_names_the_classes_each_mask_holds(monkeypatch):
    """The default task's picture of the first training batch, on masks: each image captioned with the
    classes its mask holds (a crop's padding is none of them), where it raised a TypeError."""
    masks = torch.zeros(3, 4, 4, dtype=torch.int64)
    masks[1, :2] = 1
    masks[2], masks[2, 0, 0] = IGNORE_INDEX, 1
    drawn = []
    monkeypatch.setattr(task, "image_grid", lambda pixels, captions: drawn.append((pixels.shape, captions)))
    task.input_picture(torch.rand(3, 1, 4, 4), masks, ["sky", "road"], lambda inputs: inputs)
    assert drawn == [((3, 1, 4, 4), ["sky", "sky, road", "road"])]


def test_tally_counts_pixels_past_float32s_whole_numbers():
    """Per-pixel targets: 17 batches of 2^20 pixels of class a, all right, make 17 x 2^20 > 2^24 in one
    cell of the confusion matrix, where a float32 count stops at 2^24."""
    info = SimpleNamespace(names=["a", "b"], class_counts=None)
    tally = task.Tally(parse_config([]), info, torch.device("cpu"))
    logits = torch.tensor([4.0, 0.0]).view(1, 2, 1, 1).expand(1, 2, 1024, 1024)
    targets = torch.zeros(1, 1024, 1024, dtype=torch.int64)
    for _ in range(17):
        tally.add(logits, targets, targets)
    result = tally.result()
    assert result.details["confusion"] == [[17 * 2**20, 0], [0, 0]] and result.metrics["acc"] == 1.0
    assert result.metrics["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-4)


RUN = ["--dataset", "synthetic", "--synthetic-size", "128", "--image-size", "8", "--width", "4",
       "--batch-size", "16", "--epochs", "2", "--device", "cpu", "--num-workers", "0",
       "--log-every", "1", "--save-every", "4"]  # 8 steps an epoch; last.pt at steps 4, 8, 12, 16
STEPS = list(range(1, 17))

# train.py as a machine that dies at step 7, after its TensorBoard writer flushed steps 5 and 6
# (as it does every two minutes) and long after last.pt was saved at step 4.
CRASH = """
import os, signal, sys
sys.path.insert(0, "tests")
from forks import classification  # the tests' task, whatever task.py holds (conftest.py)
sys.modules["task"] = classification
from torch.utils.tensorboard import SummaryWriter
import train
writers, real_init, real_step = [], SummaryWriter.__init__, train.optimizer_step
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    writers.append(self)
def step(*args, **kwargs):
    step.count += 1
    if step.count == 7:
        for writer in writers:
            writer.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(*args, **kwargs)
step.count = 0
SummaryWriter.__init__, train.optimizer_step = init, step
sys.argv = ["train.py", *sys.argv[1:]]
train.main()
"""


def test_two_fresh_runs_and_a_kill_9_then_resume_log_every_step_once(tmp_path):
    out = tmp_path / "run"
    sweep = out / "lr_find" / "events.out.tfevents.1.host"  # lr_find.py's logs stay where they are
    sweep.parent.mkdir(parents=True)
    sweep.write_bytes(b"")
    train.train(parse_config([*RUN, "--out-dir", str(out)]))
    crashed = subprocess.run([sys.executable, "-c", CRASH, *RUN, "--out-dir", str(out)], cwd=ROOT,
                             capture_output=True, text=True, timeout=240)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert checkpoints.load_checkpoint(out / "last.pt")["step"] == 4
    logged = [e.step for e in events(out).Scalars("train/loss")]
    assert logged == [1, 2, 3, 4, 5, 6], "the crash should leave steps after the checkpoint on disk"
    started = int(next(out.glob("events.out.tfevents.*")).name.split(".")[3])
    while time.time() < started + 1:  # event files load in name order, which starts with the second
        time.sleep(0.05)
    summary = train.train(parse_config([*RUN, "--out-dir", str(out), "--resume"]))
    assert summary["steps"] == 16

    earlier = [p for p in out.iterdir() if p.is_dir() and p.name != "lr_find"]
    assert len(earlier) == 1 and re.fullmatch(r"\d{8}-\d{6}", earlier[0].name), earlier
    for run in (earlier[0], out):  # the first run, then the crashed and resumed one
        acc = events(run)
        assert [e.step for e in acc.Scalars("train/loss")] == STEPS, run
        assert [e.step for e in acc.Scalars("train/lr")] == STEPS, run
        assert [e.step for e in acc.Scalars("val/acc")] == [8, 16], run
        assert [e.step for e in acc.Images("val/confusion")] == [8, 16], run
        assert [e.step for e in acc.Images("inputs")] == [0], run
    raw = [e.step for e in events(out, purge=False).Scalars("train/loss")]
    assert sorted(raw) == sorted([*STEPS, 5, 6]), "TensorBoard's purge is what drops the first 5 and 6"
    assert sweep.is_file()


def test_scalars_reach_the_writer_at_log_points_only_several_at_a_time(tmp_path, monkeypatch):
    """A step between log points logs nothing: SummaryWriter.add_scalar runs only inside write(), at log
    points (each call hands a point to TensorBoard's writer thread, about 45 us of CPU: host work a step
    need not do), the loss and the step's rate together; issue 48 took train/lr out of every step."""
    from torch.utils.tensorboard import SummaryWriter

    real_add, real_write, writes, outside = SummaryWriter.add_scalar, logs.Logs.write, [], []
    inside = [False]

    def add_scalar(self, *args, **kwargs):
        if not inside[0]:
            outside.append(args)
        return real_add(self, *args, **kwargs)

    def write(self, *points):
        inside[0], kept = True, len(points)
        try:
            real_write(self, *points)
        finally:
            inside[0] = False
        writes.append(kept)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    monkeypatch.setattr(logs.Logs, "write", write)
    train.train(parse_config([*RUN, "--log-every", "4", "--out-dir", str(tmp_path)]))
    assert outside == []
    assert max(writes) > 1 and sum(writes) == 4 + 4 + 2 * 2 + 2  # train/lr, train/loss, val/*, test/*
    acc = events(tmp_path)
    assert [e.step for e in acc.Scalars("train/lr")] == [4, 8, 12, 16]
    assert [e.step for e in acc.Scalars("val/acc")] == [8, 16]
    assert [e.step for e in acc.Images("val/confusion")] == [8, 16]
