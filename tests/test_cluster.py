"""Nothing lost, round four (issue 41, 21-25): what a review of the torchrun, NCCL and CUDA paths found,
each shown as far as a CPU can show it (the rest runs in tests/test_cuda.py on a GPU): the process
group's timeout, each rank's own GPU and CUDA RNG, DDP without a broadcast per forward, and --seed for
numpy and Python's random too."""

import datetime
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import run_main
from test_work_kept import TINY

import train
from configs import parse_config
from configs.resolve import MAY_CHANGE_ON_RESUME
from machinery import checkpoints, processes, torchrun


def test_the_process_group_waits_as_long_as_dist_timeout_says(monkeypatch):
    assert parse_config([]).dist_timeout == 60 and parse_config(["--dist-timeout", "7.5"]).dist_timeout == 7.5
    assert "dist_timeout" in MAY_CHANGE_ON_RESUME  # a resume may wait longer
    asked = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torchrun, "watch_parent", lambda: None)
    monkeypatch.setattr(dist, "rendezvous", lambda *args: iter([(dist.HashStore(), 0, 1)]))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: asked.update(kwargs))
    processes.start("cpu", 7.5)
    assert asked["timeout"] == datetime.timedelta(minutes=7.5)  # NCCL's own is 10 minutes


@pytest.fixture
def two_gpus_seen_as(monkeypatch):
    """torch.cuda as a process sees it, on a CPU: `seen(n)` GPUs visible, the current one settable."""
    current, rng = [0], {}

    def seen(count: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.__setitem__(0, device.index))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: rng.setdefault(device, torch.tensor(
            [device], dtype=torch.uint8)))
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: rng.__setitem__(device, state))
        return rng

    flags = ((torch.backends.cudnn, "benchmark"), (torch.backends.cudnn, "allow_tf32"),
             (torch.backends.cuda.matmul, "allow_tf32"))  # what pick_device sets: put back after
    before = [getattr(owner, name) for owner, name in flags]
    yield seen
    for (owner, name), value in zip(flags, before, strict=True):
        setattr(owner, name, value)


def test_each_process_takes_a_gpu_it_can_see(two_gpus_seen_as, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    two_gpus_seen_as(2)
    assert processes.pick_device("cuda") == torch.device("cuda", 1)
    two_gpus_seen_as(1)  # Slurm's --gpus-per-task=1: each process sees its own GPU, as cuda:0
    assert processes.pick_device("cuda") == torch.device("cuda", 0)


def test_a_rank_restores_the_cuda_rng_of_its_own_gpu(two_gpus_seen_as, monkeypatch):
    """Rank 0's checkpoint keeps its own GPU's generator, which every rank's equals (seeded alike, drawn
    alike); rank 1 puts it into its own GPU, cuda:1. It restored entry 1 of rank 0's
    get_rng_state_all(), a generator rank 0 never drew from: rank 1's dropout started over."""
    rng = two_gpus_seen_as(2)
    rng[0] = torch.tensor([7], dtype=torch.uint8)  # rank 0 drew from its GPU; cuda:1 as seeded
    state = checkpoints.capture_rng_state()
    assert torch.equal(state["cuda"], rng[0])
    torch.cuda.set_device(torch.device("cuda", 1))  # now rank 1, resuming
    rng[1] = torch.tensor([1], dtype=torch.uint8)
    checkpoints.restore_rng_state(state)
    assert torch.equal(rng[1], torch.tensor([7], dtype=torch.uint8))
    rng[1] = torch.tensor([1], dtype=torch.uint8)
    checkpoints.restore_rng_state({**state, "cuda": [rng[0], torch.tensor([9], dtype=torch.uint8)]})  # older
    assert torch.equal(rng[1], torch.tensor([7], dtype=torch.uint8))


@pytest.mark.filterwarnings("error::FutureWarning")  # torch 2.14 deprecates broadcast_buffers (issue 49)
def test_ddp_broadcasts_no_buffers_each_forward(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        wrapped = torchrun.Torchrun(torch.device("cpu")).parallel(model)
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        assert not wrapped.broadcast_buffers
    finally:
        dist.destroy_process_group()
    assert processes.Alone(torch.device("cpu")).parallel(model) is model  # alone: no wrapper


def test_seed_sets_numpy_and_pythons_random_too(tmp_path, monkeypatch, capsys):
    drawn, real = [], train.DATASETS["synthetic"]

    def synthetic(cfg):  # where a fork's data would draw
        drawn.append((np.random.rand(), random.random()))
        return real(cfg)

    monkeypatch.setitem(train.DATASETS, "synthetic", synthetic)
    for run in ("a", "b"):
        np.random.seed(None)
        random.seed(None)
        code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "1", "--out-dir", tmp_path / run)
        assert code == 0, err
    assert drawn[0] == drawn[1]
