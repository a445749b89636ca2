"""Device and AMP choice, ranks in sync, RNG states in checkpoints."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from configs import UserError
from machinery import checkpoints, precision, processes


def test_ranks_agree_in_a_one_process_group(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        nn.parallel.DistributedDataParallel(model)
        assert processes.ranks_agree(model)
    finally:
        dist.destroy_process_group()


def ranks_agree_worker(rank: int, store: str, out_dir: str) -> None:
    """One of two gloo processes: the verdicts of ranks_agree as rank 1 drifts by one ulp."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same model on both ranks
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        verdicts = [processes.ranks_agree(model)]
        for tensor in (model[0].weight, model[1].running_mean):  # a parameter, then a buffer
            before = tensor.detach().clone()
            if rank == 1:
                with torch.no_grad():
                    tensor.view(-1)[1] = torch.nextafter(tensor.view(-1)[1], torch.tensor(math.inf))
            verdicts.append(processes.ranks_agree(model))
            with torch.no_grad():
                tensor.copy_(before)
        verdicts.append(processes.ranks_agree(model))
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
    assert precision.amp_setup(cpu, "auto") == (None, None)
    assert precision.amp_setup(cpu, "off") == (None, None)
    assert precision.amp_setup(cpu, "bf16") == (torch.bfloat16, None)
    dtype, scaler = precision.amp_setup(cpu, "fp16")
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
