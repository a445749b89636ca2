"""--throughput and --profile (issue 55, items 4 and 5): the FLOPs of a step counted as by hand, the peak
table's lookup by GPU name, MFU only where a peak is known, the data-wait share in summary.json, and the
profile's trace written and bounded. CUDA's own case skips without a GPU. That --throughput reads nothing
from the device between log points is counted with the other options, in tests/test_sync.py."""

import contextlib
import io
import json

import pytest
import torch
from conftest import crash_at_step

import train
from configs import Config, UserError, parse_config, parse_given
from machinery import profile
from machinery.throughput import PEAK_TFLOPS, Throughput, peak_tflops, train_flops

TINY = ["--epochs", "1", "--width", "4", "--log-every", "1000"]  # digits: 10 steps of 128


def test_a_steps_flops_are_the_count_by_hand_and_the_model_is_left_as_it_was():
    """Two Linear layers, N examples: forward 2NIH + 2NHO; backward the second layer's two matmuls (its
    input's and its weight's gradients) and the first's weight gradient only (the inputs need none)."""
    n, i, h, o = 16, 12, 20, 5
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(i, h), torch.nn.BatchNorm1d(h), torch.nn.Dropout(0.5),
                                torch.nn.ReLU(), torch.nn.Linear(h, o))
    inputs, before = torch.randn(n, i), {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()  # dropout's draws: from a forked generator
    flops, examples = train_flops(model, inputs, lambda outputs: outputs.square().sum())
    assert (flops, examples) == (2 * n * i * h + 2 * n * h * o + 2 * n * i * h + 2 * 2 * n * h * o, n)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's statistics
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)


class Doubled(torch.nn.Module):
    """A GAN's shape: N examples in, 2N rows out (each example's and another's)."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.linear = torch.nn.Linear(i, o)

    def forward(self, inputs):
        return self.linear(torch.cat([inputs, inputs.flip(0)]))


def test_the_flops_of_an_example_divide_by_the_inputs_rows_not_the_outputs():
    """2N rows through one Linear: forward 2(2N)IO, backward its weight's gradient only, as much again;
    per example 8IO, where dividing by the outputs' 2N rows gave half."""
    n, i, o = 6, 7, 3
    flops, examples = train_flops(Doubled(i, o), torch.randn(n, i), lambda outputs: outputs.square().sum())
    assert examples == n and flops / examples == 8 * i * o


@pytest.mark.parametrize("name, row", [
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GH200 480GB", None), ("NVIDIA L40", None),
    ("Tesla V100-SXM2-16GB", None), ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 3090", None)])
def test_the_peak_is_the_tables_row_for_the_gpus_name_and_none_for_an_unknown_one(name, row):
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        assert peak_tflops(name, dtype) == (None if row is None else (PEAK_TFLOPS[row][dtype], row))
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.5  # dense: 1,979 with sparsity


def test_mfu_is_achieved_over_the_peak_and_absent_without_one():
    for peak in (100.0, None):
        meter = Throughput(flops_per_example=1e12, peak=peak)
        stream = meter.start(iter([1, 2]), 0)
        assert list(stream) == [1, 2]
        line = meter.end(batches=2, batch_size=4, device=torch.device("cpu"), images=True)
        facts = meter.facts()
        tflops = facts["tflops_per_device"]
        assert tflops == pytest.approx(facts["examples_per_second"]) and 0 <= facts["data_wait_share"] <= 1
        assert ("MFU" in line) == ("mfu" in facts) == (peak is not None)
        assert peak is None or facts["mfu"] == pytest.approx(tflops / peak)


def test_a_cpu_run_gives_tflops_and_the_data_wait_but_no_mfu(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train.train(parse_config([*TINY, "--throughput", "--out-dir", str(tmp_path)]))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert 0 <= saved["data_wait_share"] <= 1 and saved["tflops_per_device"] > 0
    assert "mfu" not in saved and "peak_tflops" not in saved and saved["tflops_per_device"] == summary[
        "tflops_per_device"]
    epoch = next(line for line in out.getvalue().splitlines() if line.startswith("epoch 1/1"))
    assert "TFLOP/s" in epoch and "waiting for data" in epoch and "MFU" not in epoch
    assert "no MFU: no peak known for this device" in out.getvalue()


def test_peak_tflops_without_throughput_is_refused():
    with pytest.raises(UserError, match="add --throughput"):
        parse_config(["--peak-tflops", "100"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_run_gives_mfu_where_the_gpu_is_in_the_table(tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train.train(parse_config([*TINY, "--device", "cuda", "--throughput", "--out-dir",
                                            str(tmp_path)]))
    known = peak_tflops(torch.cuda.get_device_name(), "bf16") is not None
    assert ("mfu" in summary) == known and 0 <= summary["data_wait_share"] <= 1
    assert not known or 0 < summary["mfu"] < 1


def test_the_profile_is_written_bounded_and_its_top_operators_printed(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train(parse_config([*TINY, "--profile", "2", "--out-dir", str(tmp_path)]))
    trace = tmp_path / profile.TRACE
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "aten::convolution_backward" for event in events)
    assert trace.stat().st_size < 1e6  # 2 steps of this model: about 0.3 MB each on CPU
    assert [path.name for path in tmp_path.glob(".*.tmp")] == []  # exported beside it, then renamed
    table = out.getvalue().split("--profile: optimizer steps 6 to 7 traced")[1]
    assert "Self CPU" in table and len([row for row in table.splitlines() if "aten::" in row]) >= 5


@pytest.mark.parametrize("steps, left, words", [(21, 100, "at most 20"), (10, 14, "this run has 14 left")])
def test_a_profile_too_long_is_refused_before_it_starts(steps, left, words):
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(UserError, match=words):
        profile.record_steps(optimizer, steps, None, device=torch.device("cpu"), steps_left=left)


def test_a_refused_profile_leaves_no_logs_and_no_config_in_the_folder(tmp_path, monkeypatch, capsys):
    """Refused as the run starts, before its logs open: the folder holds nothing to move aside next time."""
    from conftest import run_main

    code, out, err = run_main(monkeypatch, capsys, *TINY, "--profile", "21", "--out-dir", tmp_path)
    assert code == 2 and err.strip().endswith("at most 20 steps are recorded, which keeps the trace file "
                                              "small; profile fewer"), err
    assert list(tmp_path.iterdir()) == []


def test_a_kill_during_the_export_leaves_no_truncated_trace(tmp_path, monkeypatch):
    """The exporter writes its file as it goes: here it stops halfway, as a kill would."""
    def halfway(profiler, path):
        with open(path, "w") as f:
            f.write('{"traceEvents": [')
        raise RuntimeError("killed during the export")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", halfway)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(RuntimeError, match="during the export"):
        train.train(parse_config([*TINY, "--profile", "2", "--out-dir", str(tmp_path)]))
    assert not (tmp_path / profile.TRACE).exists() and [path.name for path in tmp_path.glob(".*.tmp")] == []


@pytest.mark.parametrize("crash, said", [(4, "the run ended after 3 optimizer steps, before step 6: nothing"),
                                         (7, "optimizer steps 6 to 6 traced (of 2 asked: the run ended)")])
def test_a_run_that_ends_inside_the_window_stops_the_profiler_and_says_what_it_traced(
        tmp_path, monkeypatch, crash, said):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), crash_at_step(monkeypatch, crash):
        train.train(parse_config([*TINY, "--profile", "2", "--out-dir", str(tmp_path)]))
    assert said in out.getvalue() and not torch.autograd.profiler._is_profiler_enabled
    trace = tmp_path / profile.TRACE
    assert (crash == 7) == trace.exists() and (crash == 4 or json.loads(trace.read_text())["traceEvents"])


@pytest.mark.parametrize("again", [[], ["--profile", "2"]])
def test_a_profiled_run_resumed_near_its_end_completes_without_tracing_again(tmp_path, monkeypatch, again):
    """The checkpoint's config keeps --profile 2: last.pt at step 6 of 10 leaves 4 steps, fewer than the
    warm-up and the window. Resumed without --profile, nothing is traced; under --resume auto (a restart's
    command line, --profile in it) a line says it is skipped. The first part's trace stays as it was."""
    argv = [*TINY, "--save-every", "3", "--profile", "2", "--out-dir", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()), crash_at_step(monkeypatch, 9):
        train.train(parse_config(argv))
    first = (tmp_path / profile.TRACE).read_bytes()
    given = parse_given(["--resume", *(["auto"] if again else []), *again, "--out-dir", str(tmp_path)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train.train(Config(**given), given)
    assert summary["test_acc"] > 0 and (tmp_path / profile.TRACE).read_bytes() == first
    assert "traced into" not in out.getvalue()
    assert ("not traced in this restart" in out.getvalue()) == bool(again)
