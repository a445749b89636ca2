"""Nothing lost, round two: one run per folder, a resume that checks its data, every signal in every
phase. Each case ends in a correct result, or one stderr line with no traceback and every existing
checkpoint unchanged (by hash); where a run had trained, its last.pt loads and resumes to the end."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, ROOT, fingerprint, run_main, run_script

import train
from configs import parse_config
from machinery import checkpoints, run_folder

TINY = ["--dataset", "synthetic", "--synthetic-size", "64", "--num-classes", "2", "--image-size", "8",
        "--width", "4", "--batch-size", "16", "--device", "cpu", "--num-workers", "0"]  # 4 steps an epoch


def one_line(code, err: str, status: int = 2) -> str:
    assert code == status and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    assert "Traceback" not in err
    return err


def unfinished(out_dir, monkeypatch, steps: int = 2, *argv) -> dict:
    """A run of 3 epochs that crashed after `steps` steps, with last.pt saved at `steps`."""
    real, calls = train.optimizer_step, [0]

    def crash(*args, **kwargs):
        calls[0] += 1
        if calls[0] > steps:
            raise RuntimeError("the machine went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", crash)
    with pytest.raises(RuntimeError):
        train.train(parse_config([*TINY, "--epochs", "3", "--save-every", str(steps), *argv,
                                  "--out-dir", str(out_dir)]))
    monkeypatch.setattr(train, "optimizer_step", real)
    return fingerprint(out_dir)


def test_resume_into_another_unfinished_run_is_refused(tmp_path, monkeypatch, capsys):
    unfinished(tmp_path / "a", monkeypatch)
    kept = unfinished(tmp_path / "b", monkeypatch, 3)
    code, out, err = run_main(monkeypatch, capsys, "--resume", tmp_path / "a" / "last.pt", "--out-dir",
                              tmp_path / "b")
    line = one_line(code, err)
    assert f"{tmp_path / 'b' / 'last.pt'} holds an unfinished run (step 3 of 12)" in line
    assert f"resuming {tmp_path / 'a' / 'last.pt'} there would overwrite" in line
    assert fingerprint(tmp_path / "b") == kept and not (tmp_path / "b" / ".lock").exists()
    code, out, err = run_main(monkeypatch, capsys, "--resume", tmp_path / "a" / "last.pt", "--out-dir",
                              tmp_path / "c")
    assert code == 0 and json.loads((tmp_path / "c" / "summary.json").read_text())["steps"] == 12


def test_a_second_run_in_the_folder_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([*LAUNCH, "train.py", *TINY, "--epochs", "500", "--save-every", "2",
                              "--out-dir", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # its last.pt of an unfinished run is there as well: the live run's lock is what the refusal names
    while not (out / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    second = run_script("train.py", *TINY, "--epochs", "1", "--out-dir", str(out))
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"is in use by another run (process {first.pid})" in second.stderr
    first.send_signal(signal.SIGTERM)
    out_text, err_text = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM and "interrupted at step" in out_text, err_text
    assert not (out / ".lock").exists(), "the lock outlived its run"

    other = tmp_path / "other"
    other.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (other / ".lock").write_text(f"{dead} {socket.gethostname()}")  # a kill -9'd run's
    stale = other / f".last.pt.{dead}.tmp"  # and the save it was killed in
    stale.write_bytes(b"x" * 1000)
    assert run_script("train.py", *TINY, "--epochs", "1", "--out-dir", str(other)).returncode == 0
    assert not stale.exists() and not (other / ".lock").exists()
    (other / ".lock").write_text("123 another-machine")
    elsewhere = run_script("train.py", *TINY, "--epochs", "1", "--out-dir", str(other))
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert "in use by a run on another-machine (process 123)" in elsewhere.stderr
    assert f"delete {other / '.lock'}" in elsewhere.stderr


def image_run(root: Path, counts: dict[str, int]) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for k, (name, count) in enumerate(counts.items()):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count if split == "train" else 2):
                value = 40 + 150 * k + i % 10
                Image.new("RGB", (8, 8), (value,) * 3).save(root / split / name / f"{i}.png")


@pytest.mark.parametrize("change, shown", [
    ({"dark": 12, "light": 8}, "train size 16 -> 20; batches 4 -> 5"),
    ({"dark": 4, "light": 8}, "train size 16 -> 12; batches 4 -> 3"),
    ({"dark": 8, "light": 8, "mid": 4}, "2 -> 3 classes (['dark', 'light'] -> ['dark', 'light', 'mid'])"),
], ids=["gained", "lost", "a new class"])
def test_a_resume_on_other_data_is_one_line(change, shown, tmp_path, monkeypatch, capsys):
    data = tmp_path / "images"
    image_run(data, {"dark": 8, "light": 8})
    argv = ["--dataset", "imagefolder", "--data-dir", data, "--image-size", "8", "--batch-size", "4"]
    kept = unfinished(tmp_path / "run", monkeypatch, 2, *map(str, argv))
    shutil.rmtree(data)
    image_run(data, change)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path / "run")
    line = one_line(code, err)
    assert "was trained on other data" in line and shown in line, line
    assert fingerprint(tmp_path / "run") == kept


def test_resuming_a_complete_run_says_so_and_changes_nothing(tmp_path, monkeypatch, capsys):
    train.train(parse_config([*TINY, "--epochs", "1", "--out-dir", str(tmp_path)]))
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    assert code == 0 and err == "" and "holds a complete run (1 epochs, step 4): nothing to do" in out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path, "--epochs", "2")
    assert "epochs: 1 -> 2" in one_line(code, err)  # onecycle is shaped by the run's length


def interrupt(argv: list[str], out_dir: Path, sig: int, group: bool = False,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """train.py ARGV, sent `sig` once its first checkpoint is on disk (to its whole process group,
    DataLoader workers included, with group), and waited for; `env` on top of this process's."""
    proc = subprocess.Popen([*LAUNCH, "train.py", *argv, "--out-dir", str(out_dir)], cwd=ROOT,
                            env={**os.environ, **(env or {})},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=group)
    deadline = time.monotonic() + 120
    while not (out_dir / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("sig, group, workers", [
    (signal.SIGHUP, False, "0"),  # a dropped ssh session
    (signal.SIGTERM, True, "2"),  # systemd, Slurm, kill -TERM -PGID: the workers get it too
], ids=["sighup", "sigterm-to-the-group-with-workers"])
def test_a_signal_saves_then_stops_and_the_run_resumes(sig, group, workers, tmp_path):
    argv = [*TINY, "--epochs", "40", "--save-every", "3", "--num-workers", workers, "--loader", "dataloader"]
    stopped = interrupt(argv, tmp_path, sig, group)
    assert stopped.returncode == 128 + sig, stopped.stderr[-2000:]
    assert "interrupted at step" in stopped.stdout and "Traceback" not in stopped.stderr, stopped.stderr
    step = checkpoints.load_checkpoint(tmp_path / "last.pt")["step"]
    assert f"interrupted at step {step};" in stopped.stdout
    done = run_script("train.py", "--resume", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 160


def test_a_signal_in_the_last_evaluation_stops_after_its_save(signals_end_the_run, tmp_path, monkeypatch,
                                                               capsys):
    real, calls = train.evaluate, [0]

    def evaluate(*args):
        calls[0] += 1
        if calls[0] == 2:  # the last epoch's
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(train, "evaluate", evaluate)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--out-dir", tmp_path)
    assert code == 128 + signal.SIGTERM and "interrupted at step 8; saved" in out, (code, out, err)
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["run"]["epoch"] == 2


def test_a_second_signal_waits_for_the_save_it_arrives_in(signals_end_the_run, tmp_path, monkeypatch, capsys):
    """Ctrl-C at step 3, and again while the interrupt's save writes: the save ends whole, then the run
    stops; a third Ctrl-C after a save stops it at once, in one line."""
    real_step, real_save, steps = train.optimizer_step, checkpoints.write_checkpoint, [0]

    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    def save(state, path):
        os.kill(os.getpid(), signal.SIGINT)  # the second, mid-save
        real_save(state, path)

    monkeypatch.setattr(train, "optimizer_step", step)
    monkeypatch.setattr(checkpoints, "write_checkpoint", save)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--out-dir", tmp_path)
    assert code == 128 + signal.SIGINT and "interrupted at step 3; saved" in out, (code, out, err)
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 3
    monkeypatch.setattr(checkpoints, "write_checkpoint", real_save)

    def twice(*args, **kwargs):  # a first signal, then a second one before the step ends
        steps[0] += 1
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", twice)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    line = one_line(code, err, 128 + signal.SIGINT)
    assert "interrupted again by SIGINT: stopped at once at step 3" in line and "holds step 3" in line
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 3



CTRL_C_IN_A_SUITE = """
import os, signal, sys
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from forks import classification  # the tests' task, as conftest.py sets it
sys.modules["task"] = classification
import train
from configs import parse_config

def test_a_run_stopped_by_ctrl_c(tmp_path):
    real, calls = train.optimizer_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the terminal that runs pytest
        return real(*args, **kwargs)

    train.optimizer_step = step
    argv = [*{argv!r}, "--out-dir", {out!r}]
    if {through_main!r}:
        sys.argv = ["train.py", *argv]
        train.main()
    else:
        train.train(parse_config(argv))

def test_the_next_one():
    open({marker!r}, "w").close()
"""


def test_ctrl_c_during_a_run_inside_pytest_stops_the_suite(tmp_path):
    """Issue 49: a run inside a test (here train.py's main(), called in-process) saves and stops on Ctrl-C,
    then passes the signal on to pytest's handler, which ends the session: no later test runs."""
    marker, out = tmp_path / "ran-on", tmp_path / "run"
    (tmp_path / "test_inner.py").write_text(CTRL_C_IN_A_SUITE.format(
        root=str(ROOT), argv=[*TINY, "--log-to", "csv"], out=str(out), through_main=True, marker=str(marker)))
    suite = subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "test_inner.py"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert suite.returncode == pytest.ExitCode.INTERRUPTED and "KeyboardInterrupt" in suite.stdout, (
        suite.stdout[-3000:], suite.stderr[-2000:])
    assert not marker.exists() and "interrupted at step 3; saved" in suite.stdout
    assert checkpoints.load_checkpoint(out / "last.pt")["step"] == 3


@pytest.mark.parametrize("through_main", [True, False], ids=["main", "train"])
def test_a_run_started_in_process_passes_ctrl_c_on_once_saved(through_main, tmp_path, monkeypatch, capsys):
    """train.py's main() and train() called in-process stop as the script does (saved, one line), then
    raise the KeyboardInterrupt that Python's own handler, put back, raises for the SIGINT."""
    real, calls = train.optimizer_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", step)
    argv = [*TINY, "--log-to", "csv", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(KeyboardInterrupt):
        train.main() if through_main else train.train(parse_config(argv))
    assert f"interrupted at step 3; saved {tmp_path / 'last.pt'}" in capsys.readouterr().out
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # pytest's, put back

@pytest.mark.parametrize("where", ["start-up", "the optimizer's building"])
def test_ctrl_c_outside_the_loop_is_one_line(where, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build_loaders" if where == "start-up" else "build_optimizer", interrupted)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--out-dir", tmp_path)
    assert "interrupted by SIGINT outside the training loop" in one_line(code, err, 128 + signal.SIGINT)
    assert not list(tmp_path.glob("*.pt"))


def test_the_lock_is_one_per_process_and_released_at_exit(tmp_path):
    run_folder.claim(tmp_path / "a")
    run_folder.claim(tmp_path / "a")  # this process's own lock: taken again
    assert (tmp_path / "a" / ".lock").read_text().split()[0] == str(os.getpid())
    folder = str(tmp_path / "b")
    script = f"from machinery import run_folder; from pathlib import Path; run_folder.claim(Path({folder!r}))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "b").exists(), "the folder made for the lock outlived it"


def test_torch_loads_a_checkpoint_written_while_signals_are_held(tmp_path):
    torch.manual_seed(0)  # a plain save of train.py's format round-trips (weights_only)
    train.train(parse_config([*TINY, "--epochs", "1", "--out-dir", str(tmp_path)]))
    assert torch.load(tmp_path / "last.pt", weights_only=True)["data"] == {
        "train_size": 64, "val_size": 16, "test_size": 16, "batches": 4, "names": ["0", "1"], "files": None,
        "train_digests": None}


def test_a_closed_output_stops_the_run_after_its_save(tmp_path):
    """`python train.py | head`: the reader ends after the first epoch's line; the next line, epoch 2's,
    comes after epoch 2's save, so its work is kept, and the run ends as SIGPIPE would end it, in one
    line on stderr (a BrokenPipeError traceback, and epoch 2 lost, before)."""
    proc = subprocess.Popen([*LAUNCH, "train.py", *TINY, "--epochs", "3", "--out-dir", str(tmp_path)],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    while not proc.stdout.readline().startswith("epoch 1/"):
        pass
    proc.stdout.close()  # as head does once it has its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
    assert err.startswith("error: the output was closed") and err.count("\n") == 1, err
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["run"]["epoch"] == 2
