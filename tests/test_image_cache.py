"""Image files at tensor speed (issue 48): decoded once, with the per-file read's own pixels, kept in a cache
keyed by the files (path, size, mtime, ctime, inode), the size, the channels and the reader; served by the
device loader as tensors are (the same epochs, crops, flips and exact resume); shared by train.py,
lr_find.py and evaluate.py; decoded once under torchrun; and where nothing can be kept or held, a fallback
said in one line that still trains."""

import csv
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, ROOT, build_loaders, run_evaluate, run_main
from PIL import Image

import lr_find
import train
from configs import parse_config
from machinery import checkpoints, files, image_cache, placement, workers
from machinery.image_files import READER_VERSION, ImageFiles, folder_splits
from machinery.stops import Interrupted

FLAGS = ["--dataset", "imagefolder", "--image-size", "8", "--width", "4", "--batch-size", "4", "--epochs",
         "1", "--device", "cpu", "--num-workers", "0", "--log-every", "1000"]


def image_folder(root: Path, per_class: int = 6) -> Path:
    """root/{train,val}/{a,b,c}/: JPEG and PNG files of several sizes, none 8 px (each is resized on its
    short side, then center-cropped), each class its own brightness."""
    g = torch.Generator().manual_seed(0)
    for split, count in (("train", per_class), ("val", 3)):
        for label, name in enumerate("abc"):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for k in range(count):
                pixels = 30 + 70 * label + torch.randint(0, 80, (10 + k, 12 + 2 * label, 3), generator=g)
                Image.fromarray(pixels.to(torch.uint8).numpy()).save(
                    root / split / name / f"{k}.{'jpg' if k % 2 else 'png'}")
    return root


@pytest.fixture
def images(tmp_path) -> Path:
    return image_folder(tmp_path / "images")


def split_files(root: Path, split: str = "train", size: int = 8, channels: int = 3) -> ImageFiles:
    splits, _, _ = folder_splits(root)
    return ImageFiles(splits[split], size, channels, root)


def reads(files: ImageFiles) -> torch.Tensor:
    return torch.stack([files.read(i) for i in range(len(files))])


# ---------------------------------------------------------------- the pixels and the batches


@pytest.mark.parametrize("channels", [3, 1])
def test_decoded_pixels_and_batches_equal_the_per_file_read(images, channels):
    """The cache holds each file's per-file read bit for bit, and the batches it serves equal the streamed
    ones: the same epoch order, crops and flips, training and evaluation."""
    done = image_cache.decoded(split_files(images, channels=channels), images / ".image-cache", "train")
    assert done.decoded == 18 and torch.equal(done.images, reads(split_files(images, channels=channels)))
    argv = [*FLAGS, "--data-dir", str(images), "--channels", str(channels)]
    decoded = build_loaders(parse_config(argv))
    streamed = build_loaders(parse_config([*argv, "--loader", "dataloader"]))
    assert decoded[3].loader == "device-resident tensors on cpu"
    assert streamed[3].loader == "DataLoader with 0 workers"
    for split in (0, 1):  # train (augmented), val
        for epoch in (0, 1):
            pairs = list(zip(decoded[split].epoch(epoch), streamed[split].epoch(epoch), strict=True))
            assert len(pairs) == len(decoded[split]) > 0
            for (x, y), (sx, sy) in pairs:
                assert torch.equal(x, sx) and torch.equal(y, sy)


# ---------------------------------------------------------------- the key


def test_a_changed_added_or_removed_file_is_decoded_again_and_only_it(images):
    place = images / ".image-cache"
    assert image_cache.decoded(split_files(images), place, "train").decoded == 18
    assert image_cache.decoded(split_files(images), place, "train").decoded == 0  # read from the cache
    changed = images / "train" / "b" / "2.png"
    Image.new("RGB", (9, 9), (250, 0, 0)).save(changed)
    os.utime(changed, ns=(1, 1))  # a modification time of its own, whatever the clock's resolution
    again = image_cache.decoded(split_files(images), place, "train")
    assert again.decoded == 1 and torch.equal(again.images, reads(split_files(images)))
    Image.new("RGB", (8, 8), (0, 250, 0)).save(images / "train" / "a" / "9.png")  # added
    added = image_cache.decoded(split_files(images), place, "train")
    assert added.decoded == 1 and len(added.images) == 19
    assert torch.equal(added.images, reads(split_files(images)))
    (images / "train" / "c" / "0.png").unlink()  # removed
    removed = image_cache.decoded(split_files(images), place, "train")
    assert removed.decoded == 0 and torch.equal(removed.images, reads(split_files(images)))
    assert image_cache.decoded(split_files(images, size=6), place, "train").decoded == 18  # another size
    assert image_cache.decoded(split_files(images, channels=1), place, "train").decoded == 18  # gray
    kept = sorted(p.name for p in place.iterdir())
    assert kept == ["train-6px-rgb.u8", "train-8px-l.u8", "train-8px-rgb.u8"]
    cut = place / "train-8px-rgb.u8"  # cut short (a copy that stopped): not a cache, decoded again
    cut.write_bytes(cut.read_bytes()[:5000])
    assert image_cache.decoded(split_files(images), place, "train").decoded == 18


def damage(cache: Path, how: str) -> None:
    """The cache file damaged as issue 54 found it: a byte of the header's length (dd, seek 14), a digest's
    hex digit made bad or made another, cut short, or another file in its place."""
    data = bytearray(cache.read_bytes())
    at = data.index(b'"digests": "') + len(b'"digests": "') + 5
    if how == "a byte of the length":
        data[14] = 1
    elif how in ("a bad hex digit in a digest", "another hex digit in a digest"):
        data[at] = ord("g" if how.startswith("a bad") else "0" if data[at] != ord("0") else "1")
    elif how == "cut short":
        del data[5000:]
    else:
        data[:] = b"\x89PNG another file entirely" * 300
    cache.write_bytes(data)


@pytest.mark.parametrize("how", ["a byte of the length", "a bad hex digit in a digest",
                                 "another hex digit in a digest", "cut short", "another file"])
def test_a_damaged_cache_file_is_no_cache_the_images_are_decoded_again_and_a_line_says_so(
        how, images, tmp_path, monkeypatch, capsys):
    """Issue 54, 1: a byte of the header changed ended every later run in 'out of memory', a bad hex digit in
    the digests in a 27-line traceback, another hex digit in a wrong digest said nowhere."""
    argv = [*FLAGS, "--data-dir", images]
    code, _, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "first")
    assert code == 0, err
    cache = images / ".image-cache" / "train-8px-rgb.u8"
    fresh = image_cache.decoded(split_files(images), cache.parent, "train")
    damage(cache, how)
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "second")
    assert code == 0 and err == "", err
    said = [line for line in out.splitlines() if line.startswith("image files decoded once")]
    assert len(said) == 1 and "train 18 of 18 decoded in" in said[0] and "val from the cache" in said[0], out
    assert "(the cache file train-8px-rgb.u8 " in said[0], said[0]
    assert ": decoded again), val from the cache; cache " in said[0], said[0]
    again = image_cache.decoded(split_files(images), cache.parent, "train")  # written anew, whole
    assert again.decoded == 0 and torch.equal(again.images, reads(split_files(images)))
    assert torch.equal(again.digests, fresh.digests)


@pytest.mark.parametrize("how", ["written in place", "renamed over"])
def test_a_file_replaced_with_its_old_size_and_modification_time_is_decoded_again(how, images):
    """Issue 54, 2: an archive with fixed times or `rsync -a` replaces a file with one of the same size and
    mtime; the key (path, size, mtime) trained on the old pixels. Its ctime and inode are in the key now."""
    place, target = images / ".image-cache", images / "train" / "a" / "x.bmp"
    Image.new("RGB", (9, 9), (200, 0, 0)).save(target)  # BMP: the same size for any pixels
    assert image_cache.decoded(split_files(images), place, "train").decoded == 19
    before = os.stat(target)
    time.sleep(0.05)  # past the file system's clock tick: the ctime a rewrite gets is another
    if how == "written in place":
        Image.new("RGB", (9, 9), (0, 0, 200)).save(target)
    else:
        Image.new("RGB", (9, 9), (0, 0, 200)).save(images / "new.bmp")
        os.replace(images / "new.bmp", target)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(target)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = image_cache.decoded(split_files(images), place, "train")
    assert again.decoded == 1 and torch.equal(again.images, reads(split_files(images)))


def test_a_cache_file_written_before_the_ctime_and_inode_keys_nothing(images):
    """A file whose entries lack fields the key has now (path, size and mtime only, as before issue 54)
    serves no image, even where those fields match: each file is decoded again."""
    place = images / ".image-cache"
    fresh = image_cache.decoded(split_files(images), place, "train")
    listed = [entry[:3] for entry in image_cache._listed(split_files(images))]  # an older template's entries
    stale = {"reader": READER_VERSION, "shape": list(fresh.images.shape), "files": listed}
    image_cache._kept(place / "train-8px-rgb.u8", stale, torch.zeros_like(fresh.images))
    again = image_cache.decoded(split_files(images), place, "train")
    assert again.decoded == 18 and torch.equal(again.images, fresh.images)


def test_each_image_has_the_digest_of_its_pixels_decoded_or_from_the_cache(images):
    """The digests evaluate.py counts a split's images by (issue 49, 5): of the pixels, so a renamed copy has
    its original's; the same read back from the cache file's header, where a file without them is hashed."""
    place = images / ".image-cache"
    fresh = image_cache.decoded(split_files(images), place, "train")
    cached = image_cache.decoded(split_files(images), place, "train")
    assert cached.decoded == 0 and torch.equal(cached.digests, fresh.digests)
    assert torch.equal(fresh.digests, image_cache.digests(reads(split_files(images))))
    assert len(set(fresh.digests.tolist())) == 18  # every image its own
    shutil.copy(images / "train" / "a" / "0.png", images / "val" / "b" / "copy.png")
    val = image_cache.decoded(split_files(images, "val"), place, "val")
    assert int(torch.isin(val.digests, fresh.digests).sum()) == 1
    old, _ = image_cache._opened(place / "train-8px-rgb.u8")  # as written before the digests
    image_cache._kept(place / "train-8px-rgb.u8", old.key, old.pixels)
    assert torch.equal(image_cache.decoded(split_files(images), place, "train").digests, fresh.digests)


def test_a_second_run_lr_find_and_evaluate_open_no_image_file(images, tmp_path, monkeypatch, capsys):
    argv = [*FLAGS, "--data-dir", images]
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "first")
    assert code == 0, err
    assert ("image files decoded once, held on cpu (" in out and "train 18 of 18 decoded in" in out
            and "val 9 of 9 decoded in" in out and f"; cache {images / '.image-cache'}\n" in out), out

    def opened(self, i):
        raise AssertionError(f"{self.items[i][0]} was read again")

    monkeypatch.setattr(ImageFiles, "read", opened)
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "second")
    assert code == 0 and "train from the cache, val from the cache;" in out, err
    lr_find.main([*map(str, argv), "--find-iters", "10", "--out-dir", str(tmp_path / "second")])
    assert (tmp_path / "second" / "lr_find.json").is_file()
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "first" / "best.pt",
                                  "--data-dir", images, "--device", "cpu")
    assert code == 0, err


def test_predict_on_the_val_folder_scores_exactly_the_best_val_accuracy(images, tmp_path, monkeypatch,
                                                                          capsys):
    code, out, err = run_main(monkeypatch, capsys, *FLAGS, "--epochs", "3", "--data-dir", images,
                              "--out-dir", tmp_path)
    assert code == 0, err
    best = json.loads((tmp_path / "summary.json").read_text())["best_val_acc"]
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", images / "val", "--checkpoint",
                                  tmp_path / "best.pt", "--device", "cpu", "--num-workers", "0")
    assert code == 0, err
    with open(tmp_path / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9
    assert sum(Path(row["file"]).parent.name == row["class"] for row in rows) / len(rows) == best


def test_sigterm_then_resume_ends_bit_for_bit_as_an_uninterrupted_run(images, tmp_path, monkeypatch, capsys,
                                                                      signals_end_the_run):
    """The straight run decodes, the stopped one reads the cache: decoding draws nothing from the RNGs that
    seed the model (a DataLoader's first batch drew from the global one, and the two runs differed)."""
    argv = [*FLAGS, "--epochs", "3", "--data-dir", images]
    code, _, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "straight")
    assert code == 0, err
    real, steps = train.optimizer_step, [0]

    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 5:  # mid-epoch: the second's first step
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", step)
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "stopped")
    assert code == 128 + signal.SIGTERM and "interrupted at step 5; saved" in out, (code, out, err)
    monkeypatch.setattr(train, "optimizer_step", real)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path / "stopped")
    assert code == 0, err
    straight, resumed = (checkpoints.load_checkpoint(tmp_path / run / "last.pt")
                         for run in ("straight", "stopped"))
    assert straight["step"] == resumed["step"] == 12
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    assert straight["optimizer"]["state"].keys() == resumed["optimizer"]["state"].keys()


# ---------------------------------------------------------------- what cannot be kept or held


@pytest.mark.parametrize("fault", ["read-only data folder", "full disk", "a file in the way", "off"])
def test_nothing_kept_still_trains_and_says_why_in_one_line(fault, images, tmp_path, monkeypatch, capsys):
    place, extra = images / ".image-cache", []
    if fault == "read-only data folder":  # as root, a chmod would not stop the write: the error is made
        real = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self.name == ".image-cache":
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    elif fault == "full disk":  # the cache's disk alone: the run's own files are written
        real_fsync = os.fsync

        def fsync(fd):
            if ".image-cache" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        monkeypatch.setattr(files.os, "fsync", fsync)
    elif fault == "a file in the way":
        (tmp_path / "file").write_text("x")
        place = tmp_path / "file" / "cache"
        extra = ["--image-cache", str(place)]
    else:
        extra = ["--image-cache", "off"]
    code, out, err = run_main(monkeypatch, capsys, *FLAGS, "--data-dir", images, *extra, "--out-dir",
                              tmp_path / "run")
    assert code == 0 and err == "", err
    said = [line for line in out.splitlines() if line.startswith("image files decoded once")]
    assert len(said) == 1 and "train 18 of 18 decoded in" in said[0], out
    reason = {"read-only data folder": "read-only file system", "full disk": "no space left on device",
              "a file in the way": "not a directory", "off": "--image-cache off"}[fault]
    assert said[0].endswith(": decoded in memory for this run" if fault != "off" else "(--image-cache off)")
    assert reason in said[0], said[0]
    assert not place.exists() or not any(place.iterdir())  # no cache, whole or partial


def test_images_too_many_to_hold_are_read_every_epoch_by_workers(images, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(placement, "available_memory", lambda: 2000)  # decoded, they take 5.4 KB
    code, out, err = run_main(monkeypatch, capsys, *FLAGS, "--data-dir", images, "--out-dir", tmp_path)
    assert code == 0, err
    assert "via DataLoader with 0 workers" in out and (
        "image files read every epoch by DataLoader workers (5.4 KB decoded would not fit in 50% of the "
        "2.0 KB of memory available)\n") in out, out
    assert not (images / ".image-cache").exists()


def test_the_memory_rule_and_the_workers(monkeypatch):
    cuda, cpu, mb = torch.device("cuda"), torch.device("cpu"), 10**6
    monkeypatch.setattr(placement, "available_memory", lambda: 1000 * mb)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (400 * mb, 800 * mb))
    assert placement.place("auto", cuda, needed=100 * mb, decoded=True).where == "device"
    host = placement.place("auto", cuda, needed=300 * mb, decoded=True)
    assert host == placement.Placement("host", "300.0 MB exceed 25% of the GPU's 400.0 MB free: batches "
                                               "are gathered in host memory")
    assert placement.place("auto", cuda, needed=600 * mb, decoded=True).where == "dataloader"
    assert placement.place("auto", cuda, needed=600 * mb, decoded=False).where == "host"  # tensors: held
    assert placement.place("auto", cpu, needed=400 * mb, decoded=True).where == "device"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on the machine: each its half
    assert placement.place("auto", cpu, needed=400 * mb, decoded=True).where == "dataloader"
    assert placement.place("host", cpu, needed=1, decoded=True).where == "device"  # no GPU: host is it
    assert placement.place("dataloader", cuda, needed=1, decoded=True).where == "dataloader"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert [workers.count("auto", cpu), workers.count("auto", cuda)] == [2, 8]
    assert workers.count(3, cuda) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert workers.count("auto", cuda) == 4


# ---------------------------------------------------------------- faults while decoding, and torchrun


def test_an_unreadable_file_or_a_signal_while_decoding_is_one_line_and_leaves_nothing(
        images, tmp_path, monkeypatch, capsys, signals_end_the_run):
    (images / "train" / "b" / "3.jpg").write_bytes(b"not a jpeg")
    code, out, err = run_main(monkeypatch, capsys, *FLAGS, "--data-dir", images, "--out-dir", tmp_path / "a")
    assert code == 2 and err == (f"error: cannot read image {images / 'train' / 'b' / '3.jpg'} (class folder "
                                 "'b'): not an image format PIL can read\n"), err
    Image.new("RGB", (8, 8)).save(images / "train" / "b" / "3.jpg")
    real, count = ImageFiles.read, [0]

    def read(self, i):
        count[0] += 1
        if count[0] == 5:
            raise Interrupted(signal.SIGTERM)  # as the handler raises it outside the loop
        return real(self, i)

    monkeypatch.setattr(ImageFiles, "read", read)
    code, out, err = run_main(monkeypatch, capsys, *FLAGS, "--data-dir", images, "--out-dir", tmp_path / "b")
    assert code == 128 + signal.SIGTERM and err.startswith("error: interrupted by SIGTERM"), err
    assert err.count("\n") == 1
    for run in ("a", "b"):
        assert not (tmp_path / run).exists() or not list((tmp_path / run).glob("*.pt"))
    assert not list((images / ".image-cache").glob("*"))  # no cache file, whole or partial


COUNTED = """
import os, runpy, sys
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from machinery.image_files import ImageFiles
real = ImageFiles.read

def read(self, i):  # each file read, by any process or worker, one line
    with open({marker!r}, "a") as f:
        f.write(str(self.items[i][0]) + "\\n")
    return real(self, i)

ImageFiles.read = read
sys.argv = [{launch!r}, *sys.argv[1:]]
runpy.run_path({launch!r}, run_name="__main__")
"""


def test_torchrun_on_a_fresh_folder_decodes_each_file_once_in_all(images, tmp_path):
    counted = tmp_path / "counted.py"
    counted.write_text(COUNTED.format(root=str(ROOT), marker=str(tmp_path / "reads"), launch=LAUNCH[1]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(counted), "train.py", *FLAGS, "--data-dir", str(images), "--out-dir",
               str(tmp_path / "run")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    read = (tmp_path / "reads").read_text().splitlines()
    assert len(read) == len(set(read)) == 27, read  # 18 train and 9 val files, each once
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


FORK_SIGNALLED = """
import os, signal, sys
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
sent = []

def signal_in_the_fork():  # a Ctrl-C that lands in the parent's at-fork callbacks, once
    if not sent:
        sent.append(os.kill(os.getpid(), signal.SIGINT))

os.register_at_fork(after_in_parent=signal_in_the_fork)
sys.argv = [{launch!r}, *sys.argv[1:]]
import runpy
runpy.run_path({launch!r}, run_name="__main__")
"""


def test_a_signal_while_workers_start_is_one_line(images, tmp_path):
    """Workers fork to decode: a signal inside a fork's callbacks was printed as 'Exception ignored in
    _releaseLock' with its traceback; held while they start, it stops the run in one line."""
    for k in range(260):  # 278 training files, over WORKERS_FROM: workers decode them
        Image.new("RGB", (9, 9), (k, 0, 0)).save(images / "train" / "a" / f"extra{k}.png")
    script = tmp_path / "signalled.py"
    script.write_text(FORK_SIGNALLED.format(root=str(ROOT), launch=LAUNCH[1]))
    done = subprocess.run([sys.executable, str(script), "train.py", *FLAGS, "--data-dir", str(images),
                           "--out-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 128 + signal.SIGINT, done.stderr[-2000:]
    assert done.stderr.startswith("error: interrupted by SIGINT"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_the_read_is_torchvisions_resize_center_crop_and_pil_to_tensor_pixel_for_pixel(tmp_path):
    """machinery/image_files.fitted does what torchvision's transforms do on a PIL image, without their 2 s
    import: every short side, long side, orientation, a size up and a size down, RGB and grayscale."""
    from torchvision import transforms as T

    from machinery.image_files import fitted

    g = torch.Generator().manual_seed(3)
    for width, height in [(8, 8), (9, 8), (8, 9), (13, 7), (7, 13), (96, 96), (100, 61), (5, 3), (31, 32)]:
        pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
        for image in (Image.fromarray(pixels), Image.fromarray(pixels).convert("L")):
            for size in (4, 8, 11, 32):
                expected = T.Compose([T.Resize(size), T.CenterCrop(size), T.PILToTensor()])(image)
                assert torch.equal(fitted(image, size), expected), (width, height, image.mode, size)
