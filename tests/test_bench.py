"""`python -m bench.speed --quick` runs end to end and writes every headline number, each consistent with the
measurements it was computed from; timings are only held to wide plausibility bounds."""

import json
import math
import statistics
from itertools import pairwise

import pytest
from conftest import default_task_only

RATIOS = ("loop_vs_bare", "loader_speedup", "lr_find_overhead", "host_loop_vs_bare", "host_lr_find_overhead")


def positive(value) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


@default_task_only  # the benchmarks measure the template's own setup, task.py's task on its data
def test_quick_bench_writes_all_keys(tmp_path, script):
    out = tmp_path / "bench.json"
    # one thread throughout: on a shared CPU two-thread ops stall on a preempted sibling (bench.speed)
    result = script("bench.speed", "--quick", "--device", "cpu", "--threads", "1", "--json", str(out),
                    timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loop_vs_bare" in result.stdout and str(out) in result.stdout
    report = json.loads(out.read_text())
    for key in (*RATIOS, "peak_memory_mb", "threads", "repeats"):
        assert positive(report[key]), (key, report[key])
    for key in RATIOS:
        runs = report[f"{key}_runs"]
        assert len(runs) >= 1 and all(positive(v) for v in runs), (key, runs)
    assert set(report["images_per_second"]) == {"default", "cifar10"}
    assert all(positive(v) for v in report["images_per_second"].values()), report["images_per_second"]
    assert report["device"] == "cpu" and report["torch_version"]

    # Each headline figure is the median of the runs reported with it ...
    loop, loader, details = report["details"]["loop"], report["details"]["loader"], report["details"]
    host = details["host_bound"]
    for key, stats in (("loop_vs_bare", loop), ("lr_find_overhead", loop), ("loader_speedup", loader),
                       ("host_loop_vs_bare", host), ("host_lr_find_overhead", host)):
        stats = stats[key]
        assert report[key] == statistics.median(report[f"{key}_runs"]) == stats["median"], key
        assert stats["runs"] == report[f"{key}_runs"] and stats["min"] <= stats["median"] <= stats["max"]
    repeats = report["repeats"]
    assert repeats == 2 and report["quick"] is True  # --quick's default
    assert len(report["loop_vs_bare_runs"]) == len(report["lr_find_overhead_runs"]) == repeats
    assert len(report["host_loop_vs_bare_runs"]) == len(report["host_lr_find_overhead_runs"]) == repeats
    assert len(report["loader_speedup_runs"]) == min(repeats, 3)
    # ... and each run is the ratio of the raw rates beside it: train.py (or lr_find) against the
    # mean of the bare-loop runs just before and after it; device loader against DataLoader.
    bare = loop["bare_images_per_second"]["runs"]
    assert len(bare) == repeats + 1
    around = [(a + b) / 2 for a, b in pairwise(bare)]
    trained = loop["train_images_per_second"]["runs"]
    assert report["loop_vs_bare_runs"] == pytest.approx([t / b for t, b in zip(trained, around, strict=True)])
    per_iter = loop["lr_find_seconds_per_iter"]["runs"]
    assert report["lr_find_overhead_runs"] == pytest.approx(
        [s * b / loop["batch_size"] for s, b in zip(per_iter, around, strict=True)])
    device_rates = loader["device_images_per_second"]["runs"]
    worker_rates = loader["dataloader_images_per_second"]["runs"]
    assert report["loader_speedup_runs"] == pytest.approx(
        [d / w for d, w in zip(device_rates, worker_rates, strict=True)])
    # The host-bound figures: bare loop over train.py's loop, lr_find's step over a bare step, each
    # from the process CPU time per step beside it (the loops: first step to last; lr_find's
    # whole call against as many bare steps from the same fresh setup).
    host_bare, host_train = host["bare_us_per_step"]["runs"], host["train_us_per_step"]["runs"]
    assert report["host_loop_vs_bare_runs"] == pytest.approx(
        [b / t for b, t in zip(host_bare, host_train, strict=True)])
    assert report["host_lr_find_overhead_runs"] == pytest.approx(
        [f / b for f, b in zip(host["lr_find_us_per_step"]["runs"], host["fresh_bare_us_per_step"]["runs"],
                               strict=True)])
    assert host["steps"] == 20 and host["find_iters"] == 50 and host["pairs"] == 1
    # Image files (issue 48): served decoded from their cache, over the same images as tensors and over the
    # files read by workers, epoch by epoch; the decode pass and the cache read timed.
    files = details["image_files"]
    rates = files["images_per_second"]
    for other in ("tensors", "streamed"):
        ratios = [c / o for c, o in zip(rates["cached"], rates[other], strict=True)]
        assert files["ratios"][f"vs_{other}"] == pytest.approx(ratios) and len(ratios) == min(repeats, 3)
        assert report[f"image_files_vs_{other}"] == pytest.approx(statistics.median(ratios))
    assert files["files"] == 600 and 0 < files["cache_seconds"] < files["decode_seconds"]
    assert report["image_files_decode_seconds"] == files["decode_seconds"]
    assert all(100 < v < 100_000 for v in host_bare + host_train)  # microseconds of one thread's step
    # Steps/s are the images/s over the batch; the CUDA-graphs figure is CUDA's alone.
    assert report["steps_per_second"] == {"bare": loop["bare_steps_per_second"]["median"],
                                          "train": loop["train_steps_per_second"]["median"]}
    assert loop["train_steps_per_second"]["runs"] == pytest.approx(
        [v / loop["batch_size"] for v in trained])
    assert report["cuda_graphs_speedup"] is None
    assert report["images_per_second"]["default"] == details["default"]["median"]
    assert report["images_per_second"]["cifar10"] == details["cifar10"]["images_per_second"]
    assert loop["lr_find_iters"] == 20  # diverge=1e9 in a gentle lr range: every step runs

    # Plausible on any CPU, however busy (a shared 2-core machine has shown 0.6 and 1.3 for the
    # first and third): wide bounds that catch a unit slip (ms for s, per batch for per image).
    assert 0.05 < report["loop_vs_bare"] < 20 and 0.05 < report["lr_find_overhead"] < 20
    assert 0.05 < report["host_loop_vs_bare"] < 20 and 0.05 < report["host_lr_find_overhead"] < 20
    assert 0.05 < report["loader_speedup"] < 1000
    assert 50 < report["peak_memory_mb"] < 64_000
    assert report["ratio_threads"] == 1  # one thread for ratios on CPU unless asked otherwise
    assert f"{report['loop_vs_bare']:.3f}" in result.stdout
    assert f"{report['host_loop_vs_bare']:.3f}" in result.stdout
