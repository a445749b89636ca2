"""A fork's numbers are right, or it stops: the data checked against the task and the model once at
start-up (contract.py), before any file is written; per-pixel targets that follow their images' crops
and flips; what the task gets from the data (class counts, a balanced sampler); and what a checkpoint
records of its inputs. Exact loss normalization is tests/test_accumulation.py's."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import TEMPLATE_TASK, build_loaders, default_task_only, run_evaluate, run_main
from forks import regression
from test_faults import assert_one_line_failure
from torch import nn

import data
import evaluate
import lr_find
import models
import train
from configs import Config, parse_config, parse_given
from data import Source
from machinery.contract import IGNORE_INDEX

CPU = torch.device("cpu")
TINY = ["--width", "4", "--batch-size", "16", "--epochs", "1", "--device", "cpu", "--num-workers", "0"]


def use(monkeypatch, make) -> list[str]:
    """A dataset entry that returns make()'s Source, as a fork adds one; the flag that picks it."""
    monkeypatch.setitem(data.DATASETS, "mine", lambda cfg: make())
    return ["--dataset", "mine"]


def images(n: int = 64, size: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 1, size, size), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def labelled(labels: torch.Tensor, names: list[str], inputs: torch.Tensor | None = None) -> Source:
    inputs = images(len(labels)) if inputs is None else inputs
    n = len(labels) * 3 // 4
    return Source((inputs[:n], labels[:n]), (inputs[n:], labels[n:]), names)


def refused(monkeypatch, capsys, argv, out_dir: Path, script=None) -> str:
    """The run's one error line; the run folder holds nothing (no config.json, no TensorBoard events)."""
    if script is None:
        code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", out_dir)
    else:
        with pytest.raises(SystemExit) as stop:
            script([*map(str, argv), "--out-dir", str(out_dir)])
        code, (out, err) = stop.value.code, capsys.readouterr()
    line = assert_one_line_failure(code, out, err)
    assert not out_dir.exists() or not list(out_dir.iterdir()), list(out_dir.iterdir())
    return line


# ---------------------------------------------------------------- targets that follow their images


def test_masks_follow_their_images_through_crops_and_flips(monkeypatch):
    """A per-pixel target (bright or dark) stays on its pixel through every crop and flip; the padding a
    crop adds is IGNORE_INDEX in the mask, as it is zero in the image."""
    pixels = images(48)
    masks = (pixels[:, 0] > 127).to(torch.uint8)  # uint8 ids: read as int64
    flags = use(monkeypatch, lambda: Source((pixels, masks), (pixels[:8], masks[:8]), ["dark", "bright"],
                                            pad=2, flip=True))
    batches, _, _, info = build_loaders(parse_config([*flags, "--batch-size", "8", "--device", "cpu"]), CPU)
    assert "the per-pixel targets move with them" in " ".join(info.notes)
    flipped = padded = 0
    for epoch in range(2):
        for inputs, targets in batches.epoch(epoch):
            seen = (batches.denormalize(inputs)[:, 0] * 255).round()
            assert targets.dtype == torch.int64 and targets.shape == seen.shape
            counted = targets != IGNORE_INDEX
            assert torch.equal(targets[counted], (seen[counted] > 127).long())  # every pixel aligned
            assert (seen[~counted] == 0).all()  # ignored: the zero padding only
            padded += int((~counted).any())
            flipped += 1
    assert padded and flipped


def test_a_crop_per_pixel_values_cannot_follow_is_refused(monkeypatch):
    pixels = images(32)
    depth = pixels[:, :1].float() / 255  # per-pixel values: a crop's padding has no value to skip
    flags = use(monkeypatch, lambda: Source((pixels, depth), (pixels[:8], depth[:8]), ["depth"], pad=2))
    cfg = parse_config([*flags, "--device", "cpu", "--batch-size", "8"])
    with pytest.raises(ValueError, match="per-pixel values have none that counts for nothing"):
        build_loaders(cfg, CPU, targets="values")
    cfg.augment = False
    assert "images: no crop or flip (--no-augment)" in build_loaders(cfg, CPU, targets="values")[3].notes


def test_a_resize_per_pixel_targets_cannot_follow_is_refused(monkeypatch):
    """A model of a fixed input size (a ViT: 224 px) would get resized images and the masks of their old
    size: refused at start-up, in one line."""
    pixels = images(16)
    masks = (pixels[:, 0] > 127).long()
    flags = use(monkeypatch, lambda: Source((pixels, masks), (pixels[:4], masks[:4]), ["dark", "bright"]))
    cfg = parse_config([*flags, "--model", "vit_b_16", "--batch-size", "4", "--device", "cpu"])
    with pytest.raises(ValueError, match="vit_b_16 takes 224x224 px inputs, and the per-pixel targets"):
        build_loaders(cfg, CPU)


@pytest.mark.parametrize("argv, said", [
    (["--dataset", "digits"], "images: a random crop after 1 px of zero padding on training batches"),
    (["--dataset", "digits", "--no-augment"], "images: no crop or flip (--no-augment)"),
    (["--dataset", "synthetic"], "images: no crop or flip (none for synthetic)"),
])
def test_start_up_says_which_image_steps_apply(argv, said):
    assert said in build_loaders(parse_config([*argv, "--device", "cpu"]), CPU)[3].notes


def test_image_folders_say_that_they_flip(tmp_path):
    from test_faults import save_png

    for split in ("train", "val"):
        for name in ("a", "b"):
            save_png(tmp_path / split / name / "0.png", 8, len(name))
    notes = build_loaders(parse_config(["--dataset", "imagefolder", "--data-dir", str(tmp_path),
                                        "--device", "cpu", "--batch-size", "2"]), CPU)[3].notes
    assert any("random left-right flips (--no-flip where a mirror changes the class" in n for n in notes)


def test_tta_flip_flips_per_pixel_outputs_back():
    """A per-pixel model's mirrored outputs, flipped back, meet their own pixels: with a 1x1
    convolution, flip TTA gives exactly the plain outputs; per-image outputs are averaged as they are."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 6, 6)
    dense = nn.Conv2d(1, 3, 1)
    torch.testing.assert_close(evaluate.predicted(dense, x, "flip"), dense(x))
    per_image = nn.Sequential(nn.Flatten(), nn.Linear(36, 3))
    both = (per_image(x) + per_image(x.flip(-1))) / 2
    torch.testing.assert_close(evaluate.predicted(per_image, x, "flip"), both)


# ---------------------------------------------------------------- targets' dtype, shape and values


def test_one_value_per_example_is_read_as_a_column(monkeypatch, tmp_path):
    """[N] targets for a one-output regression: [N, 1], as the model's outputs are (MSE would broadcast
    [N] against [N, 1] into [N, N]); [N] targets for two outputs are refused."""
    values = torch.rand(64)
    flags = use(monkeypatch, lambda: labelled(values, ["y"]))
    cfg = parse_config([*flags, *TINY, "--lr", "0.02", "--out-dir", str(tmp_path)])
    batches, _, _, _ = build_loaders(cfg, CPU, targets="values")
    assert next(iter(batches))[1].shape == (16, 1)
    summary = train.train(cfg, None, regression)
    assert 0 < summary["val_loss"] < 1  # squared errors of values in [0, 1]
    use(monkeypatch, lambda: labelled(values, ["x", "y"]))
    with pytest.raises(ValueError, match=r"takes 2 values per example .*targets are \[48\]: one each"):
        build_loaders(cfg, CPU, targets="values")


def test_outputs_that_do_not_fit_the_targets_are_refused(monkeypatch, tmp_path):
    flags = use(monkeypatch, lambda: labelled(torch.rand(64, 3), ["y"]))  # 3 values, one output
    with pytest.raises(ValueError, match=r"gives outputs \[2, 1\] .* targets are \[2, 3\]"):
        train.train(parse_config([*flags, *TINY, "--out-dir", str(tmp_path / "b")]), None, regression)
    assert not (tmp_path / "b" / "config.json").exists()


@default_task_only
def test_uint8_labels_of_twenty_classes_score_right(monkeypatch, tmp_path):
    """uint8 ids overflowed the confusion matrix's index (id * 20 + predicted) and scored 60% for 95%:
    they are read as int64 at start-up, and the default task's accuracy is the model's."""
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 20, (400,), generator=g)
    noise = torch.randint(0, 8, (400, 1, 8, 8), generator=g)
    pixels = (labels.view(-1, 1, 1, 1) * 12 + noise).to(torch.uint8)  # each class its own brightness
    flags = use(monkeypatch, lambda: labelled(labels.to(torch.uint8), [str(i) for i in range(20)], pixels))
    cfg = parse_config([*flags, *TINY, "--epochs", "3", "--width", "8", "--lr", "0.05",
                        "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, TEMPLATE_TASK)
    model = train.build_model(cfg, 1, 20)
    model.load_state_dict(torch.load(tmp_path / "last.pt", weights_only=True)["model"])
    _, val, _, _ = build_loaders(cfg, CPU)
    model.eval()
    with torch.no_grad():
        right = sum((model(x).argmax(1) == y).sum().item() for x, y in val)
    assert summary["val_acc"] == pytest.approx(right / 100) and summary["val_acc"] > 0.3


def test_int32_labels_train(monkeypatch, tmp_path):
    flags = use(monkeypatch, lambda: labelled(torch.arange(64, dtype=torch.int32) % 4, list("abcd")))
    summary = train.train(parse_config([*flags, *TINY, "--out-dir", str(tmp_path)]))
    assert summary["steps"] == 3


@pytest.mark.parametrize("labels, said", [
    (torch.arange(64) % 10 + 1, r"class ids outside \[0, 10\): 10 \(\d+ times\); they look like 1..10: "
                                r"subtract 1"),
    (torch.where(torch.arange(64) < 3, 12, 0), r"outside \[0, 10\): 12 \(3 times\); one name per class"),
    (torch.rand(64), "the task takes class ids, and the train targets are float32"),
], ids=["one-based", "out of range", "float"])
def test_class_ids_outside_the_classes_are_refused(labels, said, monkeypatch, capsys, tmp_path):
    flags = use(monkeypatch, lambda: labelled(labels, [str(i) for i in range(10)]))
    line = refused(monkeypatch, capsys, [*flags, *TINY], tmp_path / "run")
    assert re.search(said, line), line


# ---------------------------------------------------------------- inputs and the model


def test_nan_in_tensor_inputs_is_refused_at_start_up(monkeypatch, capsys, tmp_path):
    signals = torch.randn(64, 1, 16)
    signals[[5, 9], 0, 3] = float("nan")
    flags = use(monkeypatch, lambda: labelled(torch.arange(64) % 2, ["a", "b"], signals))
    line = refused(monkeypatch, capsys, [*flags, *TINY], tmp_path / "run")
    assert "the train inputs hold nan or inf in 2 of 48 examples (the first: 5)" in line


class NanSignals(torch.utils.data.Dataset):
    """A Dataset of files, as a fork writes one: what it reads is only known as it is read."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((1, 16), float("nan") if i % 2 else 1.0), i % 2


def test_nan_in_file_data_is_called_a_data_problem_not_a_learning_rate(monkeypatch, capsys, tmp_path):
    """Read in workers, nan reaches the first batch's loss, before any step: train.py and lr_find.py say
    so, instead of "diverged: try a lower --lr"."""
    monkeypatch.setitem(data.DATASETS, "nans", lambda cfg: Source(NanSignals(), NanSignals(), ["a", "b"]))
    argv = ["--dataset", "nans", "--model", "mlp", *TINY, "--epochs", "2", "--log-every", "1"]
    monkeypatch.setitem(models.MODELS, "mlp", Mlp)
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "run")
    line = assert_one_line_failure(code, out, err)
    assert "the first batch's loss is nan, before any optimizer step: not the learning rate" in line
    assert "lower --lr" not in line
    with pytest.raises(SystemExit):
        lr_find.main([*argv, "--find-iters", "10", "--out-dir", str(tmp_path / "sweep")])
    line = assert_one_line_failure(1, *capsys.readouterr())
    assert "the first step's loss is not finite, before any update" in line and "widen" not in line


class Mlp(nn.Sequential):
    """For NanSignals' [1, 16] inputs."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        super().__init__(nn.Flatten(), nn.Linear(16, num_outputs))


@pytest.mark.parametrize("script", ["train.py", "lr_find.py"])
def test_a_model_that_cannot_take_the_inputs_is_one_line_before_any_file(script, monkeypatch, capsys,
                                                                         tmp_path):
    """The default CNN on token ids: one line naming the model and the inputs, and no config.json or
    TensorBoard events left behind (a 44-line conv2d traceback before)."""
    tokens = torch.randint(0, 100, (64, 32))
    flags = use(monkeypatch, lambda: labelled(torch.arange(64) % 2, ["a", "b"], tokens))
    line = refused(monkeypatch, capsys, [*flags, *TINY], tmp_path / "run",
                   None if script == "train.py" else lr_find.main)
    assert "the model resnet_small cannot take this data's inputs ([2, 32] int64)" in line
    assert "MODELS in models.py" in line


def test_a_loss_that_is_not_one_number_is_refused(monkeypatch, tmp_path):
    import task

    monkeypatch.setattr(task, "loss", lambda outputs, targets, cfg, info: outputs.sum(1))
    with pytest.raises(ValueError, match=r"task.loss returns \[2\] for a batch of 2: it must return one"):
        train.train(parse_config(["--dataset", "digits", *TINY, "--out-dir", str(tmp_path)]), None,
                    task)


# ---------------------------------------------------------------- what the task gets, what is recorded


def test_the_task_gets_the_class_counts_and_a_balanced_sampler(monkeypatch):
    labels = torch.where(torch.arange(400) % 10 < 7, 0, torch.arange(400) % 3)  # mostly class 0
    flags = use(monkeypatch, lambda: labelled(labels, ["a", "b", "c"]))
    cfg = parse_config([*flags, "--batch-size", "50", "--device", "cpu", "--balance-classes"])
    batches, _, _, info = build_loaders(cfg, CPU)
    assert info.class_counts.tolist() == torch.bincount(labels[:300]).tolist()
    drawn = torch.cat([y for _, y in batches.epoch(0)])
    assert torch.bincount(drawn).min() > 0.25 * len(drawn)  # each class about a third, not 70% of one
    again, _, _, _ = build_loaders(cfg, CPU)
    assert torch.equal(torch.cat([y for _, y in again.epoch(0)]), drawn)  # per (seed, epoch)
    assert not torch.equal(torch.cat([y for _, y in again.epoch(1)]), drawn)


def test_the_balanced_sampler_resumes_exactly(monkeypatch, tmp_path):
    from conftest import crash_at_step
    from test_resume import assert_same_state, final_state

    labels = torch.where(torch.arange(256) % 10 < 7, 0, torch.arange(256) % 4)
    flags = use(monkeypatch, lambda: labelled(labels, list("abcd")))
    argv = [*flags, *TINY, "--epochs", "2", "--balance-classes", "--save-every", "3"]
    train.train(parse_config([*argv, "--out-dir", str(tmp_path / "straight")]))
    with crash_at_step(monkeypatch, 5):
        train.train(parse_config([*argv, "--out-dir", str(tmp_path / "broken")]))
    given = parse_given(["--resume", "--out-dir", str(tmp_path / "broken")])
    train.train(Config(**given), given)
    assert_same_state(final_state(tmp_path / "straight" / "last.pt"),
                      final_state(tmp_path / "broken" / "last.pt"))


def test_balancing_needs_class_ids_listed_up_front(monkeypatch):
    monkeypatch.setitem(data.DATASETS, "nans", lambda cfg: Source(NanSignals(), NanSignals(), ["a", "b"]))
    with pytest.raises(ValueError, match="--balance-classes draws by class"):
        build_loaders(parse_config(["--dataset", "nans", "--balance-classes", "--device", "cpu"]), CPU)


def test_a_checkpoint_records_its_inputs_and_the_run_counts_examples(monkeypatch, tmp_path, capsys):
    """Token ids through a fork's embedding model: the checkpoint says [32] int64, the progress line and
    summary.json count examples per second, not images."""
    tokens = torch.randint(0, 50, (96, 32))
    flags = use(monkeypatch, lambda: labelled((tokens[:, 0] > 25).long(), ["low", "high"], tokens))
    monkeypatch.setitem(models.MODELS, "bag", Bag)
    summary = train.train(parse_config([*flags, "--model", "bag", *TINY, "--out-dir", str(tmp_path)]))
    assert "examples/s)" in capsys.readouterr().out and summary["examples_per_second"] > 0
    assert torch.load(tmp_path / "best.pt", weights_only=True)["inputs"] == {
        "shape": [32], "dtype": "int64", "reading": None}


class Bag(nn.Module):
    """Token ids [N, L]: embedded, mean-pooled, classified."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, width), nn.Linear(width, num_outputs)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def test_evaluate_checks_the_task_and_the_classes(tmp_path, monkeypatch, capsys):
    """--evaluate, as --resume and --predict do: a checkpoint of another task, or of other classes, is
    one line naming both, and no eval.json is written."""
    from test_faults import save_png

    folders = {}
    for name, classes in (("ab", "ab"), ("cd", "cd")):
        for split in ("train", "val"):
            for c in classes:
                for k in range(4):
                    save_png(tmp_path / name / split / c / f"{k}.png", 8, k + ord(c))
        folders[name] = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / name)]
    run = tmp_path / "run"
    train.train(parse_config([*folders["ab"], *TINY, "--batch-size", "4", "--out-dir", str(run)]))
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", run / "best.pt",
                              "--data-dir", tmp_path / "cd")
    line = assert_one_line_failure(code, out, err)
    assert "was trained on 2 classes ['a', 'b'], and the data here has 2: ['c', 'd']" in line
    ckpt = torch.load(run / "best.pt", weights_only=True)
    torch.save({**ckpt, "task": "regression"}, tmp_path / "other.pt")
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", tmp_path / "other.pt")
    line = assert_one_line_failure(code, out, err)
    assert "was trained for the task 'regression', and task.py is 'classification'" in line
    assert not list(run.glob("eval*")) and not list(tmp_path.glob("eval*"))
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", run / "best.pt")
    assert code == 0 and json.loads((run / "eval.json").read_text())["val_acc"] >= 0
