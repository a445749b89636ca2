"""Issue 43: runs you can compare. --deterministic: two runs give the same weights; the setting is
recorded and a resume may not change it; an op with no deterministic kernel is one line naming it; our
models have none such (resnet9's global max pool runs as amax)."""

import json

import pytest
import torch
from conftest import run_main
from test_work_kept import TINY, one_line
from torch.utils._python_dispatch import TorchDispatchMode

import models
from machinery import checkpoints, stops


@pytest.fixture
def deterministic_after():
    """--deterministic sets torch's global switch for the process: put it back for the next test."""
    yield
    torch.use_deterministic_algorithms(False)


def test_two_deterministic_runs_give_the_same_weights(deterministic_after, tmp_path, monkeypatch, capsys):
    weights = []
    for run in ("a", "b"):
        code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "1", "--deterministic", "--dropout",
                                  "0.2", "--out-dir", tmp_path / run)
        assert code == 0 and "--deterministic: on cpu the kernels already repeat" in out, err
        assert json.loads((tmp_path / run / "config.json").read_text())["deterministic"] is True
        weights.append(checkpoints.load_checkpoint(tmp_path / run / "last.pt")["model"])
    assert torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path / "a",
                              "--no-deterministic")
    assert "(deterministic: True -> False)" in one_line(code, err)


def test_an_op_without_a_deterministic_kernel_is_one_line_naming_it():
    err = RuntimeError("adaptive_max_pool2d_backward_cuda does not have a deterministic implementation, but "
                       "you set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism ...")
    line, status = stops.failure_line(err, "")
    assert line.startswith("--deterministic: adaptive_max_pool2d_backward_cuda has no deterministic kernel")
    assert status == 2 and "\n" not in line


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["resnet_small", "resnet9"])
def test_our_models_use_no_op_that_cuda_runs_without_a_deterministic_kernel(name):
    model = models.MODELS[name](3, 10, 8)
    x = torch.randn(2, 3, 32, 32)
    with Ops() as ops:
        model(x).sum().backward()
    assert not {op for op in ops.names if "adaptive_max_pool" in op or "adaptive_avg_pool" in op}, ops.names
    assert torch.equal(models.GlobalMax()(x), torch.nn.AdaptiveMaxPool2d(1)(x))
