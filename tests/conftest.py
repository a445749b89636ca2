import collections
import contextlib
import hashlib
import importlib.util
import os
import re
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


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # a dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


# The tests of the machinery (resume, accumulation, faults, torchrun, signals, checkpoints) train with a
# task of their own, whatever task.py holds: the default task as the template ships it, kept word for word
# in tests/forks/classification.py (tests/test_tasks.py checks it). `import task` gives that copy here, and
# the scripts they start run through tests/launch.py, which does the same. The default task's own tests
# read task.py itself, TEMPLATE_TASK, and skip where a fork has put another task there.
from forks import classification  # noqa: E402

sys.modules["task"] = classification
TEMPLATE_TASK = _module("template_task", ROOT / "task.py")
default_task_only = pytest.mark.skipif(
    TEMPLATE_TASK.NAME != "classification",
    reason=f"task.py holds another task ({TEMPLATE_TASK.NAME!r}): the default task's own tests skip")
LAUNCH = [sys.executable, str(ROOT / "tests" / "launch.py")]  # + "train.py", ...: with the kept task
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *LAUNCH[1:]]

from entries import entries  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402


def build_loaders(cfg, device="cpu", rank: int = 0, world_size: int = 1, *, targets: str = "classes",
                  moves: bool | None = None):
    """(train, val, test, info): cfg.dataset's batches as train.setup() builds them, without the model
    (`targets`, `moves`: the task's TARGETS and TARGETS_MOVE_WITH_IMAGES)."""
    splits, info = train.build_loaders(cfg, data.DATASETS[cfg.dataset](cfg), torch.device(device),
                                         targets=targets, needs=models.input_needs(cfg.model, cfg.pretrained),
                                         shard=(rank, world_size), moves=moves)
    return splits.train, splits.val, splits.test, info


def run_script(script: str, *args: str, timeout: float = 240, env: dict | None = None,
               own_task: bool = False):
    """Run one of the project's scripts as a user would, from the repository root: `train.py`
    as `python train.py`, a module such as `bench.speed` as `python -m bench.speed`. train.py and
    lr_find.py run with the kept default task, unless `own_task` (task.py's, for the default task's tests)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not script.endswith(".py"):
        command = [sys.executable, "-m", script]
    else:
        command = [sys.executable, str(ROOT / script)] if own_task else [*LAUNCH, script]
    return subprocess.run([*command, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


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


def run_evaluate(monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    """evaluate.py's main() in this process, as run_main runs train.py's."""
    import evaluate

    monkeypatch.setattr(sys, "argv", ["evaluate.py", *map(str, argv)])
    code = 0
    try:
        evaluate.main()
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
              model: tuple[str, ...] = (), tests: bool = False) -> Path:
    """A copy of the template edited as a fork would be, the way the README says: task.py replaced by
    tests/forks/TASK.py, each forks/DATA.py dataset entry added at the end of data.py, each
    forks/MODEL.py model class written above MODELS in models.py and its line added to MODELS. Nothing
    else changes. `tests`: the copy has the template's tests, docs and benchmarks too."""
    project = Path(folder) / "fork"
    left_out = [".git", ".venv", ".pytest_cache", ".ruff_cache", "runs", "data", "__pycache__", "mutants"]
    left_out += [] if tests else [".ci", "tests", "docs", "bench"]
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(*left_out))
    if task:
        shutil.copy(FORKS / f"{task}.py", project / "task.py")
    for name in data:
        with open(project / "data.py", "a") as f:
            f.write("\n\n" + (FORKS / f"{name}.py").read_text())
    for name in model:
        snippet = (FORKS / f"{name}.py").read_text()
        cls = snippet.split("class ", 1)[1].split("(", 1)[0]
        source = (project / "models.py").read_text()
        registry = source.index("# Our own models by name")
        source = source[:registry] + snippet + "\n\n" + source[registry:]
        source = re.sub(r"(^MODELS = \{\n.*?)(^\}\n)", rf'\1    "{cls.lower()}": {cls},\n\2', source,
                        count=1, flags=re.S | re.M)
        (project / "models.py").write_text(source)
    return project


def add_entries(monkeypatch, *names: str) -> None:
    """In this process, the dataset and model entries of tests/forks/NAME.py, as make_fork adds them
    to a copy (each runs in its module's names), undone when the test ends."""
    for name in names:
        datasets, found = entries(name)
        for key, value in datasets.items():
            monkeypatch.setitem(data.DATASETS, key, value)
        for key, value in found.items():
            monkeypatch.setitem(models.MODELS, key, value)


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
def signals_end_the_run(monkeypatch):
    """For a test that signals its own process: the run stops as `python train.py` would, with its line and
    exit code, and the signal does not go on to pytest's handler (machinery/stops.py: Ctrl-C would end
    the session, SIGTERM the process)."""
    from machinery.stops import SIGNALS

    monkeypatch.setattr(SIGNALS, "pass_on", False)


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """$TORCH_HOME in a temporary folder, and no network: a download attempt fails as offline."""
    home = tmp_path / "torch"
    monkeypatch.setenv("TORCH_HOME", str(home))

    def offline(url, dst, *args, **kwargs):
        raise urllib.error.URLError("no network here")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    return home
