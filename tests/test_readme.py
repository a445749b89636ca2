"""The code for your own project (docs/own_code.md, linked from the README) runs as printed, from a
folder holding only the two files it says to copy, and trains."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

OWN_CODE = ("docs/own_code.md", "# `lr_find.py` and `schedules.py` in your own code")


def python_block(page: str, heading: str) -> str:
    """The first python block under HEADING in PAGE."""
    section = (ROOT / page).read_text().split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_own_code_example_runs_with_only_the_two_files_copied(tmp_path):
    for name in ("lr_find.py", "schedules.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    check = "\nprint('accuracy', (model(inputs).argmax(1) == data.tensors[1]).float().mean().item())\n"
    (tmp_path / "example.py").write_text(python_block(*OWN_CODE) + check)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-E", "example.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    peak, cosine, accuracy = re.fullmatch(
        r"onecycle peak (\S+) \(minimum\), cosine start (\S+)\naccuracy (\S+)\n", proc.stdout).groups()
    assert float(peak) / float(cosine) == pytest.approx(3, rel=0.01)  # the SGD rules
    assert float(accuracy) > 0.8, "a chance-level run (0.1) means the rate or the schedule is wrong"
