"""Device and AMP choice, ranks in sync, RNG states in checkpoints, and evaluations under torchrun that
are the whole split's: sums summed, what a metric needs whole gathered in the split's order."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, TORCHRUN, add_entries, build_loaders
from entries import entries
from forks import classification, multilabel, multilabel_ap
from test_docs import blocks, read
from torch import nn

import data
import models
import train
from configs import UserError, parse_config
from machinery import checkpoints, processes
from machinery.torchrun import Torchrun


def test_ranks_agree_in_a_one_process_group(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        nn.parallel.DistributedDataParallel(model)
        assert Torchrun(torch.device("cpu")).agree(model)
    finally:
        dist.destroy_process_group()


def ranks_agree_worker(rank: int, store: str, out_dir: str) -> None:
    """One of two gloo processes: the verdicts of ranks_agree as rank 1 drifts by one ulp."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same model on both ranks
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        verdicts = [Torchrun(torch.device("cpu")).agree(model)]
        for tensor in (model[0].weight, model[1].running_mean):  # a parameter, then a buffer
            before = tensor.detach().clone()
            if rank == 1:
                with torch.no_grad():
                    tensor.view(-1)[1] = torch.nextafter(tensor.view(-1)[1], torch.tensor(math.inf))
            verdicts.append(Torchrun(torch.device("cpu")).agree(model))
            with torch.no_grad():
                tensor.copy_(before)
        verdicts.append(Torchrun(torch.device("cpu")).agree(model))
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(verdicts))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_notices_one_rank_one_ulp_off(tmp_path):
    torch.multiprocessing.spawn(ranks_agree_worker, args=(str(tmp_path / "store"), str(tmp_path)),
                                nprocs=2, join=True)
    for rank in (0, 1):
        verdicts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert verdicts == [True, False, False, True], (rank, verdicts)


def test_amp_choices_on_cpu():
    cpu = torch.device("cpu")
    assert processes.amp_setup(cpu, "auto") == (None, None)
    assert processes.amp_setup(cpu, "off") == (None, None)
    assert processes.amp_setup(cpu, "bf16") == (torch.bfloat16, None)
    dtype, scaler = processes.amp_setup(cpu, "fp16")
    assert dtype == torch.float16 and isinstance(scaler, torch.amp.GradScaler)


def test_device_errors_are_one_line():
    assert processes.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="not a device to train on"):
        processes.pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            processes.pick_device("cuda")


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    """checkpoints.capture_rng_state/restore_rng_state, as train.py's checkpoints use them: torch, Python
    and numpy draw the same numbers again after a save, a weights_only load and a restore."""
    import random

    import numpy as np

    path = tmp_path / "rng.pt"
    checkpoints.write_checkpoint({"rng": checkpoints.capture_rng_state()}, path)
    first = (torch.rand(3), random.random(), np.random.rand())
    checkpoints.restore_rng_state(checkpoints.load_checkpoint(path)["rng"])
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


# ---------------------------------------------------------------- evaluations that are the split's

SMALL = ["--width", "4", "--device", "cpu", "--num-workers", "0", "--batch-size", "32"]


def evaluated(rank: int, world_size: int) -> dict:
    """train.evaluate of fixed, untrained models on the val split of digits (this process's shard): the
    default task's figures, most confidently wrong images and their picture; multilabel.py's, a fork whose
    Tally.result sums; and the gather of each rank's example numbers."""
    data.DATASETS.update(entries("multilabel_data")[0])
    mine = torch.arange(rank, 7, world_size)  # 7 examples: ranks hold 4 and 3
    process = Torchrun(torch.device("cpu")) if world_size > 1 else processes.ALONE  # as train() picks it
    found = {"numbers": process.gather(mine),
             "flags": process.gather({"odd": (mine % 2 == 1)[:, None], "n": mine.float()})}
    for task, dataset, outputs in ((multilabel, "digit_facts", 3), (classification, "digits", 10)):
        cfg = parse_config([*SMALL, "--dataset", dataset])
        _, val, _, info = build_loaders(cfg, rank=rank, world_size=world_size, targets=task.TARGETS,
                                        moves=getattr(task, "TARGETS_MOVE_WITH_IMAGES", None))
        torch.manual_seed(0)
        result = train.evaluate(models.build_model(cfg, 1, outputs), val, task, cfg, info, None, process)
        found[task.NAME] = result.metrics
    found["worst"] = result.worst
    found["picture"] = classification.pictures(result, info.names, val.to_pixels)["most_confidently_wrong"]
    return found


def evaluation_worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.save(evaluated(rank, 2), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_evaluate_the_whole_split_and_show_its_most_confidently_wrong(tmp_path):
    """Two gloo processes, each its shard of val (ranks hold examples r, r + 2, ...): the figures are one
    process's on the whole split, the wrong images the split's 16 most confident (not rank 0's), and a
    fork's Tally.result that sums alone sums over both. Gathered rows come back in the split's order, bool
    and dict members too."""
    torch.multiprocessing.spawn(evaluation_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                                join=True)
    whole = evaluated(0, 1)
    for rank in (0, 1):
        found = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert found["numbers"].tolist() == list(range(7))
        assert found["flags"]["odd"].dtype == torch.bool and found["flags"]["n"].tolist() == list(range(7))
        assert found["flags"]["odd"].flatten().tolist() == [n % 2 == 1 for n in range(7)]
        for name in ("classification", "multilabel"):
            assert found[name] == pytest.approx(whole[name], rel=1e-6), name
        confidence, inputs, targets, predicted = found["worst"]
        assert confidence.tolist() == pytest.approx(whole["worst"][0].tolist(), rel=1e-5)
        assert torch.equal(inputs, whole["worst"][1]) and torch.equal(targets, whole["worst"][2])
        assert torch.equal(predicted, whole["worst"][3])
        assert (found["picture"] == whole["picture"]).all()


def test_average_precision_under_torchrun_is_the_whole_splits(tmp_path, monkeypatch):
    """tests/forks/multilabel_ap.py (the Tally docs/your_data.md shows): a run's val mAP in one process,
    then best.pt through evaluate.py under torchrun, 2 processes of 72 val examples each: the same figure,
    over all 144 (before gather: rank 0's half's)."""
    shown = next(body for _, body in blocks(read("docs/your_data.md"))
                 if body.startswith("def average_precision("))
    assert shown in (ROOT / "tests" / "forks" / "multilabel_ap.py").read_text()  # the docs' Tally
    add_entries(monkeypatch, "multilabel_data")
    cfg = parse_config([*SMALL, "--dataset", "digit_facts", "--epochs", "1", "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, multilabel_ap)
    command = [*TORCHRUN, "--task", "multilabel_ap", "--entries", "multilabel_data", "evaluate.py",
               "--checkpoint", str(tmp_path / "best.pt"), *SMALL[2:], "--out-dir", str(tmp_path / "eval")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert summary["examples"] == report["examples"] == 144
    assert report["val_map"] == pytest.approx(summary["val_map"], rel=1e-6)
    assert report["ap_per_label"] == pytest.approx(summary["ap_per_label"], rel=1e-6)
