"""The README and docs/*.md as a reader meets them: every command they give runs, in order, page by page
(or is marked as one that cannot run here), every python block is run or checked by a named test, every
relative link and image resolves, and the README stays a front page."""

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, add_entries, run_main
from PIL import Image
from sklearn.datasets import load_digits

import data
import models

PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]

# A command that cannot run here says why, right after it: `cmd` (MARK...) in prose, or in a block a
# comment with (MARK...) on the line above it or at its end. This test skips those, and only those.
MARKS = ("needs a GPU", "needs GPUs", "downloads", "slow", "runs until stopped")
MARK = r"\((" + "|".join(MARKS) + r")\b[^)`]*\)"

# Every command marked in the pages, page by page: a new mark is a decision to write down here too.
MARKED = {
    "README.md": {
        "python -m bench.figures": "slow",
        "tensorboard --logdir runs": "runs until stopped",
        "python -m bench.speed": "slow",
        "python -m bench.lr_find_rules": "slow",
        "python -m bench.lr_find_rules --seeds 32": "slow",
        "bash tests/mutation.sh": "slow",
    },
    "docs/lr_find.md": {
        "python -m bench.lr_find_rules": "slow",
        "pip install --no-deps torch-lr-finder": "downloads",
    },
    "docs/speed.md": {
        "python -m bench.speed --device cuda": "needs a GPU",
        "python -m bench.speed --device cuda && python -m pytest tests/test_cuda.py": "needs a GPU",
        "python -m bench.speed": "slow",
        "python -m bench.speed --device cpu": "slow",
        "python -m bench.image_files compare /tmp/jpegs --runs 5": "slow",
    },
    "docs/testing.md": {
        "pip install -r requirements-dev.txt && bash tests/mutation.sh": "slow",
    },
    "docs/training.md": {
        "python train.py --config configs/cifar10.toml --epochs 20 --out-dir runs/c10-long": "downloads",
        "torchrun --standalone --nproc_per_node=4 train.py --config configs/cifar10.toml": "needs GPUs",
        "tensorboard --logdir runs": "runs until stopped",
        "python -m bench.speed": "slow",
        "torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 "
        "--rdzv-id=myrun train.py --config configs/cifar10.toml": "needs GPUs",
        "torchrun --standalone --nproc_per_node=4 --max-restarts=3 train.py --config configs/cifar10.toml "
        "--out-dir runs/c10 --resume auto": "needs GPUs",
        "pip install wandb mlflow-skinny": "downloads",
        "python train.py --log-to tensorboard,csv,wandb": "downloads",
        "WANDB_MODE=offline python train.py --log-to wandb --out-dir runs/w": "slow",
        "wandb sync runs/w/wandb/offline-run-*": "downloads",
        "python train.py --log-to mlflow --out-dir runs/m": "slow",
        "mlflow ui --backend-store-uri sqlite:///runs/mlflow.db": "runs until stopped",
        "python train.py --seeds 5 --out-dir runs/base": "slow",
        "python train.py --seeds 5 --label-smoothing 0.1 --out-dir runs/smooth": "slow",
        "python compare_seeds.py runs/base runs/smooth": "slow",
    },
    "docs/your_data.md": {
        "python lr_find.py --dataset imagefolder --data-dir my_images --model resnet18 --pretrained "
        "--out-dir runs/pets": "downloads",
        "python train.py --dataset imagefolder --data-dir my_images --model resnet18 --pretrained "
        "--out-dir runs/pets --lr auto --epochs 5": "downloads",
    },
}

# Every python block in the pages, by its first line, and the test that runs or checks it.
PYTHON_BLOCKS = {
    "class ImageAndTable(nn.Module):  # in models.py, added to MODELS as \"imageandtable\"":
        "test_several_inputs.py::test_the_docs_model_of_two_inputs_trains",
    "import torch": "test_readme.py::test_own_code_example_runs_with_only_the_two_files_copied",
    "found = lr_find(model, optimizer, None, loader, batch_loss=lambda model, batch: model(**batch).loss)":
        "test_docs.py::test_the_batch_loss_lines_run",
    "def waves(cfg: Config) -> Source:  # in data.py: [N, 1, 256] float signals, four frequencies":
        "test_docs.py::test_the_waves_dataset_trains",
    "class TinyNet(nn.Sequential):": "test_models.py::test_a_model_added_as_the_readme_says_trains_by_name",
    "MODELS = {": "test_models.py::test_a_model_added_as_the_readme_says_trains_by_name",
    "OPTIMIZERS = {": "test_models.py::test_the_readme_lists_the_registries_as_they_are",
    "from evaluate import load_trained  # from the template's folder: it builds the model as train.py does":
        "test_docs.py::test_the_load_trained_lines_run",
    "import onnxruntime  # with numpy and pillow: torch is not needed to run the model":
        "test_export.py::test_the_docs_onnxruntime_lines_run",
    "def average_precision(scores: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:":
        "test_distributed.py::test_average_precision_under_torchrun_is_the_whole_splits",
    "def augmented_targets(boxes: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor,":
        "test_any_targets.py::test_boxes_follow_their_images_crops_and_flips_by_the_tasks_augmented_targets",
    "def calls(cfg: Config) -> Source:  # in data.py: [1, 40, T] spectrograms, T from 50 to 200 frames":
        "test_any_targets.py::test_the_docs_variable_length_clips_train_and_without_their_collate_are_one_line",
    "class GAN(nn.Module):": "test_turns.py::test_the_docs_show_the_forks_model",
    "class LengthPooled(nn.Module):  # in models.py, added to MODELS as \"lengthpooled\"":
        "test_any_targets.py::test_the_docs_variable_length_clips_train_and_without_their_collate_are_one_line",
}

SHELL = ("python ", "python3 ", "torchrun ", "pip ", "bash ", "tensorboard ")


def read(page: str) -> str:
    return (ROOT / page).read_text()


def blocks(text: str) -> list[tuple[str, str]]:
    """Each fenced block: (its language, its text)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def commands(page: str) -> list[tuple[str, str | None]]:
    """The page's shell commands in reading order, each once: (command, its mark or None)."""
    text, found = read(page), []
    for lang, body in blocks(text):
        if lang not in ("bash", "sh", "shell"):
            continue
        above = None
        for line in body.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line.startswith("#"):
                above = re.search(MARK, line)
            elif line:
                command, _, comment = line.partition(" #")
                mark = re.search(MARK, comment) or above
                found.append((command.strip(), mark and mark.group(1)))
                above = None
    for match in re.finditer(r"`([^`]+)`(\s*" + MARK + ")?", prose(text)):
        command = " ".join(match.group(1).split())
        if command.startswith(SHELL):
            found.append((command, match.group(3)))
    marks = {}
    for command, mark in found:  # marked once in a page is marked in that page
        marks[command] = marks.get(command) or mark
    return list(marks.items())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder to run the pages' commands in, as a reader would from a fresh checkout: `my_images` as
    the pages describe it (class folders under train/, val/ and test/, here 8x8 digits) and the README's
    TinyNet in MODELS."""
    folder = tmp_path_factory.mktemp("reader")
    digits = load_digits()
    count = {}
    for image, label in zip((digits.images * 255 / 16).astype("uint8"), digits.target, strict=True):
        count[label] = count.get(label, 0) + 1
        at = count[label]  # of each class: 13 to train, 4 to val, 3 to test
        split = "train" if at <= 13 else "val" if at <= 17 else "test" if at <= 20 else None
        if split:
            (folder / "my_images" / split / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / "my_images" / split / str(label) / f"{count[label]:03}.png")
    tinynet = next(body for _, body in blocks(read("README.md")) if body.startswith("class TinyNet"))
    scope = dict(vars(models))
    exec(tinynet, scope)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setitem(models.MODELS, "tinynet", scope["TinyNet"])
        yield folder


def run_python(words: list[str]) -> tuple[int, str]:
    """`python SCRIPT ARGS` for the project's scripts, in this process: (exit code, stderr)."""
    import evaluate
    import lr_find
    import schedules
    import train

    script, args = words[1], words[2:]
    if script == "train.py" and not {"--epochs", "--resume", "--help"} & set(args):
        args = [*args, "--epochs", "1"]  # a page's run, shortened; its own --epochs stays as written
    if script in ("train.py", "lr_find.py") and not {"--model", "--resume", "--help"} & set(args):
        args = [*args, "--width", "8"]  # the default model, a quarter as wide: a page's run is checked to
        # run, not to reach its figures, and takes a third of the time (12 epochs of digits: 4 s, not 13)
    if "my_images" in args and "--predict" not in args:
        args = [*args, "--image-size", "8"]  # the images' own size: at 64 px a sweep takes minutes on CPU
    if script != "schedules.py" and "--help" not in args:
        args = [*args, "--num-workers", "0"]  # in this process, a DataLoader's workers would outlive the run
    main = {"train.py": train.main, "evaluate.py": evaluate.main, "lr_find.py": lambda: lr_find.main(args),
            "schedules.py": lambda: schedules.main(args)}[script]
    err = io.StringIO()
    argv, sys.argv = sys.argv, [script, *args]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main() or 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
        err.write(str(exit_info.code))
    finally:
        sys.argv = argv
    return code, err.getvalue()


def run_step(words: list[str]) -> str | None:
    """One step of a command line: None when it ran, else what went wrong."""
    if words[:3] == ["python3", "-m", "venv"] or words[0] == "." and words[1].endswith("bin/activate"):
        return None  # the virtual environment: this test runs in the one they make
    if words[:3] == ["pip", "install", "-r"]:
        return None if (ROOT / words[3]).exists() else f"no {words[3]}"
    if words == ["python", "-m", "pytest"]:
        return None  # the suite itself, which runs this test; test_ci_runs_the_readme_test_command checks it
    if words[:4] == ["python", "-m", "bench.image_files", "make"]:
        from bench import image_files  # the page's folder, made here in the workspace, 2 images a class

        image_files.main(["make", Path(words[4]).name, "--count", "20"])
        return None
    if words[0] == "python" and words[1] in ("train.py", "evaluate.py", "lr_find.py", "schedules.py"):
        code, err = run_python(words)
        return None if code == 0 else f"exit {code}: {err.strip()[-600:]}"
    return "cannot run here: run it in this test, or mark it (needs a GPU, downloads, slow, ...)"


def steps() -> list[tuple[str, str]]:
    """Each distinct step of the pages' unmarked commands, in reading order, README first: (page, step). A
    later one may use what an earlier one made (a run folder, a sweep), as it would for a reader."""
    found, done = [], set()
    for page in PAGES:
        for command, mark in commands(page):
            for step in [] if mark else (step.strip() for step in command.split("&&")):
                if step not in done:
                    done.add(step)
                    found.append((page, step))
    return found


STEPS = steps()


def test_the_pages_mark_what_this_machine_cannot_run():
    for page in PAGES:
        marked = {command: mark for command, mark in commands(page) if mark}
        assert marked == MARKED.get(page, {}), f"{page}: the marked commands changed; update MARKED"
    assert len(STEPS) > 20, "the pages lost their commands, or this test lost the way to find them"


@pytest.mark.parametrize("page, step", STEPS, ids=[f"{k:02}-{page}" for k, (page, _) in enumerate(STEPS)])
def test_each_command_in_the_pages_runs_or_is_marked(workspace, page, step):
    """One step a test, in the pages' order (the suite shows each as it goes: as one test, 326 s passed in
    silence on a busy machine), all in one workspace."""
    problem = run_step(shlex.split(step))
    assert problem is None, f"{page}: `{step}`: {problem}"


def test_blocks_say_what_they_are():
    """Every python block is one PYTHON_BLOCKS names, each named test exists, and no command hides in a
    block without a language (which the commands test would not run)."""
    seen = set()
    for page in PAGES:
        for lang, body in blocks(read(page)):
            if lang == "python":
                first = body.splitlines()[0]
                assert first in PYTHON_BLOCKS, f"{page}: a python block no test runs: {first}"
                seen.add(first)
            elif lang == "":
                hidden = [line for line in body.splitlines() if line.startswith(SHELL)]
                assert not hidden, f"{page}: commands in a block with no language: {hidden}"
    assert seen == set(PYTHON_BLOCKS), f"PYTHON_BLOCKS names blocks no page has: {set(PYTHON_BLOCKS) - seen}"
    for test in set(PYTHON_BLOCKS.values()):
        file, name = test.split("::")
        assert f"def {name}(" in (ROOT / "tests" / file).read_text(), test


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_images_resolve():
    for page in PAGES:
        text = re.sub(r"`[^`]*`", "", prose(read(page)))
        targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text)
        assert targets, f"{page} links nowhere"
        for target in targets:
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            assert file.resolve().is_relative_to(ROOT) and file.exists(), f"{page}: {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", prose(file.read_text()), re.M)
                assert anchor in map(slug, headings), f"{page}: {target}: no such heading"
    readme = prose(read("README.md"))
    linked = set(re.findall(r"\]\(docs/(\w+\.md)", readme))
    assert linked == {p.removeprefix("docs/") for p in PAGES[1:]}, "every docs page is linked from the README"


def test_the_readme_is_a_front_page():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 220
    headings = re.findall(r"^## (.*)$", prose(readme), re.M)
    order = ["The two commands", "What you get", "Fork it", "What is inside", "Files"]
    assert [h for h in headings if h in order] == order


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "pip install -r requirements-dev.txt && python -m pytest"
    assert any(body == ci + "\n" for lang, body in blocks(read("README.md")) if lang == "bash")


def test_the_waves_dataset_trains(tmp_path, monkeypatch, capsys):
    """The README's dataset, added to data.py as it says, trains a 1-D model by name."""
    waves = next(body for _, body in blocks(read("README.md")) if body.startswith("def waves"))
    scope = {**vars(data), "DATASETS": {}}
    exec(waves, scope)
    monkeypatch.setitem(data.DATASETS, "waves", scope["DATASETS"]["waves"])
    add_entries(monkeypatch, "signals_model")
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "waves", "--model", "conv1dnet",
                              "--synthetic-size", "256", "--epochs", "1", "--device", "cpu",
                              "--out-dir", tmp_path)
    assert code == 0, err
    assert "waves: 204 train / 52 val" in out


def test_the_batch_loss_lines_run():
    """docs/own_code.md's two batch_loss lines, each on a loader of the batches it is written for."""
    from lr_find import lr_find

    block = next(body for page in PAGES for lang, body in blocks(read(page))
                 if body.startswith("found = lr_find(model, optimizer, None, loader, batch_loss="))
    first, second = block.strip().splitlines()
    torch.manual_seed(0)
    x, y, extra = torch.randn(256, 8), torch.randint(0, 3, (256,)), torch.randn(256, 8)

    class Loss(torch.nn.Linear):  # a Hugging Face-like model: keyword inputs, an output with .loss
        def forward(self, inputs, labels):
            return type("Output", (), {"loss": F.cross_entropy(super().forward(inputs), labels)})

    class TwoInputs(torch.nn.Linear):
        def forward(self, inputs, more):
            return super().forward(inputs + more)

    dicts = [{"inputs": a, "labels": b} for a, b in zip(x, y, strict=True)]
    for line, model, dataset in ((first, Loss(8, 3), dicts),
                                 (second, TwoInputs(8, 3), torch.utils.data.TensorDataset(x, y, extra))):
        scope = {"lr_find": lr_find, "F": F, "model": model,
                 "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                 "loader": torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)}
        exec(line, scope)
        assert scope["found"].suggestion is not None, line


def test_the_load_trained_lines_run(tmp_path, monkeypatch, capsys):
    """docs/training.md's own-code lines on a checkpoint train.py just saved: the digits it names."""
    code, _, err = run_main(monkeypatch, capsys, "--epochs", "2", "--width", "8", "--out-dir", tmp_path)
    assert code == 0, err
    block = next(body for lang, body in blocks(read("docs/training.md"))
                 if lang == "python" and "load_trained" in body)
    exec(block.replace("runs/default/best.pt", str(tmp_path / "best.pt")), {})
    named = eval(capsys.readouterr().out.strip())
    assert len(named) == 8 and set(named) <= set("0123456789") and len(set(named)) > 2
