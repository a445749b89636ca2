"""`python tests/launch.py [--task NAME] [--entries A,B] SCRIPT ARGS...`: one of the template's scripts
(train.py, lr_find.py) run as `python SCRIPT ARGS...` would run it, with tests/forks/NAME.py in place of
task.py (by default the default task's kept copy, classification.py, as conftest.py does for the tests
themselves), and the dataset and model entries of tests/forks/A.py, B.py added: the tests that start
scripts (signals, torchrun, command lines) pass whatever task.py holds. `--rank0-late S`: under torchrun,
rank 0 reports its one line S seconds late, as a slow or busy machine may (the race the root-cause test
holds open)."""

import importlib
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from entries import entries  # noqa: E402

import data  # noqa: E402 (after the path it is found on)
import models  # noqa: E402

args = sys.argv[1:]
task = "forks.classification"
while args[0].startswith("--"):
    option, value, *args = args
    if option == "--task":
        task = f"forks.{value}"
    if option == "--rank0-late" and os.environ.get("RANK") == "0":
        import machinery.stops

        def late(*line, report=machinery.stops.exit_with_error, seconds=float(value)):
            time.sleep(seconds)
            report(*line)

        machinery.stops.exit_with_error = late
    for name in value.split(",") if option == "--entries" else ():
        datasets, found = entries(name)
        data.DATASETS.update(datasets)
        models.MODELS.update(found)
sys.modules["task"] = importlib.import_module(task)
script = str(ROOT / args[0])
sys.argv = [script, *args[1:]]
runpy.run_path(script, run_name="__main__")
