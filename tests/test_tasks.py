"""The machinery through each task: the default classification and two forks' tasks (tests/forks/:
regression with MSE and MAE, multi-label with BCE and F1), each trained through the same train.py.
Resume is bit-identical after a crash, k micro-batches step as one batch k times larger, nothing is
read from the device between log points, and a diverged run stops in one line with its checkpoint
intact. The commands themselves, in a copied fork, are tests/test_forks.py's."""

import contextlib
import io
import re

import pytest
import torch
from conftest import ROOT, TEMPLATE_TASK, add_entries, crash_at_step, default_task_only, fingerprint
from forks import binned, boxes, keypoints, multilabel, multilabel_ap, regression, reversal, weighted
from test_resume import assert_same_state, final_state
from test_sync import per_step

import task as classification
import train
from configs import Config, UserError, parse_given, validate
from machinery import checkpoints

TASKS = {  # the task module, the dataset entry it needs (if any), its data flags
    "classification": (classification, None,
                       ["--dataset", "synthetic", "--image-size", "8", "--num-classes", "4"]),
    "regression": (regression, "regression_data", ["--dataset", "square_positions", "--lr", "0.02"]),
    "multilabel": (multilabel, "multilabel_data", ["--dataset", "digit_facts"]),
}
SMALL = ["--width", "4", "--device", "cpu", "--num-workers", "0"]


def use(name: str, monkeypatch):
    module, entry, flags = TASKS[name]
    if entry:
        add_entries(monkeypatch, entry)
    return module, flags


@pytest.fixture(params=TASKS)
def case(request, monkeypatch):
    return use(request.param, monkeypatch)


def quietly(argv: list[str], task) -> dict:
    """train.train as `python train.py ARGV` runs it, with `task` for task.py, its printing silenced."""
    given = parse_given(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        return train.train(Config(**given) if given.get("resume") else validate(Config(**given)), given, task)


def test_a_crashed_run_resumes_to_the_same_weights(case, tmp_path, monkeypatch):
    task, flags = case
    argv = [*flags, *SMALL, "--synthetic-size", "96", "--batch-size", "32", "--epochs", "3", "--dropout",
            "0.2", "--save-every", "2"]
    quietly([*argv, "--out-dir", str(tmp_path / "straight")], task)
    with crash_at_step(monkeypatch, 5):
        quietly([*argv, "--out-dir", str(tmp_path / "broken")], task)
    assert checkpoints.load_checkpoint(tmp_path / "broken" / "last.pt")["step"] == 4  # mid-epoch
    summary = quietly(["--resume", "--out-dir", str(tmp_path / "broken")], task)
    assert summary["parts"] == 2 and f"best_val_{task.MAIN_METRIC}" in summary
    assert_same_state(final_state(tmp_path / "straight" / "last.pt"),
                      final_state(tmp_path / "broken" / "last.pt"))


@pytest.mark.parametrize("name", ["classification", "regression"])  # 48 examples: whole batches of 24
def test_micro_batches_step_as_one_batch(name, tmp_path, monkeypatch):
    """--batch-size 24 against --batch-size 8 --accum-steps 3, BatchNorm-free so the two agree."""
    from test_accumulation import bn_free_net

    task, flags = use(name, monkeypatch)
    monkeypatch.setattr(train, "build_model",
                        lambda cfg, channels, outputs, device, **_: bn_free_net(channels, outputs))
    runs = []
    batches = {"whole": ["--batch-size", "24"], "micro": ["--batch-size", "8", "--accum-steps", "3"]}
    for run, batch in batches.items():
        quietly([*flags, *SMALL, "--synthetic-size", "48", "--epochs", "2", *batch,
                 "--out-dir", str(tmp_path / run)], task)
        runs.append(checkpoints.load_checkpoint(tmp_path / run / "last.pt"))
    whole, micro = runs
    assert whole["step"] == micro["step"]
    for key, value in whole["model"].items():
        torch.testing.assert_close(micro["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["classification", "regression"])  # their data's size is a flag
def test_no_host_reads_between_log_points(name, tmp_path, monkeypatch):
    task, flags = use(name, monkeypatch)

    def run(steps: int) -> None:
        argv = [*flags, *SMALL, "--batch-size", "8", "--synthetic-size", str(8 * steps), "--epochs", "1",
                "--log-every", "1000", "--no-augment", "--out-dir", str(tmp_path / str(steps))]
        assert quietly(argv, task)["steps"] == steps

    assert per_step(run) <= 0.05


def test_a_diverged_run_is_one_line_and_keeps_its_checkpoint(case, tmp_path, monkeypatch):
    task, flags = case
    real, calls = train.optimizer_step, [0]

    def poisoned(optimizer, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # after the save at step 2, before the log point at step 4
            optimizer.param_groups[0]["params"][0].data.fill_(float("nan"))
        return real(optimizer, *args, **kwargs)

    monkeypatch.setattr(train, "optimizer_step", poisoned)
    argv = [*flags, *SMALL, "--synthetic-size", "128", "--batch-size", "32", "--epochs", "2", "--log-every",
            "4", "--save-every", "2", "--out-dir", str(tmp_path)]
    with pytest.raises(UserError) as err:
        quietly(argv, task)
    assert "diverged at step 4" in str(err.value) and "still holds step 2" in str(err.value)
    assert "\n" not in str(err.value)
    saved = fingerprint(tmp_path)
    assert list(saved) == ["last.pt"] and checkpoints.load_checkpoint(tmp_path / "last.pt")["step"] == 2
    monkeypatch.setattr(train, "optimizer_step", real)
    summary = quietly(["--resume", "--out-dir", str(tmp_path)], task)
    assert summary["parts"] == 2 and summary["steps"] > 2


@default_task_only
def test_the_kept_default_task_is_task_py_word_for_word():
    """The machinery tests train with tests/forks/classification.py (conftest.py), so that they pass in a
    fork whatever its task.py holds: in the template, it is task.py exactly."""
    kept = (ROOT / "tests" / "forks" / "classification.py").read_text()
    shipped = (ROOT / "task.py").read_text()
    assert kept == shipped, ("task.py changed: copy it over tests/forks/classification.py, or give the new "
                             "task a NAME of its own")


def test_the_docs_name_all_the_template_reads_of_a_task():
    """docs/your_data.md's "The task: task.py" is a task's whole contract: each name that train.py,
    evaluate.py, lr_find.py and machinery/ read of a task (task.X, getattr(task, "X")) has its entry there,
    and task.py and every task in tests/forks/ define each one not marked optional."""
    page = (ROOT / "docs" / "your_data.md").read_text()
    section = page.split("## The task: `task.py`")[1].split("\n## ")[0]
    bullets = re.findall(r"^- ((?:`[^`]+`(?: and )?)+)( \(optional\))?:", section, re.M)
    listed = {name: bool(optional) for head, optional in bullets for name in re.findall(r"`(\w+)", head)}
    scripts = [ROOT / "train.py", ROOT / "evaluate.py", ROOT / "lr_find.py"]
    code = "\n".join(path.read_text() for path in [*scripts, *ROOT.glob("machinery/*.py")])
    read = set(re.findall(r"\btask\.(\w+)", code)) | set(re.findall(r'getattr\(task, "(\w+)"', code))
    assert read - {"py"} - set(listed) == set()  # task.py, the file
    assert {name for name, optional in listed.items() if optional} == {
        "TARGETS_MOVE_WITH_IMAGES", "augmented_targets", "unflipped_outputs"}
    required = {name for name, optional in listed.items() if not optional}
    assert len(required) == 16, sorted(required)
    forks = (classification, regression, multilabel, weighted, binned, multilabel_ap, boxes, keypoints,
             reversal)
    for task in (TEMPLATE_TASK, *forks):
        assert required - set(vars(task)) == set(), task.NAME
