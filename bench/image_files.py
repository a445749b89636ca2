"""Image files, against the loop a torchvision user writes:

    python -m bench.image_files make DIR [--count 2000]   # a folder of 96 px JPEGs, 10 classes
    python -m bench.image_files torchvision DIR           # the user's loop on it
    python -m bench.image_files compare DIR [--runs 5]    # both as whole processes, in pairs

The user's loop is ImageFolder + transforms.v2 + a DataLoader with 2 workers, which decodes every file
every epoch, and the template's model at the template's settings (resnet_small, SGD with onecycle, batch
128, an evaluation each epoch), here 32 px, width 2, 4 epochs. `compare` times it and `python train.py
--dataset imagefolder` at the same settings as whole processes, start-up included, the template's decode
pass counted (--image-cache off: decoded afresh every run), then the template again reading its cache,
and prints the ratios' medians. bench.speed's image-file rows come from measure()."""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"size": 32, "width": 2, "epochs": 4, "batch_size": 128, "lr": 0.2}
TEMPLATE = ["--dataset", "imagefolder", "--image-size", "32", "--width", "2", "--epochs", "4"]


def make(root: Path, count: int = 2000, classes: int = 10, side: int = 96) -> Path:
    """root/{train,val}/<class>/<k>.jpg: `count` training JPEGs and a tenth as many val ones, smooth random
    patterns (JPEG's own kind of picture), each class a tint of its own so that a model can learn."""
    rng = np.random.default_rng(0)
    from PIL import Image

    for split, n in (("train", count), ("val", max(count // 10, classes))):
        for k in range(n):
            label = k % classes
            folder = root / split / f"c{label}"
            folder.mkdir(parents=True, exist_ok=True)
            coarse = rng.random((12, 12, 3)) * 160 + np.array([label * 9, 90 - label * 9, 40])
            image = Image.fromarray(coarse.clip(0, 255).astype(np.uint8)).resize((side, side), Image.BILINEAR)
            image.save(folder / f"{k}.jpg", quality=90)
    return root


def torchvision_loop(root: Path, device: str = "cpu", workers: int = 2) -> float:
    """The loop a torchvision user writes, at the template's settings; returns the last val accuracy."""
    from torchvision import datasets
    from torchvision.transforms import v2

    import models

    size, device = SETTINGS["size"], torch.device(device)
    norm = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
    read = [v2.Resize(size), v2.CenterCrop(size)]
    train_set = datasets.ImageFolder(str(root / "train"), v2.Compose(
        [*read, v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip(), *norm]))
    val_set = datasets.ImageFolder(str(root / "val"), v2.Compose([*read, *norm]))
    loader = torch.utils.data.DataLoader(train_set, SETTINGS["batch_size"], shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=workers > 0)
    val_loader = torch.utils.data.DataLoader(val_set, SETTINGS["batch_size"], num_workers=workers)
    model = models.ResNetSmall(3, len(train_set.classes), SETTINGS["width"]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=SETTINGS["lr"], momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, SETTINGS["lr"], epochs=SETTINGS["epochs"],
                                                    steps_per_epoch=len(loader), pct_start=0.25)
    for epoch in range(SETTINGS["epochs"]):
        model.train()
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in val_loader:
                correct += (model(images.to(device)).argmax(1).cpu() == labels).sum().item()
        print(f"epoch {epoch + 1}: val acc {correct / len(val_set):.2%}")
    return correct / len(val_set)


def compare(root: Path, runs: int, device: str) -> dict:
    """The user's loop and train.py as whole processes, in turn, `runs` times each; the template's first
    with its decode pass (--image-cache off), then reading its cache."""
    commands = {
        "torchvision": [sys.executable, "-m", "bench.image_files", "torchvision", str(root), "--device",
                        device],
        "decoding": [sys.executable, "train.py", *TEMPLATE, "--data-dir", str(root), "--device", device,
                     "--image-cache", "off"],
        "cached": [sys.executable, "train.py", *TEMPLATE, "--data-dir", str(root), "--device", device],
    }
    seconds = {name: [] for name in commands}
    with tempfile.TemporaryDirectory(prefix="bench-files-") as tmp:
        for r in range(runs + 1):  # the first round warms the disk cache and writes the image cache
            for name, command in commands.items():
                out = ["--out-dir", f"{tmp}/{name}{r}"] if name != "torchvision" else []
                start = time.perf_counter()
                subprocess.run([*command, *out], cwd=ROOT, check=True, capture_output=True)
                if r:
                    seconds[name].append(time.perf_counter() - start)
    ratio = {name: [t / u for t, u in zip(seconds[name], seconds["torchvision"], strict=True)]
             for name in ("decoding", "cached")}
    return {"seconds": {name: statistics.median(v) for name, v in seconds.items()},
            "decoding_vs_torchvision": statistics.median(ratio["decoding"]),
            "cached_vs_torchvision": statistics.median(ratio["cached"]),
            "runs": runs, "ratios": ratio}


def measure(device: torch.device, count: int, repeats: int) -> dict:
    """bench.speed's image-file rows: a folder of `count` JPEGs read at 32 px. The decode pass (a fresh
    cache) and a cache read (a later run's); then training batches served from the cache from epoch 2 on,
    against the same images given as tensors (the same device loader), and against the files read every
    epoch by a 2-worker DataLoader."""
    from configs import parse_config
    from data import image_folder
    from machinery.served import Batches
    from models import input_needs
    from train import build_loaders

    def loaders(*extra: str):
        cfg = parse_config([*TEMPLATE, "--data-dir", str(root), "--device", str(device), "--batch-size",
                            "64", *extra])
        with contextlib.redirect_stdout(io.StringIO()):
            splits, _ = build_loaders(cfg, image_folder(cfg), device, targets="classes",
                                      needs=input_needs(cfg.model, False))
        return splits.train

    with tempfile.TemporaryDirectory(prefix="bench-files-") as tmp:
        root = make(Path(tmp) / "images", count)
        start = time.perf_counter()
        loaders()
        decode_seconds = time.perf_counter() - start
        start = time.perf_counter()
        cached = loaders()
        cache_seconds = time.perf_counter() - start
        tensors = Batches(cached.source.clone(), cached.labels.clone(), cached.serving, train=True,
                          image=cached.image, spec=cached.spec)
        streamed = loaders("--loader", "dataloader", "--num-workers", "2")
        rates = {name: [] for name in ("cached", "tensors", "streamed")}
        for epoch in range(1, repeats + 1):
            for name, batches in (("cached", cached), ("tensors", tensors), ("streamed", streamed)):
                rates[name].append(served(batches, epoch, device))
        streamed.close()
    ratios = {f"vs_{other}": [c / o for c, o in zip(rates["cached"], rates[other], strict=True)]
              for other in ("tensors", "streamed")}
    return {"decode_seconds": decode_seconds, "cache_seconds": cache_seconds, "files": count,
            "ratios": ratios, "images_per_second": rates}


def served(batches, epoch: int, device: torch.device) -> float:
    """Images a second of one training epoch's batches, as the model gets them, its first batch not timed."""
    stream = batches.epoch(epoch)
    next(stream)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, images = time.perf_counter(), 0
    for inputs, _ in stream:
        images += len(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return images / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("make", "torchvision", "compare"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--count", type=int, default=2000, help="make: training images")
    parser.add_argument("--runs", type=int, default=5, help="compare: runs of each command")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.what == "make":
        make(args.folder, args.count)
    elif args.what == "torchvision":
        torchvision_loop(args.folder, args.device)
    else:
        result = compare(args.folder, args.runs, args.device)
        for name, seconds in result["seconds"].items():
            print(f"{name:<12} {seconds:6.2f} s (median of {args.runs})")
        print(f"train.py decoding / torchvision loop: {result['decoding_vs_torchvision']:.3f} "
              "(target <= 0.6)")
        print(f"train.py from its cache / torchvision loop: {result['cached_vs_torchvision']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
