"""--compile compiles the whole model once (issue 48): one graph for training and one for evaluation, and
none again for evaluation's smaller last batch, for eval mode and no_grad, for the test pass through best.pt's
weights, or in a resumed run. Counted with dynamo's own counters, on CPU, through the template's real
compile path with torch.compile's backend swapped for dynamo's "eager" one: dynamo captures frames and
checks guards as it does for inductor, without a C++ compiler or tens of seconds of code generation.
tests/test_cuda.py counts the same under reduce-overhead on a GPU."""

import pytest
import torch
import torch._dynamo
from conftest import crash_at_step
from torch._dynamo.utils import counters

import train
from configs import Config, parse_config, parse_given
from machinery import checkpoints
from machinery.precision import CompiledForward

# 64 training examples (4 steps an epoch), 20 val and 20 test: each split's last batch holds 4, not 16
TINY = ["--dataset", "synthetic", "--synthetic-size", "64", "--synthetic-val-size", "20", "--num-classes",
        "2", "--image-size", "8", "--width", "4", "--batch-size", "16", "--epochs", "2", "--device", "cpu",
        "--num-workers", "0", "--save-every", "2"]


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile, as the template calls it, on dynamo's eager backend; the modes it was asked for.
    dynamo starts empty, as in a new process, and is emptied again after."""
    real, modes = torch.compile, []

    def compile(fn, *, mode=None, **options):
        modes.append(mode)
        return real(fn, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", compile)
    fresh()
    yield modes
    torch._dynamo.reset()


def fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def compiled() -> dict:
    """Frames dynamo compiled (a recompile is one more) and the graphs it made (a graph break is one more)."""
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"]}


def weights(out_dir) -> dict:
    return checkpoints.load_checkpoint(out_dir / "last.pt")["model"]


def test_training_and_evaluation_compile_once_each(tmp_path, eager_compile):
    """Two epochs, each evaluated (val: 16 + 4), then the test split (16 + 4) through best.pt's weights:
    two frames, two graphs. Before issue 48 Module.compile made three: evaluation's no_grad recompiled the
    training frame, and its 4-example batch recompiled it again."""
    summary = train.train(parse_config([*TINY, "--compile", "--out-dir", str(tmp_path / "compiled")]))
    assert compiled() == {"frames": 2, "graphs": 2}
    assert eager_compile == ["default", "default"]  # the training forward, the evaluation forward
    assert not any(key.startswith(("_orig_mod.", "model.")) for key in weights(tmp_path / "compiled"))
    eager = train.train(parse_config([*TINY, "--out-dir", str(tmp_path / "eager")]))
    for key in ("val_loss", "test_loss", "val_acc", "test_acc"):  # the padded last batches cut back
        assert summary[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-7), key
    compiled_weights, eager_weights = weights(tmp_path / "compiled"), weights(tmp_path / "eager")
    assert all(torch.equal(compiled_weights[k], v) for k, v in eager_weights.items())


def test_a_resumed_run_compiles_once_each_after_its_restore(tmp_path, monkeypatch, eager_compile):
    """A compiled --ema run stopped in its second epoch (last.pt at step 6) and resumed in a fresh dynamo,
    as a new process would: the resumed part (its state restored, then compiled; the average evaluated)
    compiles two frames, two graphs, and ends bit for bit where an uninterrupted compiled run ends."""
    flags = [*TINY, "--compile", "--ema", "0.9"]
    train.train(parse_config([*flags, "--out-dir", str(tmp_path / "straight")]))
    with crash_at_step(monkeypatch, 7):
        train.train(parse_config([*flags, "--out-dir", str(tmp_path / "broken")]))
    fresh()
    given = parse_given(["--resume", "--out-dir", str(tmp_path / "broken")])
    train.train(Config(**given), given)
    assert compiled() == {"frames": 2, "graphs": 2}
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "broken")
    assert all(torch.equal(resumed[k], v) for k, v in straight.items())


def test_a_smaller_batch_is_padded_to_the_compiled_size_and_cut_back():
    """Evaluation's last batch runs through the graph of the full batch: every input (a dict or tuple of
    them too) padded with its last row, every output with a row per example cut back to the batch's."""
    seen = []

    def model(inputs):
        seen.append({key: len(t) for key, t in inputs.items()})
        total = inputs["image"].flatten(1).sum(1) + inputs["table"].sum(1)
        return {"score": total, "both": (total, total[:, None] * 2), "constant": torch.tensor(1.0)}

    forward = CompiledForward(torch.nn.Identity(), lambda _, inputs: model(inputs), batch_size=8)
    inputs = {"image": torch.randn(3, 1, 4, 4), "table": torch.randn(3, 5)}
    outputs = forward(inputs)
    expected = model(inputs)
    assert seen == [{"image": 8, "table": 8}, {"image": 3, "table": 3}]
    assert torch.equal(outputs["score"], expected["score"]) and outputs["both"][1].shape == (3, 1)
    assert torch.equal(outputs["both"][0], expected["score"]) and outputs["constant"].ndim == 0
