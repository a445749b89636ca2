"""Checkpoints: exact resume after kill -9, atomic writes, safe loading; torchrun with gloo."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, ROOT, TORCHRUN, run_script

from configs import UserError
from machinery import checkpoints, files

RUN = ["--dataset", "synthetic", "--synthetic-size", "512", "--image-size", "16", "--width", "16",
       "--batch-size", "32", "--epochs", "3", "--device", "cpu", "--schedule", "onecycle",
       "--log-every", "4"]


def assert_same_state(a, b, where="checkpoint"):
    """Every tensor torch.equal, every other value ==, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def final_state(path: Path) -> dict:
    """What a checkpoint holds that an interrupted run must reproduce (not its timings)."""
    ckpt = checkpoints.load_checkpoint(path)
    position = {k: ckpt["run"][k] for k in ("epoch", "batch", "step", "best", "start_loss")}
    return {**{k: ckpt[k] for k in ("model", "ema", "optimizer", "scheduler", "scaler")}, **position}


def child_pids(pid: int) -> list[int]:
    if not Path("/proc/self/stat").exists():  # macOS and the BSDs
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in found.split()]
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        if parent == pid:
            children.append(int(stat.parent.name))
    return children


def process_tree(pid: int) -> list[int]:
    children = child_pids(pid)
    return children + [grandchild for child in children for grandchild in process_tree(child)]


def kill_after_first_save(cmd: list[str], ckpt: Path, env=None) -> None:
    """kill -9 the whole job once `ckpt` exists, as a crash of the machine would.

    torchrun starts each worker in a session of its own, so killing torchrun's process group
    alone would leave the workers running: they would finish the run and rewrite `ckpt` while
    the test resumes from it (a resumed run whose ranks read different checkpoints hangs or fails).
    """
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 120
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGSTOP)  # no new workers, no more steps, while the tree is listed
    tree = process_tree(proc.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    deadline = time.monotonic() + 10
    while any(map(running, tree)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(map(running, tree)), f"processes {tree} survived kill -9"


def running(pid: int) -> bool:
    """Whether a process that is not our child still runs (Linux; elsewhere assumed not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie runs no code; its new parent reaps it


def resumed_at(stdout: str) -> int:
    """The step a resumed run says it continued from."""
    line = next(line for line in stdout.splitlines() if line.startswith("resumed from"))
    return int(line.split(" at step ")[1].split()[0])


def test_kill_9_mid_epoch_then_resume_is_bit_identical(tmp_path):
    """With dropout, so the resumed run must also restore the global RNG to match."""
    run = [*RUN, "--dropout", "0.25"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert run_script("train.py", *run, "--out-dir", str(straight)).returncode == 0
    kill_after_first_save([*LAUNCH, "train.py", *run, "--out-dir", str(broken),
                           "--save-every", "5"], broken / "last.pt")
    saved = checkpoints.load_checkpoint(broken / "last.pt")
    assert 0 < saved["step"] < 48 and saved["run"]["batch"] % 16 != 0, "the kill did not land mid-epoch"
    result = run_script("train.py", *run, "--out-dir", str(broken), "--save-every", "5", "--resume")
    assert result.returncode == 0, result.stderr
    assert resumed_at(result.stdout) == saved["step"]
    assert_same_state(final_state(straight / "last.pt"), final_state(broken / "last.pt"))


def test_sigterm_saves_before_exiting(tmp_path):
    proc = subprocess.Popen([*LAUNCH, "train.py", *RUN, "--epochs", "50", "--out-dir",
                             str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "interrupted" in out and "--resume" in out
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] >= 16  # the first save, or a later one
    fresh = run_script("train.py", *RUN, "--epochs", "50", "--out-dir", str(tmp_path))
    assert fresh.returncode == 2 and fresh.stderr.count("\n") == 1
    assert "unfinished run" in fresh.stderr and "--resume" in fresh.stderr


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoints.write_checkpoint({"step": 1, "w": torch.ones(3)}, path)

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.write_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert checkpoints.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


class Trap:
    """Unpickling this calls Path.touch: code execution hidden in a checkpoint."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_checkpoint_that_runs_code_is_refused(tmp_path, script):
    target, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": Trap(target)}, path)
    with pytest.raises(UserError, match="refused") as err:
        checkpoints.load_checkpoint(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    result = script("train.py", "--resume", str(path), "--out-dir", str(tmp_path), "--epochs", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert not target.exists()


def test_truncated_checkpoint_gives_one_line(tmp_path, script):
    path = tmp_path / "last.pt"
    checkpoints.write_checkpoint({"w": torch.randn(1000)}, path)
    path.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(UserError, match="truncated or corrupt") as err:
        checkpoints.load_checkpoint(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    result = script("train.py", "--resume", "--out-dir", str(tmp_path), "--epochs", "1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: checkpoint") and result.stderr.count("\n") == 1


def test_a_file_that_is_no_checkpoint_is_named_so(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"garbage\n")  # torch reads it as a pickle and says "Unsupported operand 103"
    with pytest.raises(UserError) as err:
        checkpoints.load_checkpoint(path)
    assert str(err.value) == (f"checkpoint {path} is not a PyTorch checkpoint (truncated or corrupt?); "
                              "delete it or resume from another file")


def test_resume_refuses_a_different_config(tmp_path, script):
    def run(epochs, *extra):
        return script("train.py", "--dataset", "synthetic", "--synthetic-size", "64", "--image-size",
                      "8", "--batch-size", "32", "--device", "cpu", "--out-dir", str(tmp_path),
                      "--epochs", str(epochs), *extra)

    assert run(1, "--schedule", "constant", "--width", "4").returncode == 0
    refused = run(1, "--schedule", "cosine", "--width", "8", "--resume")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "width: 4 -> 8" in refused.stderr and "schedule: 'constant' -> 'cosine'" in refused.stderr
    longer = run(2, "--schedule", "constant", "--width", "4", "--resume")
    assert longer.returncode == 2 and "epochs: 1 -> 2" in longer.stderr
    allowed = run(2, "--schedule", "constant", "--width", "4", "--resume", "--allow-more-epochs")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4


TRAIN = [*TORCHRUN, "train.py"]
DDP_RUN = ["--dataset", "synthetic", "--synthetic-size", "256", "--image-size", "8", "--width", "8",
           "--batch-size", "32", "--epochs", "2", "--device", "cpu", "--log-every", "2",
           "--num-workers", "0", "--dropout", "0.25"]
DDP_ENV = {"OMP_NUM_THREADS": "1"}


def torchrun(*args, timeout=240):
    return subprocess.run([*TRAIN, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **DDP_ENV})


def test_torchrun_two_processes_gloo_then_resume(tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    result = torchrun(*DDP_RUN, "--out-dir", str(straight))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"] is True
    assert summary["steps"] == 2 * (256 // 32)
    assert result.stdout.count("done:") == 1 and result.stdout.count("epoch 2/2") == 1
    files = sorted(p.name for p in straight.iterdir())
    assert [f for f in files if f.startswith("events.out")].__len__() == 1
    assert [f for f in files if f.endswith(".pt")] == ["best.pt", "last.pt"]
    # the test split through best.pt: rank 0 read it, both ranks ran their shards; one process agrees
    evaluated = run_script("evaluate.py", "--checkpoint", str(straight / "best.pt"), "--split", "test")
    report = json.loads((straight / "eval.json").read_text())
    assert evaluated.returncode == 0 and report["test_size"] == summary["test_size"] == 64, evaluated.stderr
    assert report["test_acc"] == summary["test_acc"]
    assert report["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-5)

    kill_after_first_save([*TRAIN, *DDP_RUN, "--out-dir", str(broken), "--save-every", "3"],
                          broken / "last.pt", env=DDP_ENV)
    saved_step = checkpoints.load_checkpoint(broken / "last.pt")["step"]
    assert saved_step < summary["steps"]
    resumed = torchrun(*DDP_RUN, "--out-dir", str(broken), "--save-every", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_at(resumed.stdout) == saved_step
    again = json.loads((broken / "summary.json").read_text())
    assert again["ranks_in_sync"] is True and again["steps"] == summary["steps"]
    assert again["test_acc"] == summary["test_acc"]
    assert_same_state(final_state(straight / "last.pt"), final_state(broken / "last.pt"))
