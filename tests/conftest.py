import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
