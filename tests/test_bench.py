"""bench.py --quick runs end to end and writes every headline number; timings are not asserted."""

import json
import math

RATIOS = ("loop_vs_bare", "loader_speedup", "lr_find_overhead")


def positive(value) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def test_quick_bench_writes_all_keys(tmp_path, script):
    out = tmp_path / "bench.json"
    result = script("bench.py", "--quick", "--device", "cpu", "--json", str(out), timeout=180)
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
