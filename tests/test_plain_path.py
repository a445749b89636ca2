"""The plain path (issue 53), held: a default `python train.py` imports no module an option needs, and reads
no more of the template's machinery than docs/reading.md says. One traced run (tests/reading.py) on digits
with resnet_small and the kept default task; data.py, models.py and task.py, which a fork rewrites, are not
counted."""

import json
import subprocess
import sys

from conftest import ROOT

# What a default run enters of machinery/; every other module there is an option's, entered only where on.
DEFAULT_MACHINERY = {"batches", "checkpoints", "contract", "files", "inputs", "logs", "processes",
                     "run_folder", "stops"}
OPTIONAL_PACKAGES = {"torchvision", "wandb", "mlflow", "matplotlib", "sklearn", "onnx", "onnxruntime"}
# The lines a default run reads of train.py, schedules.py, configs/ and machinery/ (docs/reading.md: 1,788
# when this test was written, 2,058 with data.py, models.py and task.py). A change that adds to this path
# raises the number here and says in docs/reading.md what the default run gained.
MACHINERY_LINES = 1800
FORKS_FILES = {"data.py", "models.py", "task.py"}


def test_a_default_run_enters_no_option_and_reads_no_more_than_it_did(tmp_path):
    record = tmp_path / "reading.json"
    command = ["train.py", "--dataset", "digits", "--model", "resnet_small", "--epochs", "1", "--out-dir",
               str(tmp_path / "run")]
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "reading.py"), str(record), *command],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    reading = json.loads(record.read_text())
    machinery = {name.split(".")[1] for name in reading["modules"] if name.startswith("machinery.")}
    assert machinery <= DEFAULT_MACHINERY, machinery - DEFAULT_MACHINERY
    assert "configs.resolve" not in reading["modules"] and "lr_find" not in reading["modules"]
    assert not OPTIONAL_PACKAGES & {name.split(".")[0] for name in reading["all"]}
    counted = {file: n for file, n in reading["per_file"].items() if file not in FORKS_FILES}
    assert {"train.py", "schedules.py", "configs/__init__.py", "machinery/logs.py"} <= set(counted)
    assert sum(counted.values()) <= MACHINERY_LINES, counted
