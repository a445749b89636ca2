"""Issue 42: examples of several inputs, a tuple or dict of tensors (or a Dataset whose items hold one),
passed to the model as one argument. tests/forks/two_inputs_data.py holds an 8x8 image and 4 numbers per
example, and the class needs both; tests/forks/two_inputs_model.py unpacks them. Each form trains, sweeps,
evaluates to its summary's numbers, resumes bit for bit, accumulates and splits over torchrun as one
batch; the image steps apply to the image input alone, and what does not fit is one line."""

import json
import os
import subprocess

import pytest
import torch
from conftest import LAUNCH, ROOT, add_entries, crash_at_step, read_scalars, run_evaluate, run_main
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_faults import assert_one_line_failure
from test_resume import assert_same_state, final_state

import data
import lr_find
import train
from configs import Config, UserError, parse_config, parse_given
from machinery import checkpoints

ENTRIES = ("two_inputs_data", "two_inputs_model")
SMALL = ["--model", "twoinputnet", "--width", "8", "--synthetic-size", "256", "--batch-size", "32",
         "--device", "cpu", "--num-workers", "0"]
SAID = {"pairs": ("inputs[0]", "inputs[1]"), "pairs_dict": ("inputs['image']", "inputs['table']"),
        "pairs_dataset": ("inputs[0]", "inputs[1]")}


@pytest.mark.parametrize("dataset", SAID)
def test_several_inputs_train_evaluate_and_resume(dataset, tmp_path, monkeypatch, capsys):
    """A tuple, a dict, a Dataset of tuples: start-up names the image input (cropped) and the other (as it
    is); the class needs both inputs and is learned; evaluate.py on best.pt gives the summary's best; the
    pictures show the image input; a run stopped at step 7 and resumed ends with the same state."""
    add_entries(monkeypatch, *ENTRIES)
    argv = ["--dataset", dataset, *SMALL, "--epochs", "3", "--lr", "0.05", "--save-every", "4"]
    summary = train.train(parse_config([*argv, "--out-dir", str(tmp_path / "a")]))
    out = capsys.readouterr().out
    image, table = SAID[dataset]
    assert "inputs [1, 8, 8] uint8 + [4] float32, 4 outputs" in out
    assert f"images ({image}): a random crop after 1 px" in out
    assert f"{table}: [4] float32 tensors, not uint8 images" in out
    assert "twoinputnet takes [2, 1, 8, 8] float32 + [2, 4] float32 and gives [2, 4]" in out
    assert summary["best_val_acc"] > 0.8  # either input alone tells two classes of four apart: 0.5

    code, said, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "a" / "best.pt")
    report = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert code == 0 and report["val_acc"] == summary["best_val_acc"], err
    record = checkpoints.load_checkpoint(tmp_path / "a" / "best.pt")["inputs"]
    assert record["members"] == "[1, 8, 8] uint8 + [4] float32" and record["reading"] is None
    images = EventAccumulator(str(tmp_path / "a"), size_guidance={"images": 0}).Reload().Tags()["images"]
    assert {"inputs", "val/most_confidently_wrong"} <= set(images)

    with crash_at_step(monkeypatch, 7):  # last.pt at step 4
        train.train(parse_config([*argv, "--out-dir", str(tmp_path / "b")]))
    given = parse_given(["--resume", "--out-dir", str(tmp_path / "b")])
    train.train(Config(**given), given)
    assert_same_state(final_state(tmp_path / "b" / "last.pt"), final_state(tmp_path / "a" / "last.pt"))


def test_lr_find_sweeps_several_inputs(tmp_path, monkeypatch):
    add_entries(monkeypatch, *ENTRIES)
    lr_find.main(["--dataset", "pairs_dict", *SMALL, "--find-iters", "60", "--find-end-lr", "100",
                  "--out-dir", str(tmp_path)])
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert len(record["lrs"]) > 30 and record["suggestion"] > 0


def test_several_inputs_accumulate_and_split_over_torchrun_as_one_batch(tmp_path, monkeypatch):
    """--accum-steps 2 of 16 and torchrun's 2 gloo processes of 16 end where one batch of 32 ends (the
    model has no BatchNorm, whose statistics are per process)."""
    add_entries(monkeypatch, *ENTRIES)
    argv = ["--dataset", "pairs", *SMALL, "--epochs", "2", "--lr", "0.05"]  # 288 examples: 9 batches of 32
    for name, more in (("one", []), ("accumulated", ["--batch-size", "16", "--accum-steps", "2"])):
        train.train(parse_config([*argv, *more, "--out-dir", str(tmp_path / name)]))
    two = subprocess.run([*LAUNCH[:1], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          *LAUNCH[1:], "--entries", ",".join(ENTRIES), "train.py", *argv, "--out-dir",
                          str(tmp_path / "two")], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    one = checkpoints.load_checkpoint(tmp_path / "one" / "last.pt")["model"]
    for name in ("accumulated", "two"):
        other = checkpoints.load_checkpoint(tmp_path / name / "last.pt")["model"]
        assert max((one[k] - other[k]).abs().max().item() for k in one) <= 1e-5, name
    scalars = read_scalars(tmp_path / "two")
    assert [s for s, _ in scalars["train/lr"]] == [s for s, _ in scalars["train/loss"]]
    assert scalars["train/lr"][-1][0] == 18


def zeros() -> tuple:
    return torch.zeros(64, 1, 8, 8, dtype=torch.uint8), torch.zeros(64, 4), torch.zeros(64).long()


def mismatched(cfg):
    image, table, labels = zeros()
    return data.Source(((image, table[:60]), labels), ((image, table), labels), list("AB"))


def not_tensors(cfg):
    image, table, labels = zeros()
    return data.Source(({"image": image, "table": table.numpy()}, labels), ((image, table), labels),
                       list("AB"))


@pytest.mark.parametrize("dataset, model, said", [
    ("mismatched", "twoinputnet", "the train inputs[1] hold 60 rows and the targets 64: give each input one "
                                  "row per example"),
    ("not_tensors", "twoinputnet", "the inputs['table'] are a ndarray: give the model a tensor, or a tuple"),
    ("pairs", "resnet18", "resnet18 is a torchvision image model, which takes one image tensor, and pairs's "
                          "inputs are [1, 8, 8] uint8 + [4] float32"),
    ("pairs", "resnet_small", "the model resnet_small cannot take this data's inputs ([2, 1, 8, 8] float32 + "
                              "[2, 4] float32)")])
def test_inputs_that_do_not_fit_are_one_line_before_any_file(dataset, model, said, tmp_path, monkeypatch,
                                                             capsys):
    add_entries(monkeypatch, *ENTRIES)
    monkeypatch.setitem(data.DATASETS, "mismatched", mismatched)
    monkeypatch.setitem(data.DATASETS, "not_tensors", not_tensors)
    code, _, err = run_main(monkeypatch, capsys, "--dataset", dataset, *SMALL, "--model", model, "--out-dir",
                            tmp_path / "run")
    assert said in assert_one_line_failure(code, "", err) and not (tmp_path / "run").exists()


def test_predict_on_files_refuses_a_model_of_several_inputs(tmp_path, monkeypatch, capsys):
    add_entries(monkeypatch, *ENTRIES)
    train.train(parse_config(["--dataset", "pairs", *SMALL, "--epochs", "1", "--out-dir", str(tmp_path)]))
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "last.pt", "--predict",
                                tmp_path)
    assert assert_one_line_failure(code, "", err) == (
        f"error: --predict reads one image per file, and {tmp_path / 'last.pt'}'s model takes several inputs "
        "([1, 8, 8] uint8 + [4] float32); run it on your tensors in your own code\n")


def test_the_docs_model_of_two_inputs_trains(tmp_path, monkeypatch, capsys):
    """docs/your_data.md's model, written into models.py's names as it says, trains on the tuple form."""
    from test_docs import blocks, read

    import models

    page = blocks(read("docs/your_data.md"))
    block = next(body for _, body in page if body.startswith("class ImageAndTable"))
    scope = dict(vars(models))
    exec(block, scope)
    add_entries(monkeypatch, "two_inputs_data")
    monkeypatch.setitem(models.MODELS, "imageandtable", scope["ImageAndTable"])
    summary = train.train(parse_config(["--dataset", "pairs", *SMALL, "--model", "imageandtable", "--epochs",
                                        "2", "--lr", "0.05", "--out-dir", str(tmp_path)]))
    assert summary["best_val_acc"] > 0.8


def test_any_mapping_is_a_dict_of_inputs_and_none_at_all_is_one_line():
    """A tokenizer's BatchEncoding is a Mapping, not a dict: its tensors are inputs by key all the same."""
    from collections import UserDict

    from machinery.inputs import described, each, members, take

    batch = UserDict(ids=torch.arange(6).view(3, 2), mask=torch.ones(3, 2, dtype=torch.bool))
    doubled = each(lambda _, t: t * 2, take(batch, slice(0, 2)))
    assert isinstance(doubled, dict) and doubled["ids"].tolist() == [[0, 2], [4, 6]]
    assert described(batch) == "[3, 2] int64 + [3, 2] bool"
    for empty in ((), {}):
        with pytest.raises(UserError, match="the inputs are an empty tuple or dict"):
            members(empty)
