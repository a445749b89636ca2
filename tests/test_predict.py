"""--predict: a checkpoint's model on new image files, read as its run read its own (the checkpoint keeps
how: size, resize, channels, mean and std, a pretrained model's own), a row each from the task in
predictions.csv; every bad input one line."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import add_entries, build_loaders, run_evaluate
from PIL import Image

import data
import evaluate
import train
from configs import Config, UserError, parse_config, parse_given, resolve
from machinery.weights import load_weights
from models import build_model

CPU = ["--device", "cpu", "--num-workers", "0"]
SQUEEZENET = "squeezenet1_1-b8a52dc0.pth"  # torchvision's default squeezenet1_1 weights file


def rows_of(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def predicted(path: Path) -> dict[str, list[str]]:
    """predictions.csv's rows by file name (the header under "header")."""
    header, *rows = rows_of(path)
    return {"header": header, **{Path(row[0]).name: row[1:] for row in rows}}


def one_line(code, out: str, err: str) -> str:
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    return err


def image_folder(root: Path, channels: int = 3, count: int = 6) -> Path:
    """root/{train,val}/{dark,light}/*.png, 20x20, RGB or grayscale files."""
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label, name in enumerate(("dark", "light")):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                pixels = (40 + 150 * label + torch.randint(0, 60, (20, 20, 3), generator=g)).to(torch.uint8)
                image = Image.fromarray(pixels.numpy())
                (image.convert("L") if channels == 1 else image).save(root / split / name / f"{k}.png")
    return root


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A two-epoch digits run, and its 360 test images as 8x8 grayscale PNG files with their labels."""
    out = tmp_path_factory.mktemp("digits")
    train.train(parse_config([*CPU, "--epochs", "2", "--width", "8", "--out-dir", str(out / "run")]))
    images, labels = data.digits(Config()).test
    (out / "pngs").mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image[0].numpy()).save(out / "pngs" / f"{i:03d}.png")
    return out / "run", out / "pngs", [str(label) for label in labels.tolist()]


@pytest.fixture(scope="module", params=[3, 1], ids=["rgb", "gray"])
def folder_run(request, tmp_path_factory):
    """A two-epoch imagefolder run on RGB or grayscale (--channels 1) 16 px images."""
    out = tmp_path_factory.mktemp(f"folder{request.param}")
    root = image_folder(out / "images", request.param)
    train.train(parse_config([*CPU, "--dataset", "imagefolder", "--data-dir", str(root), "--image-size", "16",
                              "--channels", str(request.param), "--epochs", "2", "--batch-size", "8",
                              "--width", "8", "--lr", "0.05", "--out-dir", str(out / "run")]))
    return out / "run", root, request.param


def test_a_digits_model_predicts_its_test_images_as_evaluate_scores_them(digits_run, monkeypatch, capsys):
    run, pngs, labels = digits_run
    (pngs / "notes.txt").write_text("not an image")  # skipped, and counted
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", pngs, "--checkpoint", run / "best.pt",
                                  *CPU)
    assert code == 0, err
    rows = predicted(run / "predictions.csv")
    assert rows.pop("header") == ["file", "class", "probability",
                                  *(f"{w}_{i}" for i in range(2, 6) for w in ("class", "probability"))]
    assert len(rows) == 360 and "notes.txt" not in rows
    assert out.splitlines()[0].split() == ["file", "class", "probability", "class_2", "probability_2"]
    assert out.splitlines()[-1] == (f"360 files predicted -> {run / 'predictions.csv'} (the first 5 above); "
                                    "1 skipped (not image files: notes.txt)")
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]

    # --evaluate's accuracy, to the image: each file gets the class evaluation gives its test image
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", run / "best.pt", "--split", "test", *CPU)
    assert code == 0, err
    right = sum(rows[f"{i:03d}.png"][0] == label for i, label in enumerate(labels))
    assert right / 360 == json.loads((run / "eval.json").read_text())["test_acc"]
    ckpt = torch.load(run / "best.pt", weights_only=True)
    cfg = resolve.evaluated_config(Config(checkpoint=str(run / "best.pt")), {"device": "cpu"}, ckpt["config"])
    _, _, test, info = build_loaders(cfg, torch.device("cpu"))
    model = build_model(cfg, 1, 10).eval()
    load_weights(model, ckpt, 10, "test", new_head=False)
    with torch.no_grad():
        chances = torch.cat([model(x) for x, _ in test.epoch(0)]).softmax(1)
    for i, row in enumerate(chances.tolist()):
        best = max(range(10), key=row.__getitem__)
        assert rows[f"{i:03d}.png"][:2] == [str(best), f"{row[best]:.6g}"], i


def test_an_imagefolder_model_predicts_a_folder_and_a_csv_list_alike(folder_run, tmp_path, monkeypatch,
                                                                     capsys):
    run, root, channels = folder_run
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", root / "val", "--checkpoint",
                                  run / "best.pt", "--top-k", "50", "--out-dir", tmp_path / "folder",
                                  *CPU)  # searched recursively
    assert code == 0, err
    folder = rows_of(tmp_path / "folder" / "predictions.csv")
    assert folder[0] == ["file", "class", "probability", "class_2", "probability_2"]  # top-k: 2 classes
    assert len(folder) == 1 + 12 and not (run / "predictions.csv").exists()
    right = sum(Path(row[0]).parent.name == row[1] for row in folder[1:])  # the class folder is the truth
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", run / "best.pt", "--out-dir", tmp_path,
                                *CPU)
    assert code == 0 and right / 12 == json.loads((tmp_path / "eval.json").read_text())["val_acc"], err

    # a CSV of file paths under a header (relative to the CSV's folder), read by two workers
    listed = tmp_path / "list.csv"
    paths = [Path(row[0]).relative_to(tmp_path.parent) for row in folder[1:]]
    listed.write_text("path\n" + "".join(f"../{p}\n" for p in reversed(paths)))
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", listed, "--checkpoint", run / "best.pt",
                              "--top-k", "50", "--out-dir", tmp_path / "csv", "--device", "cpu",
                              "--num-workers", "2")
    assert code == 0, err
    from_csv = rows_of(tmp_path / "csv" / "predictions.csv")
    same_files = [Path(row[0]).resolve() for row in folder[:0:-1]]
    assert [Path(row[0]).resolve() for row in from_csv[1:]] == same_files
    assert [row[1:] for row in from_csv[1:]] == [row[1:] for row in folder[:0:-1]]


def test_each_model_gets_its_own_channels(folder_run, tmp_path):
    """An RGB file for a grayscale model is read as grayscale (PIL's "L"), and a grayscale file for an RGB
    model as RGB, each normalized with the mean and std the run trained with."""
    run, _, channels = folder_run
    inputs = torch.load(run / "best.pt", weights_only=True)["inputs"]["reading"]
    assert inputs["channels"] == channels and inputs["size"] == 16 and len(inputs["mean"]) == channels
    colour = torch.tensor([[[200, 30, 90]]], dtype=torch.uint8).expand(16, 16, 3).contiguous()
    Image.fromarray(colour.numpy()).save(tmp_path / "rgb.png")
    Image.fromarray(colour.numpy()).convert("L").save(tmp_path / "gray.png")
    cfg = parse_config(CPU)
    batches, files, skipped = evaluate.prediction_batches(cfg, tmp_path, inputs, torch.device("cpu"))
    (x, _), = list(batches.epoch(0))
    assert files == [tmp_path / "gray.png", tmp_path / "rgb.png"] and not skipped
    assert x.shape == (2, channels, 16, 16)
    gray = float(Image.fromarray(colour.numpy()).convert("L").getpixel((0, 0)))
    pixels = [[gray] * channels, [200.0, 30.0, 90.0] if channels == 3 else [gray]]  # gray.png, then rgb.png
    mean, std = torch.tensor(inputs["mean"]), torch.tensor(inputs["std"])
    expected = (torch.tensor(pixels) / 255 - mean) / std
    assert torch.allclose(x[:, :, 5, 5], expected, atol=1e-5)


def test_a_pretrained_model_predicts_with_its_own_transforms(torch_home, tmp_path, monkeypatch, capsys):
    """squeezenet1_1 --pretrained (its weights faked, as no download works here) trains at the weights'
    crop size and normalization; --predict reads new files the same way, and loads no weights file."""
    import torchvision
    from torchvision import transforms as T

    torch.manual_seed(0)
    (torch_home / "hub" / "checkpoints").mkdir(parents=True)
    weights_file = torch_home / "hub" / "checkpoints" / SQUEEZENET
    torch.save(torchvision.models.squeezenet1_1(weights=None).state_dict(), weights_file)
    root = image_folder(tmp_path / "images", count=2)
    train.train(parse_config([*CPU, "--dataset", "imagefolder", "--data-dir", str(root), "--model",
                              "squeezenet1_1", "--pretrained", "--batch-size", "4", "--epochs", "1",
                              "--out-dir", str(tmp_path / "run")]))
    weights_file.unlink()  # predicting needs the checkpoint alone
    Image.new("RGB", (40, 30), (200, 120, 40)).save(tmp_path / "new.png")
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", tmp_path / "new.png", "--checkpoint",
                              tmp_path / "run" / "best.pt", *CPU)
    assert code == 0, err
    ckpt = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    own = torchvision.models.SqueezeNet1_1_Weights.DEFAULT.transforms()
    reading = ckpt["inputs"]["reading"]
    assert reading["size"] == own.crop_size[0] == 224 and reading["resize"] == 0
    assert reading["mean"] == pytest.approx(own.mean)
    assert reading["std"] == pytest.approx(own.std)

    # the probabilities are the model's on the file resized, center-cropped and normalized that way
    model = torchvision.models.squeezenet1_1(weights=None, num_classes=2).eval()
    model.load_state_dict(ckpt["model"])
    steps = T.Compose([T.Resize(224), T.CenterCrop(224), T.PILToTensor()])
    pixels = steps(Image.open(tmp_path / "new.png").convert("RGB")).float() / 255
    x = (pixels - torch.tensor(own.mean)[:, None, None]) / torch.tensor(own.std)[:, None, None]
    with torch.no_grad():
        chances = model(x[None]).softmax(1)[0].tolist()
    (_, name, probability, *_), = rows_of(tmp_path / "run" / "predictions.csv")[1:]
    best = max(range(2), key=chances.__getitem__)
    assert name == ["dark", "light"][best] and float(probability) == pytest.approx(chances[best], abs=1e-5)


def test_tta_flip_averages_each_image_with_its_mirror(digits_run, tmp_path, monkeypatch, capsys):
    """An image and its mirror image get the same outputs under --tta flip (not without), said in a
    `tta` column."""
    run, pngs, _ = digits_run
    for side in ("as_is", "mirrored"):
        (tmp_path / side).mkdir()
        for i in range(24):
            image = Image.open(pngs / f"{i:03d}.png")
            (image if side == "as_is" else image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)).save(
                tmp_path / side / f"{i:03d}.png")
    results = {}
    for tta in ("none", "flip"):
        for side in ("as_is", "mirrored"):
            code, out, err = run_evaluate(monkeypatch, capsys, "--predict", tmp_path / side, "--checkpoint",
                                      run / "best.pt", "--tta", tta, "--out-dir", tmp_path / tta / side, *CPU)
            assert code == 0, err
            results[tta, side] = predicted(tmp_path / tta / side / "predictions.csv")
    assert results["flip", "as_is"] == results["flip", "mirrored"]
    assert results["flip", "as_is"]["header"][-1] == "tta"
    assert results["flip", "as_is"]["000.png"][-1] == "flip"
    assert results["none", "as_is"] != results["none", "mirrored"]
    assert "tta" not in results["none", "as_is"]["header"]


def locate(images: torch.Tensor) -> torch.Tensor:
    """A model that finds forks/keypoints_data.py's faces exactly, in images of pixel values 0..255: the eyes
    (220) left to right, then the nose (140), each (x, y)."""
    faces = []
    for image in images[:, 0]:
        eyes = sorted((x, y) for y, x in (image > 180).nonzero().tolist())
        nose = [(x, y) for y, x in ((image > 100) & (image < 180)).nonzero().tolist()]
        faces.append([c for point in [*eyes, *nose] for c in point])
    return torch.tensor(faces, dtype=torch.float32)


def test_tta_flip_maps_a_mirror_images_points_back_by_the_task(monkeypatch):
    """Issue 54, 8: a model that finds each face's points exactly gives them exactly under --tta flip too,
    its mirror images' points mapped back by forks/keypoints.py's unflipped_outputs (mirrored, the eyes
    swapped); averaged as they are they were pixels off (the left eye's x averaged with the right eye's
    mirror: up to 1.5 px off here), and without the task's way back --tta flip is one line."""
    from forks import keypoints

    add_entries(monkeypatch, "keypoints_data")
    images, points = data.DATASETS["face_points"](parse_config(["--synthetic-size", "32"])).train
    images = images.float()
    assert torch.equal(locate(images), points)
    def back(mirrored):  # as evaluate.predict gives it
        return keypoints.unflipped_outputs(mirrored, (12, 12))

    assert torch.equal(evaluate.predicted(locate, images, "flip", back, moves=True), points)
    as_they_are = evaluate.predicted(locate, images, "flip")
    assert (as_they_are - points).abs().max() >= 1  # where the model is exact
    with pytest.raises(UserError, match=r"^--tta flip averages each image's outputs with its mirror image's, "
                                        r"and task.py moves its targets with flips .* define "
                                        r"unflipped_outputs\(outputs, size\) in task.py"):
        evaluate.predicted(locate, images, "flip", None, moves=True)


@pytest.fixture(scope="module")
def keypoints_run(tmp_path_factory):
    """A one-epoch run of the keypoints fork, and 8 of its val images as 12x12 grayscale PNG files."""
    from entries import entries
    from forks import keypoints

    out = tmp_path_factory.mktemp("keypoints")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(data.DATASETS, "face_points", entries("keypoints_data")[0]["face_points"])
        cfg = parse_config([*CPU, "--dataset", "face_points", "--synthetic-size", "64", "--epochs", "1",
                            "--width", "8", "--batch-size", "32", "--optimizer", "adamw", "--lr", "0.01",
                            "--out-dir", str(out / "run")])
        train.train(cfg, None, keypoints)
        images = data.DATASETS["face_points"](cfg).val[0][:8]
    (out / "pngs").mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image[0].numpy()).save(out / "pngs" / f"{i}.png")
    return out / "run", out / "pngs", images


def test_tta_flip_of_a_keypoints_fork_averages_its_points_mapped_back(keypoints_run, tmp_path, monkeypatch):
    """`evaluate.py --predict --tta flip` with the keypoints fork: each row is the mean of the model's points
    for the image and for its mirror image mapped back by the task; without unflipped_outputs it is one
    line, and nothing is written."""
    from forks import keypoints

    run, pngs, images = keypoints_run
    given = parse_given(["--predict", str(pngs), "--checkpoint", str(run / "best.pt"), "--tta", "flip",
                         "--out-dir", str(tmp_path / "flip"), *CPU])
    evaluate.predict(Config(**given), given, keypoints)
    header, *rows = rows_of(tmp_path / "flip" / "predictions.csv")
    assert header == ["file", "left_x", "left_y", "right_x", "right_y", "nose_x", "nose_y", "tta"]
    model, ckpt = evaluate.load_trained(run / "best.pt")
    reading = ckpt["inputs"]["reading"]
    x = (images.float() / 255 - torch.tensor(reading["mean"]).view(1, -1, 1, 1)) / torch.tensor(
        reading["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        want = (model(x) + keypoints.unflipped_outputs(model(x.flip(-1)), (12, 12))) / 2
    got = torch.tensor([[float(v) for v in row[1:-1]] for row in rows])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    monkeypatch.delattr(keypoints, "unflipped_outputs")
    given["out_dir"] = str(tmp_path / "refused")
    with pytest.raises(UserError, match="define unflipped_outputs"):
        evaluate.predict(Config(**given), given, keypoints)
    assert not (tmp_path / "refused").exists()


def test_the_default_checkpoint_is_runs_default_best_pt(digits_run, tmp_path, monkeypatch, capsys):
    run, pngs, _ = digits_run
    monkeypatch.chdir(tmp_path)
    line = one_line(*run_evaluate(monkeypatch, capsys, "--predict", pngs / "000.png"))
    assert "--checkpoint runs/default/best.pt: no such file" in line
    (tmp_path / "runs" / "default").mkdir(parents=True)
    shutil.copy(run / "best.pt", tmp_path / "runs" / "default" / "best.pt")
    code, out, err = run_evaluate(monkeypatch, capsys, "--predict", pngs / "000.png", *CPU)
    assert code == 0, err
    assert out.splitlines()[-1] == "1 file predicted -> runs/default/predictions.csv"


def test_the_forks_tasks_say_what_a_prediction_is(tmp_path, monkeypatch, capsys):
    """Regression gives the numbers, multi-label the tags above its threshold; another task's checkpoint
    is refused."""
    from forks import multilabel, regression

    add_entries(monkeypatch, "regression_data", "multilabel_data")
    (tmp_path / "pngs").mkdir()
    for i in range(3):
        square = Image.new("L", (8, 8), 20)
        square.paste(220, (i, 2 * i, i + 3, 2 * i + 3))
        square.save(tmp_path / "pngs" / f"{i}.png")
    for task, dataset in ((regression, "square_positions"), (multilabel, "digit_facts")):
        out = tmp_path / task.NAME
        argv = ["--dataset", dataset, "--synthetic-size", "128", "--width", "8", "--lr", "0.02"]
        train.train(parse_config([*CPU, *argv, "--epochs", "1", "--batch-size", "32", "--out-dir", str(out)]),
                    task=task)
        given = parse_given(["--predict", str(tmp_path / "pngs"), "--checkpoint", str(out / "best.pt"), *CPU])
        evaluate.predict(Config(**given), given, task)
        header, *rows = rows_of(out / "predictions.csv")
        assert len(rows) == 3
        if task is regression:
            assert header == ["file", "row", "column"]
            assert all(-5 < float(value) < 5 for row in rows for value in row[1:])
            flipped = {**given, "tta": "flip", "out_dir": str(tmp_path / "flipped")}  # a square's position
            with pytest.raises(UserError, match="task.py moves its targets with flips .* define unflipped_"):
                evaluate.predict(Config(**flipped), flipped, task)
        else:
            assert header == ["file", "tags", "even", "above_4", "prime"]
            for row in rows:
                tags = [name for name, p in zip(header[2:], row[2:], strict=True) if float(p) > 0.5]
                assert row[1].split() == tags
        line = one_line(*run_evaluate(monkeypatch, capsys, "--predict", tmp_path / "pngs", "--checkpoint",
                                  out / "best.pt", *CPU))
        assert f"trained for the task {task.NAME!r}, and task.py is 'classification'" in line


def edited(run: Path, folder: Path, name: str, change) -> Path:
    """A copy of run's best.pt changed by `change(ckpt)` (or replaced by what it returns)."""
    ckpt = torch.load(run / "best.pt", weights_only=True)
    torch.save(change(ckpt) or ckpt, folder / name)
    return folder / name


BAD = {  # each case, and what its one line says
    "no such path": "nowhere: no such file or folder",
    "no images": "empty: holds no image files (.jpg",
    "not an image": "a.txt: is not an image file",
    "an unreadable image": "--predict: cannot read image",
    "no checkpoint": "none.pt: no such file; train first",
    "not a checkpoint": "a.txt is truncated or corrupt",
    "an older checkpoint": "records no image preprocessing: it predates --predict",
    "a plain state_dict": "records no image preprocessing: it predates --predict",
    "another task's": "trained for the task 'regression', and task.py is 'classification'",
    "another shape": "does not fit the model built here (0.0.weight [8, 1, 3, 3] there, [16, 1, 3, 3] here",
    "top-k 0": "top_k must be a number > 0",
    "tta unknown": "unknown tta 'flop'",
}


def bad_arguments(case: str, tmp: Path, pngs: Path, run: Path) -> list:
    """--predict's path in each BAD case, and the arguments after it."""
    best = run / "best.pt"
    (tmp / "a.txt").write_text("hi"), (tmp / "bad.png").write_text("hi"), (tmp / "empty").mkdir()
    paths = {"no such path": tmp / "nowhere", "no images": tmp / "empty", "not an image": tmp / "a.txt",
             "an unreadable image": tmp / "bad.png"}
    checkpoints = {
        "no checkpoint": tmp / "none.pt", "not a checkpoint": tmp / "a.txt",
        "an older checkpoint": edited(run, tmp, "old.pt", lambda c: c.pop("inputs") and None),
        "a plain state_dict": edited(run, tmp, "plain.pt", lambda c: c["model"]),
        "another task's": edited(run, tmp, "task.pt", lambda c: c.update(task="regression")),
        "another shape": edited(run, tmp, "wide.pt", lambda c: c["config"].update(width=16))}
    more = {"top-k 0": ["--top-k", "0"], "tta unknown": ["--tta", "flop"]}
    return [paths.get(case, pngs), "--checkpoint", checkpoints.get(case, best), *more.get(case, [])]


@pytest.mark.parametrize("case", BAD)
def test_each_bad_input_is_one_line(case, digits_run, tmp_path, monkeypatch, capsys):
    run, pngs, _ = digits_run
    argv = bad_arguments(case, tmp_path, pngs, run)
    line = one_line(*run_evaluate(monkeypatch, capsys, "--predict", *argv, "--out-dir", tmp_path / "out",
                                  *CPU))
    assert BAD[case] in line, line
    assert not (tmp_path / "out").exists()


def test_an_unreadable_image_stops_the_workers_at_once(digits_run, tmp_path, monkeypatch, capsys):
    """The failed read's traceback keeps predict's frames: its workers stop on the way out all the same,
    not when the cycle collector gets to them (5 s each)."""
    import gc
    import multiprocessing

    run, _, _ = digits_run
    (tmp_path / "bad.png").write_text("hi")
    gc.disable()
    try:
        line = one_line(*run_evaluate(monkeypatch, capsys, "--predict", tmp_path / "bad.png", "--checkpoint",
                                  run / "best.pt", "--device", "cpu", "--num-workers", "1"))
        assert "--predict: cannot read image" in line and multiprocessing.active_children() == []
    finally:
        gc.enable()


def test_inputs_that_are_not_images_are_one_line(tmp_path, monkeypatch, capsys):
    """A model of 1-D signals (the signal fork's): --predict reads image files, --tta flip mirrors them."""
    add_entries(monkeypatch, "signals_data", "signals_model")
    train.train(parse_config([*CPU, "--dataset", "waves", "--synthetic-size", "64", "--model", "conv1dnet",
                              "--epochs", "1", "--batch-size", "32", "--out-dir", str(tmp_path / "run")]))
    Image.new("L", (8, 8)).save(tmp_path / "x.png")
    for tta in ("none", "flip"):
        line = one_line(*run_evaluate(monkeypatch, capsys, "--predict", tmp_path / "x.png", "--checkpoint",
                                  tmp_path / "run" / "best.pt", "--tta", tta, *CPU))
        assert "was trained on inputs that are not images (--dataset waves)" in line
