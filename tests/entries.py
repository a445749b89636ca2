"""The dataset and model entries in tests/forks/NAME_data.py and NAME_model.py, read as a fork adds them
to data.py and models.py (each snippet runs in its module's names): conftest.add_entries and
tests/launch.py register them in this process."""

from pathlib import Path

import data
import models

FORKS = Path(__file__).resolve().parent / "forks"


def entries(name: str) -> tuple[dict, dict]:
    """(datasets by name, models by name) that tests/forks/NAME.py defines."""
    module = models if name.endswith("_model") else data
    scope = {**vars(module), "DATASETS": {}, "MODELS": {}}
    exec((FORKS / f"{name}.py").read_text(), scope)
    found = {key.lower(): value for key, value in scope.items()
             if isinstance(value, type) and issubclass(value, models.nn.Module) and key not in vars(models)}
    return scope["DATASETS"], found
