"""Speed of the template: `python -m bench.speed [--device cpu|cuda] [--json FILE] [--quick] [--repeats N]`.

Five questions, one run: does train.py's loop cost anything over a bare loop of the same model
and data (loop_vs_bare), how much faster is the device-resident loader than a per-sample
torchvision DataLoader (loader_speedup), what does lr_find add per iteration (lr_find_overhead),
the same two in the regime where host work shows (host_loop_vs_bare, host_lr_find_overhead: see
measure_host_bound), and how many images per second do the default and CIFAR-10 setups train at
(the CIFAR-10 preset also under torch.compile, by default on CUDA only). Ratios come from
interleaved repeats (so drift hits both sides alike) and are reported as median and min/max.

The GPU self-check, a few minutes on one GPU:
    python -m bench.speed --device cuda && python -m pytest tests/test_cuda.py

On a CPU that other busy processes share, multi-threaded ops stall (OpenMP threads spin-wait for a
preempted sibling) and run many times slower, so on CPU the ratios use one thread by default; the
throughput figures use torch's thread count, and `OMP_WAIT_POLICY=PASSIVE` keeps them usable there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import io
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from itertools import pairwise
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import task
from bench import image_files
from configs import Config, UserError, parse_config
from machinery import processes
from machinery.batches import DeviceBatches, ImageSteps, Serving
from machinery.stops import exit_with_error
from models import build_optimizer

ROOT = Path(__file__).resolve().parents[1]  # the repository
TARGETS = {"loop_vs_bare": ">= 0.97", "loader_speedup": ">= 10", "lr_find_overhead": "<= 1.05",
           "host_loop_vs_bare": ">= 0.97", "host_lr_find_overhead": "<= 1.05",
           "image_files_vs_tensors": ">= 0.95"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if visible)")
    parser.add_argument("--json", default="runs/bench.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for tests (~15 s on CPU)")
    parser.add_argument("--repeats", type=int, default=0, help="interleaved repeats (default 5, quick 2)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="batch for the cifar10 model (default 512; 32 with --quick on CPU)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the throughput figures (default: torch's own)")
    parser.add_argument("--ratio-threads", type=int, default=0,
                        help="torch threads for loop_vs_bare and lr_find_overhead (default: 1 on CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the cifar10 model under torch.compile (default: on CUDA only)")
    args = parser.parse_args(argv)
    if min(args.repeats, args.batch_size, args.threads, args.ratio_threads) < 0:
        parser.error("--repeats, --batch-size, --threads and --ratio-threads must be >= 0")
    args.repeats = args.repeats or (2 if args.quick else 5)
    return args


def spread(values: list[float]) -> dict:
    """Median plus min/max: the median resists one disturbed repeat, min/max show how noisy it was."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": list(values)}


@contextlib.contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loop_config(device: str, epochs: int, out_dir: str) -> Config:
    """The default run (resnet_small on digits, batch 128), shortened to `epochs`."""
    return parse_config(["--device", device, "--epochs", str(epochs), "--out-dir", out_dir])


def cifar_config(device: str, batch_size: int, images: int) -> Config:
    """configs/cifar10.toml on synthetic CIFAR-shaped data, so nothing needs downloading."""
    return parse_config(["--config", str(ROOT / "configs" / "cifar10.toml"), "--device", device,
                         "--dataset", "synthetic", "--image-size", "32", "--channels", "3",
                         "--synthetic-size", str(images), "--batch-size", str(batch_size)])


def setup(cfg: Config, device: torch.device, lr: float | None = None):
    """Loaders, model, optimizer and AMP built exactly as train.py builds them, and the task's loss as a
    batch's mean (its sum over its normalizer), as a bare loop would write it."""
    import train

    torch.manual_seed(cfg.seed)
    splits, info, model = train.setup(cfg, task, device)
    train_batches = splits.train
    optimizer = build_optimizer(model, cfg, float(cfg.lr) if lr is None else lr)
    amp_dtype, scaler = processes.amp_setup(device, cfg.amp)
    model.train()

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return task.loss(outputs, targets, cfg, info) / task.normalizer(targets, cfg, info)

    return train_batches, model, optimizer, amp_dtype, scaler, loss


def bare_steps(model, optimizer, amp_dtype, scaler, device, batches: Iterable, loss_fn) -> int:
    """Forward, the task's loss, backward, optimizer step and nothing else; returns the number of images."""
    images = 0
    for inputs, targets in batches:
        with processes.autocast(device, amp_dtype):
            loss = loss_fn(model(inputs), targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        images += len(targets)
    return images


def bare_rate(cfg: Config, device: torch.device) -> float:
    """Images/s of the bare loop, timed as train.py times itself: per epoch, mean over epochs 2+."""
    train_batches, model, optimizer, amp_dtype, scaler, loss = setup(cfg, device)
    rates = []
    for epoch in range(cfg.epochs):
        start = time.perf_counter()
        images = bare_steps(model, optimizer, amp_dtype, scaler, device, train_batches.epoch(epoch), loss)
        sync(device)
        rates.append(images / (time.perf_counter() - start))
    steady = rates[1:] or rates
    return sum(steady) / len(steady)


def train_rate(cfg: Config) -> float:
    """train.train's own steady-state images/s, with its printing silenced."""
    import train

    with contextlib.redirect_stdout(io.StringIO()):
        summary = train.train(cfg)
    return float(summary["examples_per_second"])


def measure_default_model(device_name: str, device: torch.device, epochs: int, repeats: int) -> dict:
    """The bare loop's images/s on the default setup at the throughput thread count."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        return spread([bare_rate(loop_config(device_name, epochs, tmp), device) for _ in range(repeats)])


def lr_find_seconds(cfg: Config, device: torch.device, num_iter: int) -> tuple[float, int]:
    """Wall time of one whole lr_find call (snapshot and restore included) and its iterations.

    The sweep stays in a trainable range and `diverge` is huge, so it runs all num_iter steps.
    """
    from lr_find import lr_find

    train_batches, model, optimizer, amp_dtype, scaler, loss = setup(cfg, device, lr=1e-4)

    sync(device)
    start = time.perf_counter()
    result = lr_find(model, optimizer, loss, train_batches, start_lr=1e-4,
                     end_lr=0.1, num_iter=num_iter, smooth=0.98, diverge=1e9, autocast_dtype=amp_dtype,
                     scaler=scaler, device=device)
    sync(device)
    return time.perf_counter() - start, len(result.lrs)


def measure_loop(device_name: str, device: torch.device, epochs: int, repeats: int,
                 lr_find_iters: int) -> dict:
    """Bare loop, then (train.py, lr_find, bare loop) per repeat, on the default setup.

    Each train.py and lr_find run is compared with the mean of the bare runs just before and just
    after it, which cancels drift that is linear over the repeat.
    """
    bare, trained, graphed, find_seconds, find_iters = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        warm = loop_config(device_name, min(2, epochs - 1) or 1, tmp)  # first use: imports, kernel caches
        bare_rate(warm, device)
        train_rate(warm)
        cfg = loop_config(device_name, epochs, tmp)
        bare.append(bare_rate(cfg, device))
        for r in range(repeats):
            cfg.out_dir = str(Path(tmp) / f"run{r}")
            trained.append(train_rate(cfg))
            if device.type == "cuda":  # train.py --compile reduce-overhead (CUDA graphs), the same setup
                cfg.out_dir, cfg.compile = str(Path(tmp) / f"graphed{r}"), "reduce-overhead"
                torch.compiler.reset()  # each repeat compiles afresh, as a new process would, never
                # reaching torch.compile's recompile limit (past it, torch 2.11 ran the model eager)
                graphed.append(train_rate(cfg))
                cfg.compile = "off"
            seconds, iters = lr_find_seconds(cfg, device, lr_find_iters)
            find_seconds.append(seconds / iters)
            find_iters.append(iters)
            bare.append(bare_rate(cfg, device))
    around = [(a + b) / 2 for a, b in pairwise(bare)]
    batch = cfg.batch_size
    return {"loop_vs_bare": spread([t / b for t, b in zip(trained, around, strict=True)]),
            "lr_find_overhead": spread([s * b / batch for s, b in zip(find_seconds, around, strict=True)]),
            "bare_images_per_second": spread(bare), "train_images_per_second": spread(trained),
            "lr_find_seconds_per_iter": spread(find_seconds), "lr_find_iters": min(find_iters),
            "bare_steps_per_second": spread([v / batch for v in bare]),
            "train_steps_per_second": spread([v / batch for v in trained]),
            "batch_size": batch, "epochs": epochs,
            **({"cuda_graphs_speedup": spread([g / b for g, b in zip(graphed, around, strict=True)]),
                "graphed_steps_per_second": spread([v / batch for v in graphed])} if graphed else {})}


def host_config(device: str, steps: int, out_dir: str, *flags: str) -> Config:
    """The host-bound emulation: resnet_small at width 1 on 8 px synthetic images, batch 8, one epoch
    of `steps` steps and one validation batch. It has resnet_small's layers and parameter tensors
    (29 parameters and 27 buffers, whatever the width), so every op and every Python line of a step
    is there, at almost no compute: the regime of a small model on a GPU, where launches and host
    work bound the step (the first H200 run's bare loop: 5.5 ms a step, launch-bound)."""
    return parse_config(["--device", device, "--dataset", "synthetic", "--image-size", "8", "--channels", "1",
                         "--width", "1", "--batch-size", "8", "--synthetic-size", str(8 * steps),
                         "--synthetic-val-size", "8", "--epochs", "1", "--out-dir", out_dir, *flags])


def cpu_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Process CPU time (all threads: TensorBoard's writer included) of run(), its device work done.
    The collector first clears what earlier runs left, so that no run pays for another's garbage."""
    gc.collect()
    sync(device)
    start = time.process_time()
    run()
    sync(device)
    return time.process_time() - start


def stepping_cpu(run: Callable[[], object]) -> float:
    """Process CPU seconds (all threads: TensorBoard's writer included) per optimizer step of run(),
    from its first step to its last: the setup before and the evaluation and saves after are not in
    it, the log points and writes between are. The steps are seen through torch's global step hook,
    the same instrument for both loops. The collector first clears what earlier runs left."""
    gc.collect()
    marks = []
    hook = register_optimizer_step_pre_hook(
        lambda *_: marks.append(time.process_time()))
    try:
        run()
    finally:
        hook.remove()
    return (marks[-1] - marks[0]) / (len(marks) - 1)


def host_bare(device_name: str, device: torch.device, steps: int, out_dir: str) -> float:
    """CPU seconds a step of the bare loop on the emulation, `steps` steps."""
    cfg = host_config(device_name, steps, out_dir)
    train_batches, model, optimizer, amp_dtype, scaler, loss = setup(cfg, device)
    batches = train_batches.epoch(0)
    return stepping_cpu(lambda: bare_steps(model, optimizer, amp_dtype, scaler, device, batches, loss))


def host_train(device_name: str, device: torch.device, steps: int, out_dir: str, *flags: str) -> float:
    """CPU seconds a step of a whole train.train run of `steps` steps on the emulation."""
    import train

    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            summary = train.train(host_config(device_name, steps, out_dir, *flags))
        assert summary["steps"] == steps, summary["steps"]

    return stepping_cpu(run)


def host_train_ema(device_name: str, device: torch.device, steps: int, out_dir: str) -> float:
    """host_train with --ema 0.999: the average's update after every step."""
    return host_train(device_name, device, steps, out_dir, "--ema", "0.999")


def host_train_beside_ema(device_name: str, device: torch.device, steps: int, out_dir: str) -> float:
    """host_train, as host_train_ema's yardstick (timed in its own pairs)."""
    return host_train(device_name, device, steps, out_dir)


def host_bare_steps(device_name: str, device: torch.device, steps: int, out_dir: str) -> float:
    """CPU seconds of `steps` bare steps on a freshly built setup (setup not timed): lr_find's yardstick,
    which sweeps a fresh model the same way, its first steps' allocations included in both."""
    cfg = host_config(device_name, steps, out_dir)
    train_batches, model, optimizer, amp_dtype, scaler, loss = setup(cfg, device, lr=1e-4)
    return cpu_seconds(lambda: bare_steps(model, optimizer, amp_dtype, scaler, device, train_batches.epoch(0),
                                          loss), device)


def host_lr_find(device_name: str, device: torch.device, steps: int, out_dir: str) -> float:
    """CPU seconds of one lr_find call of `steps` steps (snapshot and restore included, setup not)."""
    from lr_find import lr_find

    cfg = host_config(device_name, steps, out_dir)
    train_batches, model, optimizer, amp_dtype, scaler, loss = setup(cfg, device, lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a suggestion or none: only the time counts here
        return cpu_seconds(lambda: lr_find(
            model, optimizer, loss, train_batches, start_lr=1e-4, end_lr=0.1, num_iter=steps, diverge=1e9,
            autocast_dtype=amp_dtype, scaler=scaler, device=device), device)


def measure_host_bound(device_name: str, device: torch.device, steps: int, repeats: int,
                       find_iters: int, pairs: int = 3) -> dict:
    """train.py's loop and an lr_find step against the bare loop where host work shows (host_config).

    The loops' figures are process CPU time per optimizer step from the first step of a `steps`-step
    run to its last (stepping_cpu): every log point, TensorBoard write and save between is in it,
    setup and evaluation are not. lr_find's is a whole sweep of `find_iters` steps (lr_find.py's
    default 50), snapshot and restore included, against as many bare steps from the same fresh setup
    (host_bare_steps), so both pay the first steps' allocations. One repeat runs the two loops, then
    lr_find and its yardstick, `pairs` times each (short runs, interleaved: this VM's speed drifts
    within seconds), every pair's order the other way round from the one before so drift hits both
    alike, then an untimed short bare run: whichever run came right after an lr_find call ran ~5%
    slower on a 2-core VM.
    """
    bare, trained, found, fresh, averaged = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-host-") as tmp:
        for run in (host_bare, host_train, host_lr_find, host_bare_steps, host_train_ema):  # imports, caches
            run(device_name, device, 10, str(Path(tmp) / f"warm-{run.__name__}"))
        for r in range(repeats):
            seconds = collections.Counter()
            for pair, n in (((host_bare, host_train), steps), ((host_lr_find, host_bare_steps), find_iters),
                            ((host_train_ema, host_train_beside_ema), steps)):
                for k in range(pairs):  # A B B A A B: drift within the repeat hits both alike
                    for run in pair if (r + k) % 2 == 0 else pair[::-1]:
                        seconds[run] += run(device_name, device, n, str(Path(tmp) / f"{r}-{run.__name__}"))
            host_bare(device_name, device, 10, f"{tmp}/{r}-settle")  # untimed: see above
            bare.append(seconds[host_bare] / pairs)
            trained.append(seconds[host_train] / pairs)
            found.append(seconds[host_lr_find] / find_iters / pairs)
            fresh.append(seconds[host_bare_steps] / find_iters / pairs)
            averaged.append(seconds[host_train_ema] / seconds[host_train_beside_ema])
    us = 1e6
    return {"host_loop_vs_bare": spread([b / t for b, t in zip(bare, trained, strict=True)]),
            "host_lr_find_overhead": spread([f / b for f, b in zip(found, fresh, strict=True)]),
            "host_ema_cost": spread(averaged),  # train.py --ema's CPU per step over without
            "bare_us_per_step": spread([v * us for v in bare]),
            "train_us_per_step": spread([v * us for v in trained]),
            "lr_find_us_per_step": spread([v * us for v in found]),
            "fresh_bare_us_per_step": spread([v * us for v in fresh]),
            "steps": steps, "find_iters": find_iters, "pairs": pairs}


class PerSampleSet(torch.utils.data.Dataset):
    """uint8 CHW images served one at a time through torchvision transforms (the usual recipe)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


def timed_after_first(batches: Iterable, device: torch.device) -> float:
    """Images/s from the first batch's arrival to the end: worker start-up is not counted."""
    images, start = 0, None
    for inputs, targets in batches:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if start is None:
            sync(device)
            start = time.perf_counter()
        else:
            images += len(targets)
    sync(device)
    return images / (time.perf_counter() - start)


def measure_loader(device: torch.device, count: int, batch_size: int, repeats: int) -> dict:
    """Device-resident batched crop+flip+normalize against a 2-worker per-sample DataLoader."""
    from torchvision import transforms

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, 32, 32), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (count,), generator=g)
    mean, std = torch.tensor([0.49, 0.48, 0.45]), torch.tensor([0.25, 0.24, 0.26])
    resident = DeviceBatches(images.to(device), labels.to(device), Serving(batch_size, device), train=True,
                             image=ImageSteps(mean, std, pad=4, flip=True))
    transform = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ConvertImageDtype(torch.float32), transforms.Normalize(mean.tolist(), std.tolist())])
    dataset = PerSampleSet(images, labels, transform)
    device_rates, loader_rates = [], []
    for r in range(repeats):
        device_rates.append(timed_after_first(resident.epoch(r), device))
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=2,
                                             drop_last=True, pin_memory=device.type == "cuda")
        loader_rates.append(timed_after_first(loader, device))
    ratios = [d / w for d, w in zip(device_rates, loader_rates, strict=True)]
    return {"loader_speedup": spread(ratios), "device_images_per_second": spread(device_rates),
            "dataloader_images_per_second": spread(loader_rates), "images": count,
            "batch_size": batch_size}


def measure_cifar_model(device_name: str, device: torch.device, batch_size: int, warmup: int,
                        steps: int, compile: bool = False) -> float:
    """Images/s of full training steps of the cifar10 preset's model on synthetic 32 px data.

    With compile, the warm-up steps include the compilation, as train.py --compile's first epoch does.
    """
    cfg = cifar_config(device_name, batch_size, batch_size * (warmup + steps))
    train_batches, model, optimizer, amp_dtype, scaler, loss = setup(cfg, device)
    if compile:
        model = torch.compile(model)
    batches = list(train_batches.epoch(0))
    bare_steps(model, optimizer, amp_dtype, scaler, device, batches[:warmup], loss)
    sync(device)
    start = time.perf_counter()
    images = bare_steps(model, optimizer, amp_dtype, scaler, device, batches[warmup:], loss)
    sync(device)
    return images / (time.perf_counter() - start)


def peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20, "process RSS (ru_maxrss)"


def table(result: dict) -> str:
    def row(name: str, stats: dict, fmt: str, target: str = "") -> str:
        cells = "".join(f"{stats[k]:>12{fmt}}" for k in ("median", "min", "max"))
        return f"{name:<34}{cells}  {target}"

    details = result["details"]
    loop, host, loader, cifar = details["loop"], details["host_bound"], details["loader"], details["cifar10"]
    files = details["image_files"]
    served = {name: spread(rates) for name, rates in files["images_per_second"].items()}
    graphs = result["cuda_graphs_speedup"]
    lines = [
        f"bench on {result['device']}: torch {result['torch_version']}, {result['threads']} threads "
        f"({result['ratio_threads']} for the ratios), {result['repeats']} interleaved repeats, load average "
        f"{result['load_average_1min'][0]:.1f} -> {result['load_average_1min'][1]:.1f}",
        f"{'':<34}{'median':>12}{'min':>12}{'max':>12}  target",
        row("loop_vs_bare", loop["loop_vs_bare"], ".3f", TARGETS["loop_vs_bare"]),
        row("loader_speedup", loader["loader_speedup"], ".1f", TARGETS["loader_speedup"]),
        row("lr_find_overhead", loop["lr_find_overhead"], ".3f", TARGETS["lr_find_overhead"]),
        row(f"  bare loop img/s ({result['ratio_threads']} thr)", loop["bare_images_per_second"], ",.0f"),
        row(f"  train.py img/s ({result['ratio_threads']} thr)", loop["train_images_per_second"], ",.0f"),
        row(f"  lr_find ms/iter ({loop['lr_find_iters']} iters)",
            {k: v * 1e3 for k, v in loop["lr_find_seconds_per_iter"].items() if k != "runs"}, ".2f"),
        row("  bare loop steps/s", loop["bare_steps_per_second"], ",.1f"),
        row("  train.py steps/s", loop["train_steps_per_second"], ",.1f"),
        *([row("--compile reduce-overhead vs bare", loop["cuda_graphs_speedup"], ".3f", ">= 1.3"),
           row("  --compile reduce-overhead steps/s", loop["graphed_steps_per_second"], ",.1f")]
          if graphs else []),
        row("host_loop_vs_bare", host["host_loop_vs_bare"], ".3f", TARGETS["host_loop_vs_bare"]),
        row("host_lr_find_overhead", host["host_lr_find_overhead"], ".3f", TARGETS["host_lr_find_overhead"]),
        row("host_ema_cost", host["host_ema_cost"], ".3f", "train.py --ema 0.999 over without"),
        row("  bare loop CPU us/step", host["bare_us_per_step"], ",.0f"),
        row("  train.py CPU us/step", host["train_us_per_step"], ",.0f"),
        row(f"  lr_find CPU us/step ({host['find_iters']} iters)", host["lr_find_us_per_step"], ",.0f",
            "the whole call over its steps"),
        row(f"  bare CPU us/step ({host['find_iters']}, fresh)", host["fresh_bare_us_per_step"], ",.0f",
            "lr_find's yardstick"),
        row("  device-resident loader img/s", loader["device_images_per_second"], ",.0f"),
        row("  DataLoader (2 workers) img/s", loader["dataloader_images_per_second"], ",.0f"),
        row("image_files_vs_tensors", spread(files["ratios"]["vs_tensors"]), ".3f",
            TARGETS["image_files_vs_tensors"]),
        row("image_files_vs_streamed", spread(files["ratios"]["vs_streamed"]), ".1f",
            "the 2-worker DataLoader's per-file read"),
        row("  decoded, from the cache img/s", served["cached"], ",.0f", "epochs 2+, batch 64, 32 px"),
        row("  the same as tensors img/s", served["tensors"], ",.0f"),
        row("  the files, 2 workers img/s", served["streamed"], ",.0f"),
        f"{'  decode pass s':<34}{files['decode_seconds']:>12.2f}  {files['files']:,} JPEG files (96 px), "
        f"and a tenth as many val ones; a later run's cache read {files['cache_seconds']:.2f} s",
        row("images/s resnet_small digits", result["details"]["default"], ",.0f",
            f"bare loop, batch {loop['batch_size']}, {result['threads']} threads"),
        f"{'images/s resnet9 cifar10 preset':<34}{result['images_per_second']['cifar10']:>12,.0f}"
        f"  batch {cifar['batch_size']}, {cifar['steps']} steps after {cifar['warmup']} warm-up",
        *([f"{'  the same under torch.compile':<34}{cifar['compiled_images_per_second']:>12,.0f}"
           f"  {cifar['compiled_images_per_second'] / cifar['images_per_second']:.2f}x"]
          if "compiled_images_per_second" in cifar else []),
        f"{'peak memory MB':<34}{result['peak_memory_mb']:>12,.0f}  {result['peak_memory_kind']}",
        f"loop: digits, {loop['epochs']} epochs, epochs 2+ timed as train.py does; loader: "
        f"{loader['images']:,} random uint8 3x32x32, batch {loader['batch_size']}, both timed from the "
        "first batch (worker start-up excluded)",
        f"host: resnet_small width 1, 8 px, batch 8, process CPU time per step from the first step "
        f"to the last of {host['steps']}; {host['pairs']} interleaved pairs a repeat",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = processes.pick_device(args.device)
    except UserError as err:
        exit_with_error(str(err))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    quick, cpu = args.quick, device.type == "cpu"
    # Ratios on one thread by default on CPU: when another process takes a core, a 2-thread step
    # waits for its preempted half at every op and runs up to 50x slower, so 2-thread ratios on a
    # shared machine are noise. The ratios measure per-step overhead, which threads barely change.
    ratio_threads = args.ratio_threads or (1 if cpu else torch.get_num_threads())
    phases = {}

    def phase(name: str, run: Callable):
        start = time.perf_counter()
        value = run()
        phases[name] = round(time.perf_counter() - start, 1)
        return value

    with torch_threads(ratio_threads):
        files = phase("image_files", lambda: image_files.measure(
            device, 600 if quick else 5_000, repeats=min(args.repeats, 3)))
        loop = phase("loop_and_lr_find", lambda: measure_loop(
            args.device, device, epochs=2 if quick else 8, repeats=args.repeats,
            lr_find_iters=20 if quick else 50))
        host = phase("host_bound", lambda: measure_host_bound(
            args.device, device, steps=20 if quick else 100, repeats=args.repeats, find_iters=50,
            pairs=1 if quick else 3))
    default = phase("default_model", lambda: measure_default_model(
        args.device, device, epochs=3 if quick else 4, repeats=1 if quick else 3))
    loader = phase("loader", lambda: measure_loader(
        device, 5_000 if quick else 50_000, 512, repeats=min(args.repeats, 3)))
    batch = args.batch_size or (32 if quick and cpu else 512)
    warmup, steps = (1, 3) if cpu or quick else (5, 20)
    cifar = phase("cifar10_model", lambda: measure_cifar_model(args.device, device, batch, warmup, steps))
    compiled = None
    if device.type == "cuda" if args.compile is None else args.compile:
        compiled = phase("cifar10_model_compiled", lambda: measure_cifar_model(
            args.device, device, batch, warmup, steps, compile=True))
    memory, memory_kind = peak_memory(device)
    images_per_second = {"default": default["median"], "cifar10": cifar}
    cifar_details = {"images_per_second": cifar, "batch_size": batch, "warmup": warmup, "steps": steps}
    if compiled is not None:
        images_per_second["cifar10_compiled"] = cifar_details["compiled_images_per_second"] = compiled
    result = {
        "loop_vs_bare": loop["loop_vs_bare"]["median"],
        "loader_speedup": loader["loader_speedup"]["median"],
        "lr_find_overhead": loop["lr_find_overhead"]["median"],
        "host_loop_vs_bare": host["host_loop_vs_bare"]["median"],
        "host_lr_find_overhead": host["host_lr_find_overhead"]["median"],
        # image files decoded once, served from their cache from epoch 2 on, over the same images as tensors
        "image_files_vs_tensors": statistics.median(files["ratios"]["vs_tensors"]),
        "image_files_vs_streamed": statistics.median(files["ratios"]["vs_streamed"]),
        "image_files_decode_seconds": files["decode_seconds"],
        "host_ema_cost": host["host_ema_cost"]["median"],  # train.py --ema's CPU per step over without
        # the default setup's optimizer steps per second: bare loop and train.py (images/s / batch)
        "steps_per_second": {"bare": loop["bare_steps_per_second"]["median"],
                             "train": loop["train_steps_per_second"]["median"],
                             **({"graphed": loop["graphed_steps_per_second"]["median"]}
                                if "graphed_steps_per_second" in loop else {})},
        # train.py --compile reduce-overhead's steps/s (CUDA graphs) over the eager bare loop's, on CUDA
        # (null elsewhere)
        "cuda_graphs_speedup": loop.get("cuda_graphs_speedup", {}).get("median"),
        "images_per_second": images_per_second,
        "peak_memory_mb": memory, "peak_memory_kind": memory_kind,
        "loop_vs_bare_runs": loop["loop_vs_bare"]["runs"],
        "loader_speedup_runs": loader["loader_speedup"]["runs"],
        "lr_find_overhead_runs": loop["lr_find_overhead"]["runs"],
        "host_loop_vs_bare_runs": host["host_loop_vs_bare"]["runs"],
        "host_lr_find_overhead_runs": host["host_lr_find_overhead"]["runs"],
        "torch_version": torch.__version__, "device": str(device), "threads": torch.get_num_threads(),
        "ratio_threads": ratio_threads,
        "repeats": args.repeats, "quick": quick,
        # other processes on the machine show here; they, not the code, explain a wide min/max
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "details": {"loop": loop, "host_bound": host, "loader": loader, "default": default,
                    "cifar10": cifar_details, "image_files": files},
    }
    result["seconds"] = time.perf_counter() - started
    result["phase_seconds"] = phases
    print(table(result))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False))
    print(f"wrote {path} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
