"""Models by name: one registry to add yours to, and torchvision models that need a fixed size."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, build_loaders

from configs import UserError, parse_config
from models import build_model


def test_a_model_added_as_the_readme_says_trains_by_name(tmp_path):
    """Follow the README word for word in a copy of the project: its class, its line in MODELS. (A fork's
    own models may be in MODELS too: the README's lines are all there.)"""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    new_class = next(block for block in blocks if "class TinyNet" in block)
    registry = next(block for block in blocks if block.startswith("MODELS = {"))
    line = '    "tinynet": TinyNet,\n'
    project = tmp_path / "project"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".*", "runs", "data", "docs"))
    models = (project / "models.py").read_text()
    current = re.search(r"^MODELS = \{\n.*?^\}\n", models, re.S | re.M).group(0)
    assert line in registry and set(registry.replace(line, "").splitlines()) <= set(current.splitlines()), \
        "the README shows another MODELS"
    (project / "models.py").write_text(models.replace(current, f"{new_class}\n\n{current[:-2]}{line}}}\n"))
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "tests/launch.py", "train.py", "--model", "tinynet", "--epochs",
                             "1", "--device", "cpu", "--out-dir", str(out)], cwd=project,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "tinynet (0.00M params)" in result.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 10  # digits' 1293 in batches of 128


def test_a_fixed_size_model_gets_its_inputs_resized():
    """vit_b_16 takes exactly 224x224: digits' 8x8 images are resized on the device, said once."""
    cfg = parse_config(["--model", "vit_b_16", "--batch-size", "2", "--device", "cpu"])
    batches, _, _, info = build_loaders(cfg, torch.device("cpu"))
    inputs, _ = next(iter(batches))
    assert inputs.shape == (2, 1, 224, 224) and info.input_shape == (1, 224, 224)
    assert info.notes[0] == ("vit_b_16 takes inputs of exactly 224x224 px: the 8x8 images are resized "
                             "to 224x224 on the device")
    model = build_model(cfg, info.input_shape[0], len(info.names)).eval()
    with torch.no_grad():
        assert model(inputs).shape == (2, 10)
    with pytest.raises(UserError, match="exactly 224x224 px; pass --image-size 224"):
        build_loaders(parse_config(["--model", "vit_b_16", "--dataset", "synthetic", "--image-size", "32"]),
                      torch.device("cpu"))


def test_the_readme_lists_the_registries_as_they_are():
    """OPTIMIZERS as the README shows it is in models.py, and every dataset the template defines in data.py's
    DATASETS is named in the README. (What a fork adds, as the README says, need not be.)"""
    import ast

    import models

    readme, source = (ROOT / "README.md").read_text(), (ROOT / "models.py").read_text()
    shown = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                 if block.startswith("OPTIMIZERS = {"))
    current = re.search(r"^OPTIMIZERS = \{\n.*?^\}\n", source, re.S | re.M).group(0)
    assert set(shown.splitlines()) <= set(current.splitlines())
    assert set(re.findall(r'^    "(\w+)": OptimizerEntry', shown, re.M)) <= set(models.OPTIMIZERS)
    literal = next(node.value for node in ast.parse((ROOT / "data.py").read_text()).body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "DATASETS")
    fork_it = readme.split("## Fork it")[1].split("\n## ")[0]
    assert [key.value for key in literal.keys if f"`{key.value}`" not in fork_it] == []
