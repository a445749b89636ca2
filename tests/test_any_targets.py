"""Issue 42: the inputs and targets a fork brings. A task whose TARGETS is "any" takes its targets as the
data gives them (a binned regression's [N] floats for 10 outputs) and reports exact figures; per-position
class ids on inputs that are not images are no one class per example (--balance-classes is one line);
crops and flips asked of inputs that are not images are one line. Issue 49: boxes follow their images'
crops and flips by the task's augmented_targets, and without it the crops and flips are one line."""

import dataclasses
import functools
import json
import re

import pytest
import torch
from conftest import ROOT, add_entries, build_loaders, run_main
from entries import entries
from forks import binned, boxes, keypoints, paired, regression, reversal
from test_docs import blocks, read
from test_faults import assert_one_line_failure

import data
import models
import train
from configs import UserError, parse_config
from evaluate import load_trained
from machinery import batches, checkpoints
from machinery.inputs import Examples, ExamplesDiffer, stacked

SMALL = ["--width", "4", "--device", "cpu", "--num-workers", "0"]


def test_a_binned_regression_trains_on_its_own_targets_with_exact_figures(tmp_path, monkeypatch, capsys):
    add_entries(monkeypatch, "binned_data")
    cfg = parse_config(["--dataset", "brightness", *SMALL, "--synthetic-size", "96", "--batch-size", "32",
                        "--epochs", "2", "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, binned)
    assert "targets checked: 96 train, 24 val, as the data gives them" in capsys.readouterr().out
    model, _ = load_trained(tmp_path / "last.pt")
    _, val, _, _ = build_loaders(cfg, targets="any")
    total, right, count = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets in val.epoch(0):
            assert targets.shape == (len(inputs),) and targets.dtype == torch.float32  # as the data gave
            outputs = model(inputs)
            total += binned.loss(outputs, targets, cfg, None).item()
            right += int((outputs.argmax(1) == binned.bins(targets)).sum())
            count += len(targets)
    assert summary["val_loss"] == pytest.approx(total / count, rel=1e-5)
    assert summary["val_acc"] == right / count


def tokens(cfg, *, pad: int = 0, flip: bool = False):
    """[N, 6] token ids in, one class id per token out (5 classes): per-position targets on no image."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (64, 6), generator=g)
    return data.Source((x.float(), x), (x[:16].float(), x[:16]), list("abcde"), pad=pad, flip=flip)


def test_balanced_classes_on_per_position_ids_is_one_line_with_nothing_written(tmp_path, monkeypatch,
                                                                               capsys):
    monkeypatch.setitem(data.DATASETS, "tokens", tokens)
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "tokens", "--balance-classes", *SMALL,
                              "--out-dir", tmp_path / "run")
    assert "training targets are not one class id per example" in assert_one_line_failure(code, out, err)
    assert not (tmp_path / "run").exists()


def test_crops_and_flips_asked_of_clips_are_one_line(tmp_path, monkeypatch, capsys):
    def clips(cfg):
        video = torch.randint(0, 255, (32, 3, 4, 8, 8), dtype=torch.uint8)  # [N, C, T, H, W]
        labels = torch.arange(32) % 2
        return data.Source((video, labels), (video[:8], labels[:8]), ["a", "b"], pad=2, flip=True)

    monkeypatch.setitem(data.DATASETS, "clips", clips)
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "clips", *SMALL, "--out-dir",
                              tmp_path / "run")
    line = assert_one_line_failure(code, out, err)
    assert "clips's Source asks for crops and flips (pad=2, flip=True)" in line and "[3, 4, 8, 8]" in line
    assert "not uint8 [C, H, W] images" in line and not (tmp_path / "run").exists()


def test_a_box_moves_as_its_image_is_cropped_and_flipped():
    """forks/boxes.py's augmented_targets on one known box in a 12x12 image: the crop moves its content 1 row
    up (shift 1) and 2 columns right (shift -2); then a flip mirrors it."""
    box = torch.tensor([[1.0, 2.0, 5.0, 6.0]])  # x1, y1, x2, y2
    shifts = torch.tensor([[1, -2]])  # rows, columns
    kept = boxes.augmented_targets(box, shifts, torch.tensor([False]), (12, 12))
    assert kept.tolist() == [[3.0, 1.0, 7.0, 5.0]]
    mirrored = boxes.augmented_targets(box, shifts, torch.tensor([True]), (12, 12))
    assert mirrored.tolist() == [[5.0, 1.0, 9.0, 5.0]]


def test_boxes_follow_their_images_crops_and_flips_by_the_tasks_augmented_targets(monkeypatch):
    """Each training image's bright rectangle, found in the batch as the model gets it (cropped after 2 px
    of padding, flipped), lies exactly in its box as the batch gives it. docs/your_data.md shows this hook."""
    shown = next(body for _, body in blocks(read("docs/your_data.md"))
                 if body.startswith("def augmented_targets("))
    assert shown in (ROOT / "tests" / "forks" / "boxes.py").read_text()
    add_entries(monkeypatch, "boxes_data")
    cfg = parse_config(["--dataset", "rectangles", *SMALL, "--synthetic-size", "64", "--batch-size", "64"])
    source = data.DATASETS["rectangles"](cfg)
    splits, _ = train.build_loaders(cfg, source, torch.device("cpu"), targets="any",
                                    needs=models.input_needs(cfg.model, cfg.pretrained),
                                    follow=boxes.augmented_targets)
    order, offsets, flips = batches.epoch_plan(64, cfg.seed, 0, pad=2, flip=True)
    assert flips.any() and not flips.all() and (offsets != 2).any()  # some moved, some mirrored
    inputs, moved = next(splits.train.epoch(0))
    assert not torch.equal(moved, source.train[1][order])  # the boxes are not where the data put them
    bright = splits.train.denormalize(inputs)[:, 0] > 0.5  # the rectangle: 220, the ground below 40
    for box, pixels in zip(moved.tolist(), bright, strict=True):
        rows, columns = pixels.any(1).nonzero().flatten(), pixels.any(0).nonzero().flatten()
        assert box == [columns[0], rows[0], columns[-1] + 1, rows[-1] + 1]


def test_a_boxes_fork_trains_with_outputs_it_gives_a_count_and_says_its_targets_follow(tmp_path, monkeypatch,
                                                                                        capsys):
    """The rectangles' Source gives 4 outputs as a count (names=4), not names: the model has 4 outputs,
    named 0..3 in the checkpoint; start-up says the boxes follow the crops and flips."""
    add_entries(monkeypatch, "boxes_data")
    cfg = parse_config(["--dataset", "rectangles", *SMALL, "--synthetic-size", "64", "--batch-size", "32",
                        "--epochs", "1", "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, boxes)
    out = capsys.readouterr().out
    assert "4 outputs" in out and "resnet_small takes [2, 1, 12, 12] float32 and gives [2, 4]" in out
    assert ("images: a random crop after 2 px of zero padding and random left-right flips (--no-flip where "
            "a mirror changes the class: digits, text) on training batches; the targets follow them by "
            "task.py's augmented_targets") in out
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["data"]["names"] == ["0", "1", "2", "3"]
    assert 0 <= summary["val_iou"] <= 1


def test_crops_and_flips_of_targets_the_template_cannot_move_are_one_line(tmp_path, monkeypatch, capsys):
    """`python train.py` with the boxes fork without augmented_targets: its boxes would stay as their images
    move (TARGETS = "any" says nothing of where they are), so the crops and flips are refused in one line,
    with nothing written; --no-augment then trains."""
    add_entries(monkeypatch, "boxes_data")
    monkeypatch.delattr(boxes, "augmented_targets")
    monkeypatch.setattr(train.train, "__defaults__", (None, boxes))  # task.py: the fork's
    flags = ["--dataset", "rectangles", *SMALL, "--synthetic-size", "64", "--batch-size", "32",
             "--epochs", "1", "--out-dir", tmp_path / "run"]
    line = assert_one_line_failure(*run_main(monkeypatch, capsys, *flags))
    assert not (tmp_path / "run").exists()
    assert line.startswith("error: rectangles's images get crops and flips (pad=2, flip=True), and the "
                           'template cannot move TARGETS = "any" targets with them: define '
                           "augmented_targets(")
    code, out, err = run_main(monkeypatch, capsys, *flags, "--no-augment")
    assert code == 0 and "images: no crop or flip (--no-augment)" in out, err


NEITHER = "targets that are neither one per example nor one per pixel with them: define augmented_targets"
AGE_OR_PLACE = ("the template cannot tell whether a row of values moves with its image (a position) or stays "
                "(an age): define augmented_targets(targets, shifts, flips, size) in task.py "
                "(docs/your_data.md) where they move, or set TARGETS_MOVE_WITH_IMAGES = False in task.py "
                "where they stay; or set pad=0 and flip=False")


@pytest.mark.parametrize("targets, moves, refused", [
    (torch.arange(16) % 2, None, None),  # a class id an example: a crop keeps it
    ((torch.arange(16) % 2)[:, None], None, None),  # the same as [N, 1]
    (torch.rand(16, 3), False, None),  # a row of values an example that task.py says stays (an age)
    (torch.rand(16, 3), None, AGE_OR_PLACE),  # a position, or an age? (issue 54: trained in silence)
    (torch.rand(16, 3), True, "task.py says its targets move with them (TARGETS_MOVE_WITH_IMAGES = True) "
                              "and gives no augmented_targets to move them: define augmented_targets("),
    (torch.arange(16 * 5).view(16, 5) % 2, None, f"cannot move classes {NEITHER}"),  # 5 ids an image: where?
    (torch.rand(16, 2, 3, 3), None, f"cannot move values {NEITHER}"),  # a coarse map, not the images' 8x8
    (torch.rand(16, 2, 3, 3), False, None),  # ... that task.py says stays
], ids=["ids", "ids-column", "values-stay", "values-unsaid", "values-move", "ids-of-places", "map",
        "map-stays"])
def test_crops_and_flips_keep_one_target_an_example_and_refuse_targets_of_unknown_places(targets, moves,
                                                                                        refused, monkeypatch):
    """One class id an example stays; other targets stay only where task.py says so
    (TARGETS_MOVE_WITH_IMAGES = False), and are refused where it says nothing, or that they move with no
    augmented_targets to move them, in one line that names the ways out."""
    kind = "values" if targets.is_floating_point() else "classes"
    pixels = torch.randint(0, 255, (16, 1, 8, 8), dtype=torch.uint8)
    monkeypatch.setitem(data.DATASETS, "placed", lambda cfg: data.Source(
        (pixels, targets), (pixels[:4], targets[:4]), 3 if kind == "values" else 5, pad=1, flip=True))
    cfg = parse_config(["--dataset", "placed", *SMALL, "--batch-size", "8"])
    if refused:
        with pytest.raises(UserError, match=re.escape(refused)):
            build_loaders(cfg, targets=kind, moves=moves)
        return
    train_batches, _, _, info = build_loaders(cfg, targets=kind, moves=moves)
    assert "images: a random crop after 1 px of zero padding and random left-right flips" in " ".join(
        info.notes)
    order = batches.epoch_plan(16, cfg.seed, 0, pad=1, flip=True)[0]
    assert torch.equal(next(iter(train_batches.epoch(0)))[1].view(8, -1).float(),
                       targets[order[:8]].view(8, -1).float())  # as the data gave them


# ---------------------------------------------------------------- issue 54: 7, keypoints that move

def face(image: torch.Tensor) -> list[int]:
    """The face in one [H, W] image of pixels in [0, 1] (forks/keypoints_data.py): the eyes (220) left to
    right by column, then the nose (140), each (x, y)."""
    eyes = sorted((x, y) for y, x in (image > 0.7).nonzero().tolist())
    nose = [(x, y) for y, x in ((image > 0.45) & (image < 0.7)).nonzero().tolist()]
    assert len(eyes) == 2 and len(nose) == 1, (eyes, nose)
    return [c for point in [*eyes, *nose] for c in point]


def test_keypoints_follow_their_images_crops_and_flips_and_a_mirror_swaps_the_eyes(monkeypatch):
    """forks/keypoints.py's augmented_targets: each training image's three points, found in the batch as the
    model gets it (cropped after 2 px of padding, flipped), are exactly where its targets say, the left
    eye being the one on the image's left, in mirror images too."""
    add_entries(monkeypatch, "keypoints_data")
    cfg = parse_config(["--dataset", "face_points", *SMALL, "--synthetic-size", "64", "--batch-size", "64"])
    source = data.DATASETS["face_points"](cfg)
    splits, _ = train.build_loaders(cfg, source, torch.device("cpu"), targets="values",
                                    needs=models.input_needs(cfg.model, cfg.pretrained),
                                    follow=keypoints.augmented_targets)
    order, offsets, flips = batches.epoch_plan(64, cfg.seed, 0, pad=2, flip=True)
    assert flips.any() and not flips.all() and (offsets != 2).any()  # some moved, some mirrored
    inputs, moved = next(splits.train.epoch(0))
    assert not torch.equal(moved, source.train[1][order])  # the points are not where the data put them
    seen = [face(image) for image in splits.train.denormalize(inputs)[:, 0]]
    assert moved.tolist() == seen


def test_keypoints_unsaid_are_refused_in_one_line_that_names_both_ways(tmp_path, monkeypatch, capsys):
    """`python train.py` with the keypoints fork without augmented_targets: [N, 6] values, as an age's would
    be, with crops and flips; the template cannot tell a position from an age, so it refuses in one line
    naming both ways (it trained in silence on points the crops had moved), with nothing written."""
    add_entries(monkeypatch, "keypoints_data")
    monkeypatch.delattr(keypoints, "augmented_targets")
    monkeypatch.setattr(train.train, "__defaults__", (None, keypoints))  # task.py: the fork's
    line = assert_one_line_failure(*run_main(monkeypatch, capsys, "--dataset", "face_points", *SMALL,
                                             "--synthetic-size", "64", "--out-dir", tmp_path / "run"))
    assert line.startswith("error: face_points's images get crops and flips (pad=2, flip=True), and "
                           f"{AGE_OR_PLACE}"), line
    assert not (tmp_path / "run").exists()


def test_a_keypoints_fork_trains_and_says_its_points_follow(tmp_path, monkeypatch, capsys):
    add_entries(monkeypatch, "keypoints_data")
    cfg = parse_config(["--dataset", "face_points", *SMALL, "--synthetic-size", "64", "--batch-size", "32",
                        "--epochs", "1", "--optimizer", "adamw", "--lr", "0.01", "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, keypoints)
    assert ("random left-right flips (--no-flip where a mirror changes the class: digits, text) on training "
            "batches; the targets follow them by task.py's augmented_targets") in capsys.readouterr().out
    assert summary["val_distance"] > 0


def test_the_regression_fork_says_its_positions_move_and_crops_of_them_are_one_line(tmp_path, monkeypatch,
                                                                                    capsys):
    """forks/regression.py predicts a square's position (TARGETS_MOVE_WITH_IMAGES = True) and says not how a
    crop moves it: its data with pad and flip on is refused in one line, with nothing written."""
    add_entries(monkeypatch, "regression_data")
    positions = data.DATASETS["square_positions"]
    monkeypatch.setitem(data.DATASETS, "square_positions",
                        lambda cfg: dataclasses.replace(positions(cfg), pad=1, flip=True))
    monkeypatch.setattr(train.train, "__defaults__", (None, regression))
    line = assert_one_line_failure(*run_main(monkeypatch, capsys, "--dataset", "square_positions", *SMALL,
                                             "--synthetic-size", "64", "--out-dir", tmp_path / "run"))
    assert ("task.py says its targets move with them (TARGETS_MOVE_WITH_IMAGES = True) and gives no "
            "augmented_targets to move them: define augmented_targets(") in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- issue 54: 10, what a model returns

def test_a_model_that_decodes_in_eval_mode_trains_where_its_task_takes_both(tmp_path, monkeypatch, capsys):
    """docs/your_data.md: a model returns one tensor, and in eval mode it may return another shape (here ids
    [N, T] where training gets logits [N, tokens, T], as a greedy decode gives them); its task takes both
    (forks/reversal.py: TARGETS = "any", a loss of the eval-mode outputs too, a Tally of the decodes). With
    TARGETS = "classes" the decode is refused at start-up in one line, and so is a model that returns a
    tuple, with nothing written."""
    add_entries(monkeypatch, "reversal_data", "reversal_model")
    seen, add = [], reversal.Tally.add
    monkeypatch.setattr(reversal.Tally, "add", lambda self, outputs, *rest: seen.append(outputs.shape) or add(
        self, outputs, *rest))
    flags = ["--dataset", "reversed_tokens", "--model", "reverser", *SMALL, "--width", "16",
             "--synthetic-size", "256", "--batch-size", "32", "--optimizer", "adamw", "--lr", "0.02"]
    summary = train.train(parse_config([*flags, "--epochs", "6", "--out-dir", str(tmp_path / "run")]), None,
                          reversal)
    assert "reverser takes [2, 6] int64 and gives [2, 6]" in capsys.readouterr().out  # eval mode's
    assert seen and {shape[1:] for shape in seen} == {(6,)}  # the decoded ids, never the logits
    assert summary["val_acc"] > 0.9 and summary["val_loss"] == pytest.approx(1 - summary["val_acc"])

    monkeypatch.setattr(reversal, "TARGETS", "classes")
    monkeypatch.setattr(train.train, "__defaults__", (None, reversal))
    line = assert_one_line_failure(*run_main(monkeypatch, capsys, *flags, "--out-dir", tmp_path / "classes"))
    assert "model reverser gives outputs [2, 6] for [2, 6] int64 inputs, and the targets are [2, 6]" in line

    class Pair(models.nn.Module):  # outputs and something else: one tensor is what the task's loss gets
        def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
            super().__init__()
            self.reverser = models.MODELS["reverser"](channels, num_outputs, width, dropout)

        def forward(self, ids):
            return self.reverser(ids), ids

    monkeypatch.setitem(models.MODELS, "pair", Pair)
    line = assert_one_line_failure(*run_main(monkeypatch, capsys, *flags, "--model", "pair", "--out-dir",
                                             tmp_path / "pair"))
    assert "the model pair returns a tuple, not a tensor of outputs" in line
    assert not (tmp_path / "classes").exists() and not (tmp_path / "pair").exists()


# ---------------------------------------------------------------- issue 49: 6, 8 and 11

def docs_block(first_line: str) -> str:
    return next(body for _, body in re.findall(r"^```(\w*)\n(.*?)^```", (ROOT / "docs" / "your_data.md")
                                               .read_text(), re.S | re.M) if body.startswith(first_line))


def test_the_docs_variable_length_clips_train_and_without_their_collate_are_one_line(tmp_path, monkeypatch,
                                                                                      capsys):
    """docs/your_data.md's spectrograms of 50 to 200 frames, batched by their Source's collate (padded, with
    their lengths as a second input), and its model, added as the page says: they train to the right
    calls, and resume; without the collate the first batch is one line that says to pad (it was torch's
    'stack expects each tensor to be equal size' traceback)."""
    scope = {**vars(data), "DATASETS": {}}
    exec(docs_block("def calls(cfg: Config) -> Source:"), scope)
    model_scope = dict(vars(models))
    exec(docs_block("class LengthPooled(nn.Module):"), model_scope)
    monkeypatch.setitem(data.DATASETS, "calls", scope["DATASETS"]["calls"])
    monkeypatch.setitem(models.MODELS, "lengthpooled", model_scope["LengthPooled"])
    argv = ["--dataset", "calls", "--model", "lengthpooled", "--synthetic-size", "160", "--batch-size", "16",
            "--width", "16", "--optimizer", "adamw", "--lr", "0.01", "--epochs", "3", "--device", "cpu",
            "--num-workers", "0"]
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert code == 0 and summary["val_acc"] >= 0.9 and summary["steps"] == 24, (err, summary)
    assert "lengthpooled takes [2, 1, 40, " in out and "float32 + [2] int64" in out, out
    unpadded = functools.partial(lambda cfg: dataclasses.replace(scope["calls"](cfg), collate=None))
    monkeypatch.setitem(data.DATASETS, "calls", unpadded)
    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "unpadded")
    line = assert_one_line_failure(code, out, err)
    assert "a batch's examples differ in shape ([1, 40, " in line and "pad them to one shape" in line, line
    assert "give its Source a collate=FUNCTION" in line and not (tmp_path / "unpadded").exists()


def test_examples_of_different_shapes_from_a_dataloader_worker_are_the_same_one_line():
    """Past the start-up check's first two examples (of one length, say), a batch a worker stacks arrives as
    the same line, not the worker's traceback."""
    clips = [(torch.zeros(1, frames), 0) for frames in (3, 3, 5, 3)]
    loader = torch.utils.data.DataLoader(clips, batch_size=4, num_workers=1, collate_fn=stacked)
    with pytest.raises(ExamplesDiffer) as refused:
        next(iter(loader))
    said = str(refused.value)
    assert said.startswith("a batch's examples differ in shape ([1, 3] at entry 0 and [1, 5] at entry 2): "
                           "pad them to one shape in the dataset") and "\n" not in said, said


def brightness_pairs(cfg, *, dataset: bool = False):
    """binned_data's brightness images with tuple targets (levels [N], bins [N]): tensors, or a Dataset."""
    source = entries("binned_data")[0]["brightness"](cfg)
    pairs = [(x, (y, (y * 10).long().clamp(0, 9))) for x, y in (source.train, source.val)]
    if dataset:
        pairs = [Items(x, targets) for x, targets in pairs]
    return data.Source(*pairs, source.names)


class Items(torch.utils.data.Dataset):
    """(inputs, targets) tensors row by row, as a fork's Dataset gives them: no .targets to read up front."""

    def __init__(self, inputs, targets):
        self.examples = Examples(inputs, targets)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        return self.examples[i]


@pytest.mark.parametrize("dataset", [False, True], ids=["tensors", "a-dataset"])
def test_targets_given_as_a_tuple_are_taken_as_a_tuple(dataset, tmp_path, monkeypatch, capsys):
    """TARGETS = "any" and targets (levels, bins): read, checked and batched as a tuple, from tensors and
    from a Dataset (whose first example's targets were torch.as_tensor'd: 'only one element tensors can
    be converted to Python scalars'); a task that takes class ids refuses them in one line."""
    monkeypatch.setitem(data.DATASETS, "pairs", functools.partial(brightness_pairs, dataset=dataset))
    cfg = parse_config(["--dataset", "pairs", *SMALL, "--synthetic-size", "96", "--batch-size", "32",
                        "--epochs", "2", "--out-dir", str(tmp_path)])
    summary = train.train(cfg, None, paired)
    said = "96 train, 24 val" if not dataset else "train's first, val's first"
    assert f"targets checked: {said}, as the data gives them" in capsys.readouterr().out
    _, val, _, _ = build_loaders(cfg, targets="any")
    levels, bins = next(iter(val.epoch(0)))[1]
    assert levels.dtype == torch.float32 and bins.dtype == torch.int64 and len(levels) == len(bins) == 24
    assert 0 <= summary["val_distance"] < 0.5 and 0 <= summary["val_acc"] <= 1, summary
    with pytest.raises(UserError, match=r"the train targets are a tuple of 2 tensors, and the task takes "
                                        r"class ids, one tensor; give one, or set TARGETS = \"any\""):
        build_loaders(cfg, targets="classes")


def test_a_dataset_of_uint8_images_is_normalized_with_a_sample_of_its_own(tmp_path, monkeypatch, capsys):
    """A Dataset whose items hold uint8 images needs no stats= any more (it was refused): the mean and std
    of 256 of its 300 training examples, said at start-up, close to those of all of them."""
    g = torch.Generator().manual_seed(5)
    images = (torch.rand(375, 2, 1, 1, generator=g) * 150 + torch.randint(0, 100, (375, 2, 8, 8),
                                                                            generator=g)).to(torch.uint8)
    labels = (images.float().mean((1, 2, 3)) > 125).long()
    source = data.Source(Items(images[:300], labels[:300]), Items(images[300:], labels[300:]), ["a", "b"])
    monkeypatch.setitem(data.DATASETS, "frames", lambda cfg: source)
    code, out, err = run_main(monkeypatch, capsys, "--dataset", "frames", *SMALL, "--batch-size", "50",
                              "--channels", "2", "--epochs", "1", "--out-dir", tmp_path)
    assert code == 0, err
    assert "images: normalized with the mean and std of 256 of the 300 training examples (read at " in out
    reading = checkpoints.load_checkpoint(tmp_path / "last.pt")["inputs"]["reading"]
    pixels = images[:300].float().div(255).transpose(0, 1).reshape(2, -1)
    assert torch.allclose(torch.tensor(reading["mean"]), pixels.mean(1), atol=0.01)
    assert torch.allclose(torch.tensor(reading["std"]), pixels.std(1), atol=0.01)
