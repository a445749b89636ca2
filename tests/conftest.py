import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_script(script: str, *args: str, timeout: float = 240, env: dict | None = None):
    """Run one of the project's scripts as a user would, from the repository root: `train.py`
    as `python train.py`, a module such as `bench.speed` as `python -m bench.speed`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]
    return subprocess.run([sys.executable, *command, *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def script():
    return run_script
