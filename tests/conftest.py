import collections
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import data  # noqa: E402, F401  (fills configs.REGISTRIES, which parse_config reads)
import models  # noqa: E402, F401


def run_script(script: str, *args: str, timeout: float = 240, env: dict | None = None):
    """Run one of the project's scripts as a user would, from the repository root: `train.py`
    as `python train.py`, a module such as `bench.speed` as `python -m bench.speed`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]
    return subprocess.run([sys.executable, *command, *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    """train.py's main() in this process, as `python train.py ARGV` would run it: (exit code, stdout,
    stderr), the code 0 when main() returns."""
    import train

    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, argv)])
    code = 0
    try:
        train.main()
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def fingerprint(folder) -> dict[str, str]:
    """Each checkpoint's hash: equal before and after means no checkpoint was touched."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).glob("*.pt"))}


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def script():
    return run_script


FORKS = ROOT / "tests" / "forks"


def make_fork(folder: Path, task: str | None = None, data: tuple[str, ...] = (),
              model: tuple[str, ...] = ()) -> Path:
    """A copy of the template edited as a fork would be: task.py replaced by tests/forks/TASK.py, each
    forks/DATA.py dataset entry added at the end of data.py, each forks/MODEL.py model entry added to
    models.py with its line in MODELS. Nothing else changes."""
    project = Path(folder) / "fork"
    skip = shutil.ignore_patterns(".*", "runs", "data", "tests", "docs", "bench", "__pycache__", "mutants")
    shutil.copytree(ROOT, project, ignore=skip)
    if task:
        shutil.copy(FORKS / f"{task}.py", project / "task.py")
    for name in data:
        with open(project / "data.py", "a") as f:
            f.write("\n\n" + (FORKS / f"{name}.py").read_text())
    for name in model:
        snippet = (FORKS / f"{name}.py").read_text()
        cls = snippet.split("class ", 1)[1].split("(", 1)[0]
        with open(project / "models.py", "a") as f:
            f.write(f"\n\n{snippet}\n\nMODELS[{cls.lower()!r}] = {cls}\n")
    return project


def add_entries(monkeypatch, *names: str) -> None:
    """In this process, the dataset and model entries of tests/forks/NAME.py, as make_fork adds them
    to a copy (each runs in its module's names), undone when the test ends."""

    for name in names:
        module = models if name.endswith("_model") else data
        scope = {**vars(module), "DATASETS": {}, "MODELS": {}}
        exec((FORKS / f"{name}.py").read_text(), scope)
        for key, value in scope["DATASETS"].items():
            monkeypatch.setitem(data.DATASETS, key, value)
        for key, value in scope.items():
            if isinstance(value, type) and issubclass(value, models.nn.Module) and key not in vars(models):
                monkeypatch.setitem(models.MODELS, key.lower(), value)


class Ops(TorchDispatchMode):
    """Counts the aten ops run while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def crash_at_step(monkeypatch, step: int):
    """Within the block, train.py's optimizer step number `step` raises (the machine went away): the
    steps before it ran, the checkpoints saved by then are all a resume has."""
    import train

    real, calls = train.optimizer_step, [0]

    def crashing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            raise RuntimeError("the machine went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", crashing)
    try:
        with pytest.raises(RuntimeError, match="went away"):
            yield
    finally:
        monkeypatch.setattr(train, "optimizer_step", real)


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """$TORCH_HOME in a temporary folder, and no network: a download attempt fails as offline."""
    home = tmp_path / "torch"
    monkeypatch.setenv("TORCH_HOME", str(home))

    def offline(url, dst, *args, **kwargs):
        raise urllib.error.URLError("no network here")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    return home
