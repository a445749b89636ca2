"""Elastic runs (issue 34), on CPU with gloo, loopback only: one command for a first start and every
restart (`--resume auto`), torchrun's restarts continue the run to the weights of an uninterrupted one,
two torchrun agents (two nodes) on one machine train as one node of two processes, a kill -9 of
torchrun leaves no worker training on, and SIGUSR1 (Slurm's warning before a time limit) saves."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, ROOT, TORCHRUN
from test_resume import assert_same_state, final_state
from test_work_kept import interrupt

from configs import parse_given

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find workers")

RUN = ["--dataset", "synthetic", "--synthetic-size", "256", "--image-size", "8", "--width", "8",
       "--batch-size", "32", "--epochs", "3", "--device", "cpu", "--log-every", "2", "--num-workers", "0",
       "--save-every", "3", "--ema", "0.9"]  # 24 steps; last.pt at 3, 6, ... and each epoch's end; an average
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ELASTIC = [sys.executable, "-m", "torch.distributed.run"]


def workers(agent: int) -> dict[int, int]:
    """The processes torchrun's agent started, by their RANK."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent:
                variables = (stat.parent / "environ").read_text().split("\0")
                rank = dict(v.split("=", 1) for v in variables if "=" in v)["RANK"]
                found[int(rank)] = int(stat.parent.name)
        except (OSError, IndexError, ValueError, KeyError):
            continue  # gone meanwhile, or not a worker
    return found


def started(command: list[str], out_dir: Path, **options) -> subprocess.Popen:
    """A torchrun command, once its first last.pt is on disk."""
    proc = subprocess.Popen(command, cwd=ROOT, env=options.pop("env", ENV), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **options)
    deadline = time.monotonic() + 120
    while not (out_dir / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict:
    """Two processes on one node, uninterrupted: what every elastic run here must end with."""
    out = tmp_path_factory.mktemp("one_node")
    result = subprocess.run([*TORCHRUN, "train.py", *RUN, "--out-dir", str(out)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_state(out / "last.pt")


def test_a_killed_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(one_node, tmp_path):
    """kill -9 of rank 1 under --max-restarts 1: torchrun stops rank 0 (which keeps last.pt whole, and
    saves the step it finished where that needs no collective), then starts both again with the same
    command, whose --resume auto continues from last.pt."""
    command = [*ELASTIC, "--standalone", "--nproc_per_node=2", "--max-restarts=1", *LAUNCH[1:], "train.py",
               *RUN, "--resume", "auto", "--out-dir", str(tmp_path)]
    proc = started(command, tmp_path)
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "--resume auto: no" in out and "resumed from" in out
    assert "Traceback" not in err
    assert_same_state(final_state(tmp_path / "last.pt"), one_node)


def test_two_agents_on_loopback_train_as_one_node_of_two(one_node, tmp_path):  # (--ema: the same average)
    """`--nnodes 2` with c10d's rendezvous on 127.0.0.1: two torchrun agents of one process each, as two
    machines of one GPU would run, end with the weights of one agent's two processes."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [*ELASTIC, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-agents", *LAUNCH[1:], "train.py", *RUN,
               "--out-dir", str(tmp_path)]
    agents = [subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    for agent in agents:
        _, err = agent.communicate(timeout=240)
        assert agent.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"] is True
    assert_same_state(final_state(tmp_path / "last.pt"), one_node)


def test_a_kill_9_of_torchrun_leaves_no_worker_training_on(tmp_path):
    """The workers see their agent gone, save at their next log point and stop: none is alive 15 s later,
    and last.pt is whole."""
    proc = started([*TORCHRUN, "train.py", *RUN, "--epochs", "100", "--out-dir", str(tmp_path)], tmp_path)
    pids = list(workers(proc.pid).values())
    assert len(pids) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
              for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == [], "workers trained on without their agent"
    assert final_state(tmp_path / "last.pt")["step"] < 100 * 8


def test_the_same_command_starts_a_run_and_continues_it_after_sigusr1(tmp_path):
    """A Slurm job's script, as it runs it: `train.py ... --resume auto` starts the run; SIGUSR1 before
    the time limit saves and stops it; the requeued job runs the same command, which continues it."""
    argv = [*RUN, "--resume", "auto", "--epochs", "4"]
    stopped = interrupt(argv, tmp_path, signal.SIGUSR1)
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stderr[-2000:]
    assert "--resume auto: no" in stopped.stdout and "interrupted at step" in stopped.stdout
    again = subprocess.run([*LAUNCH, "train.py", *argv, "--out-dir", str(tmp_path)], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 * 8 and summary["parts"] == 2
    complete = subprocess.run([*LAUNCH, "train.py", *argv, "--out-dir", str(tmp_path)], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=240)
    assert complete.returncode == 0 and "holds a complete run" in complete.stdout


def test_the_slurm_script_in_the_docs_runs_one_command_for_every_start():
    """docs/training.md's job script: requeued when preempted, warned before its time limit, and its
    torchrun line restarts and continues the run with flags train.py takes."""
    page = (ROOT / "docs" / "training.md").read_text()
    script = next(block for block in re.findall(r"```text\n(.*?)```", page, re.S) if "#SBATCH" in block)
    assert "--requeue" in script and "--signal=B:USR1@" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    words = shlex.split(script.replace("\\\n", " ").split("torchrun", 1)[1].split("&")[0])
    assert "--max-restarts=3" in words and words[words.index("train.py") + 1:][-2:] == ["--resume", "auto"]
    given = parse_given(words[words.index("train.py") + 1:])
    assert given["resume"] == "auto" and given["out_dir"] == "runs/c10"


def test_a_torchrun_restart_continues_the_same_wandb_run_from_rank_0_alone(tmp_path):
    """Issue 43: --log-to wandb under torchrun: rank 0 alone opens a W&B run (offline here), and after a
    kill -9 of rank 1 and torchrun's restart, the same command continues that run: one run id, kept in
    last.pt. (The flag is --log-to, not --log: torchrun's parser reads --log, even after train.py, as an
    ambiguous abbreviation of its own --log-dir and --log-line-prefix-template.)"""
    pytest.importorskip("wandb")
    command = [*ELASTIC, "--standalone", "--nproc_per_node=2", "--max-restarts=1", *LAUNCH[1:], "train.py",
               *RUN, "--log-to", "tensorboard,csv,wandb", "--resume", "auto", "--out-dir", str(tmp_path)]
    proc = started(command, tmp_path, env={**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0 and "resumed from" in out, err[-3000:]
    run_id = torch.load(tmp_path / "last.pt", weights_only=True)["trackers"]["wandb"]
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs  # one per start


def test_a_worker_lost_in_the_test_pass_is_restarted_and_the_run_finishes(tmp_path):
    """Issue 41.3: kill -9 of rank 1 in the test pass (after the last save) under --max-restarts 1: the
    restart's --resume auto finds every step in last.pt but no summary, and finishes the run: the test
    pass through best.pt and summary.json (it said "complete run: nothing to do" and wrote none)."""
    command = [*ELASTIC, "--standalone", "--nproc_per_node=2", "--max-restarts=1", *LAUNCH[1:], "--task",
               "dies_in_test", "train.py", *RUN, "--resume", "auto", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the test pass and summary.json next" in result.stdout, result.stdout[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 24 and "test_acc" in summary and summary["world_size"] == 2
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
