"""Issue 50: `evaluate.py --export model.onnx|model.pt2` writes a checkpoint's model as one file another
runtime loads, its input steps inside (uint8 images in, as --predict reads them from files; other inputs
as the dataset gives them), a dynamic batch axis, names and sizes in its metadata; checked against the
PyTorch model before it is kept. Every bad case is one line, and leaves no file."""

import csv
import dataclasses
import io
import json
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from conftest import LAUNCH, ROOT, add_entries, run_evaluate, run_main
from PIL import Image
from test_any_targets import docs_block
from test_docs import blocks, read
from test_faults import DiskFull, assert_one_line_failure
from test_predict import image_folder
from torchvision import transforms as T

import data
import evaluate
import models
import train
from configs import Config, parse_config, parse_given
from machinery import export
from machinery.image_files import fitted, read_image

CPU = ["--device", "cpu", "--num-workers", "0"]
CHECKED = r"max abs difference (\S+), the top class agrees on 100.00% of them"


def session(path) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def metadata(path) -> dict:
    """An export's metadata, its JSON values read: ONNX metadata_props, a .pt2's metadata.json."""
    if path.suffix == ".pt2":
        extra = {"metadata.json": ""}
        torch.export.load(path, extra_files=extra)
        return json.loads(extra["metadata.json"])
    plain = ("checkpoint", "task")  # text as it is
    return {key: value if key in plain else json.loads(value)
            for key, value in session(path).get_modelmeta().custom_metadata_map.items()}


def exported(monkeypatch, capsys, checkpoint, target) -> str:
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", checkpoint, "--export", target, *CPU)
    assert code == 0, err
    assert sorted(p.name for p in target.parent.iterdir() if p.name.startswith(".")) == [], "a staging folder"
    return out


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The default model on digits, one epoch."""
    out = tmp_path_factory.mktemp("digits")
    train.train(parse_config([*CPU, "--epochs", "1", "--width", "8", "--out-dir", str(out / "run")]))
    return out / "run"


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """An RGB image folder (20x20 files, read at 16 px), two epochs, exported to ONNX: the run's folder,
    the images' folder, the run's summary and the exported file."""
    out = tmp_path_factory.mktemp("folder")
    root = image_folder(out / "images")
    summary = train.train(parse_config([*CPU, "--dataset", "imagefolder", "--data-dir", str(root),
                                        "--image-size", "16", "--epochs", "2", "--batch-size", "8", "--width",
                                        "8", "--lr", "0.05", "--out-dir", str(out / "run")]))
    given = parse_given(["--checkpoint", str(out / "run" / "best.pt"), "--export", str(out / "model.onnx"),
                         *CPU])
    evaluate.export(Config(**given), given)
    return out / "run", root, summary, out / "model.onnx"


def val_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """digits' val split as the dataset gives it: uint8 [144, 1, 8, 8] images and their labels."""
    return data.digits(Config()).val


@pytest.mark.parametrize("suffix", [".onnx", ".pt2"])
def test_a_digits_model_exports_and_computes_what_pytorch_computes(suffix, digits_run, tmp_path, monkeypatch,
                                                                   capsys):
    """The printed check, then our own: raw uint8 images through the file and the same images normalized
    by hand through load_trained's model agree to 1e-4 with the same classes, in batches of 144, 1 and 7;
    the metadata names the classes, the inputs and the step."""
    target = tmp_path / f"model{suffix}"
    out = exported(monkeypatch, capsys, digits_run / "best.pt", target)
    assert out.startswith(f"{target}: ") and "first 144 examples (batches of 144, 1 and 7)" in out
    assert float(re.search(CHECKED, out).group(1)) <= 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # one self-contained file
    model, ckpt = evaluate.load_trained(digits_run / "best.pt")
    read_as = ckpt["inputs"]["reading"]
    mean, std = (torch.tensor(read_as[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    images, _ = val_digits()
    if suffix == ".onnx":
        runner = session(target)
        assert [(i.name, i.shape, i.type) for i in runner.get_inputs()] == [
            ("images", ["batch", 1, 8, 8], "tensor(uint8)")]

        def run(x):
            return torch.from_numpy(runner.run(None, {"images": x.numpy()})[0])
    else:
        run = torch.export.load(target).module()
    meta = metadata(target)
    assert meta["names"] == list("0123456789") and meta["step"] == ckpt["step"]
    assert meta["task"] == "classification" and meta["checkpoint"] == str(digits_run / "best.pt")
    assert meta["inputs"] == {"images": {"shape": ["N", 1, 8, 8], "dtype": "uint8"}}
    assert meta["images"] == read_as and meta["outputs"] == ["outputs"]
    for rows in (slice(0, 144), slice(0, 1), slice(3, 10)):
        with torch.no_grad():
            want, got = model((images[rows].float() / 255 - mean) / std), run(images[rows])
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-4
        assert torch.equal(got.argmax(1), want.argmax(1))


def test_weights_past_what_one_file_holds_go_beside_it_and_load(digits_run, tmp_path, monkeypatch, capsys):
    """Over 2 GB (here forced: ONNXProgram.save's own rule) the weights go in model.onnx.data, written in
    the staging folder under its final name, moved beside model.onnx, which onnxruntime then loads."""
    save = torch.onnx.ONNXProgram.save
    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", lambda self, to: save(self, to, external_data=True))
    exported(monkeypatch, capsys, digits_run / "best.pt", tmp_path / "model.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert (tmp_path / "model.onnx").stat().st_size < 100_000 < (tmp_path / "model.onnx.data").stat().st_size
    images, _ = val_digits()
    assert session(tmp_path / "model.onnx").run(None, {"images": images[:7].numpy()})[0].shape == (7, 10)


def test_an_image_folder_export_scores_the_runs_val_accuracy_on_decoded_files(folder_run):
    """onnxruntime fed the val folder's files, decoded by PIL and read as --predict reads them (short side
    to 16, center crop, uint8 CHW), scores exactly the run's best val accuracy."""
    run, root, summary, target = folder_run
    runner, names = session(target), json.loads(session(target).get_modelmeta().custom_metadata_map["names"])
    read_as = T.Compose([T.Resize(16), T.CenterCrop(16), T.PILToTensor()])
    files = sorted((root / "val").rglob("*.png"))
    pixels = torch.stack([read_as(read_image(str(f))) for f in files])
    logits = torch.from_numpy(runner.run(None, {"images": pixels.numpy()})[0])
    right = [names[i] == f.parent.name for i, f in zip(logits.argmax(1), files, strict=True)]
    assert len(files) == 12 and sum(right) / len(files) == summary["best_val_acc"]
    model, ckpt = evaluate.load_trained(run / "best.pt")  # and the logits are the PyTorch model's
    mean, std = (torch.tensor(ckpt["inputs"]["reading"][k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        assert (model((pixels / 255 - mean) / std) - logits).abs().max() <= 1e-4


def test_the_docs_onnxruntime_lines_run(folder_run, capsys):
    """docs/training.md's onnxruntime lines (numpy and PIL, no torch) on each val file of the folder run
    (20x20 files read at 16 px): the pixels they read are --predict's, to the last bit, and the classes
    they print score the run's best val accuracy."""
    _, root, summary, target = folder_run
    block = next(body for lang, body in blocks(read("docs/training.md"))
                 if lang == "python" and "onnxruntime" in body)
    files, read_as = sorted((root / "val").rglob("*.png")), T.Compose([T.Resize(16), T.CenterCrop(16)])
    for file in files:
        scope = {}
        exec(block.replace("runs/pets/model.onnx", str(target)).replace("my_images/val/3/014.png", str(file)),
             scope)
        assert (scope["pixels"] == np.asarray(read_as(read_image(str(file))))).all(), file
    printed = capsys.readouterr().out.split()
    right = [name == file.parent.name for name, file in zip(printed, files, strict=True)]
    assert len(printed) == len(files) and sum(right) / len(files) == summary["best_val_acc"]


def odd_files(root: Path, folder: Path) -> list[Path]:
    """Four of the folder run's val pictures in each mode PIL opens otherwise than 8-bit RGB: 16-bit
    grayscale PNG (0..65535: PIL's convert alone clips it to 255), 32-bit integer and float TIFF, grayscale
    with alpha, palette, CMYK JPEG, RGBA, 1-bit and GIF."""
    folder.mkdir()
    for file in sorted((root / "val").rglob("*.png"))[::3]:
        rgb, stem = Image.open(file).convert("RGB"), folder / f"{file.parent.name}-{file.stem}"
        gray = np.asarray(rgb.convert("L"))
        Image.fromarray(gray.astype(np.uint16) * 257).save(f"{stem}-16bit.png")
        Image.fromarray(gray.astype(np.int32) * 257).save(f"{stem}-32bit.tif")
        Image.fromarray(gray.astype(np.float32) / 255).save(f"{stem}-float.tif")
        for mode, suffix in (("LA", "png"), ("P", "png"), ("CMYK", "jpg"), ("RGBA", "png"), ("1", "png")):
            rgb.convert(mode).save(f"{stem}-{mode.lower()}.{suffix}")
        rgb.save(f"{stem}.gif")
    files = sorted(folder.iterdir())
    assert {Image.open(f).mode for f in files} == {"I;16", "I", "F", "LA", "P", "CMYK", "RGBA", "1"}
    return files


def test_the_docs_onnxruntime_lines_read_odd_modes_as_predict_does(folder_run, tmp_path, monkeypatch, capsys):
    """Issue 54, 4: the docs' lines read 16-bit PNGs with PIL's convert, which clips what --predict scales
    (4 of 9 such files got another class). On every odd mode, their pixels are --predict's read to the last
    bit, and their class and its probability are those --predict wrote in predictions.csv."""
    run, root, _, target = folder_run
    files = odd_files(root, tmp_path / "odd")
    code, _, err = run_evaluate(monkeypatch, capsys, "--predict", tmp_path / "odd", "--checkpoint",
                                run / "best.pt", "--out-dir", tmp_path, *CPU)
    assert code == 0, err
    with open(tmp_path / "predictions.csv", newline="") as f:
        predicted = {row["file"]: row for row in csv.DictReader(f)}
    block = next(body for lang, body in blocks(read("docs/training.md"))
                 if lang == "python" and "onnxruntime" in body)
    for file in files:
        scope = {}
        exec(block.replace("runs/pets/model.onnx", str(target)).replace("my_images/val/3/014.png", str(file)),
             scope)
        assert (scope["pixels"] == fitted(read_image(str(file)), 16).permute(1, 2, 0).numpy()).all(), file
        chances = torch.from_numpy(scope["outputs"]).softmax(1)[0]
        row, printed = predicted[str(file)], capsys.readouterr().out.strip()
        assert printed == row["class"] and abs(float(chances.max()) - float(row["probability"])) < 1e-4, file


@pytest.mark.parametrize("model, resize, suffix", [("resnet18", 0, ".pt2"), ("squeezenet1_1", 17, ".onnx")])
def test_a_torchvision_model_exports(model, resize, suffix, tmp_path, monkeypatch, capsys):
    """resnet18 takes the 16 px images as they are; squeezenet1_1 needs 17 px: the resize the run did on
    the device is in the graph (onnxruntime's Resize matches torch's bilinear one), which still takes the
    16 px images. (resnet18 as .pt2: its ONNX export takes 3x longer, the path the others test.)"""
    code, _, err = run_main(monkeypatch, capsys, *CPU, "--dataset", "synthetic", "--synthetic-size", "64",
                            "--num-classes", "3", "--batch-size", "32", "--model", model, "--epochs", "1",
                            "--lr", "0.01", "--out-dir", tmp_path / "run")
    assert code == 0, err
    out = exported(monkeypatch, capsys, tmp_path / "run" / "best.pt", tmp_path / f"model{suffix}")
    assert "first 16 examples" in out and re.search(CHECKED, out), out
    meta = metadata(tmp_path / f"model{suffix}")
    assert meta["images"]["resize"] == resize
    assert meta["inputs"] == {"images": {"shape": ["N", 3, 16, 16], "dtype": "uint8"}}


@pytest.mark.parametrize("dataset, suffix, names", [("pairs", ".onnx", ["inputs_0", "inputs_1"]),
                                                    ("pairs_dict", ".pt2", ["inputs_image", "inputs_table"])])
def test_a_two_input_fork_exports_each_input_as_one_argument(dataset, suffix, names, tmp_path, monkeypatch,
                                                             capsys):
    """The fork of tests/test_several_inputs.py: an 8x8 uint8 image (normalized inside) and 4 floats, one
    graph input each; fed the val split as the dataset gives it, the file scores the run's accuracy."""
    add_entries(monkeypatch, "two_inputs_data", "two_inputs_model")
    cfg = parse_config(["--dataset", dataset, "--model", "twoinputnet", "--width", "8", "--synthetic-size",
                        "256", "--batch-size", "32", "--epochs", "2", "--lr", "0.05", *CPU, "--out-dir",
                        str(tmp_path / "run")])
    summary = train.train(cfg)
    target = tmp_path / f"model{suffix}"
    exported(monkeypatch, capsys, tmp_path / "run" / "best.pt", target)
    inputs, labels = data.DATASETS[dataset](cfg).val
    parts = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    if suffix == ".onnx":
        runner = session(target)
        assert [(i.name, i.type) for i in runner.get_inputs()] == [(names[0], "tensor(uint8)"),
                                                                   (names[1], "tensor(float)")]
        feed = {name: t.numpy() for name, t in zip(names, parts, strict=True)}
        logits = torch.from_numpy(runner.run(None, feed)[0])
    else:
        logits = torch.export.load(target).module()(*parts)
    assert (logits.argmax(1) == labels).float().mean().item() == pytest.approx(summary["best_val_acc"])


def test_the_docs_variable_length_fork_exports_its_padded_clips_or_refuses_in_one_line(tmp_path, monkeypatch,
                                                                                        capsys):
    """Issue 54, 5: docs/your_data.md's `calls` (clips of 50 to 200 frames, padded to 200 by its Source's
    collate, with their lengths as a second input) ended --export in torch's 'stack expects each tensor to
    be equal size' traceback: the export stacked the clips itself. It takes the collate's batches now, two
    inputs, and scores the run's accuracy; a collate that pads each batch to its own longest clip would
    make a file of one length only: refused in one line, nothing left."""
    scope, model_scope = {**vars(data), "DATASETS": {}}, dict(vars(models))
    exec(docs_block("def calls(cfg: Config) -> Source:"), scope)
    exec(docs_block("class LengthPooled(nn.Module):"), model_scope)
    monkeypatch.setitem(data.DATASETS, "calls", scope["DATASETS"]["calls"])
    monkeypatch.setitem(models.MODELS, "lengthpooled", model_scope["LengthPooled"])
    cfg = parse_config(["--dataset", "calls", "--model", "lengthpooled", "--synthetic-size", "160",
                        "--batch-size", "16", "--width", "16", "--optimizer", "adamw", "--lr", "0.01",
                        "--epochs", "2", *CPU, "--out-dir", str(tmp_path / "run")])
    summary, best = train.train(cfg), tmp_path / "run" / "best.pt"
    out = exported(monkeypatch, capsys, best, tmp_path / "calls.onnx")
    assert "first 32 examples" in out and re.search(CHECKED, out), out
    assert metadata(tmp_path / "calls.onnx")["inputs"] == {"inputs_0": {"shape": ["N", 1, 40, 200],
                                                                        "dtype": "float32"},
                                                           "inputs_1": {"shape": ["N"], "dtype": "int64"}}
    val = scope["calls"](cfg).val
    (clips, lengths), labels = scope["padded"]([val[i] for i in range(len(val))])
    feed = {"inputs_0": clips.numpy(), "inputs_1": lengths.numpy()}
    logits = torch.from_numpy(session(tmp_path / "calls.onnx").run(None, feed)[0])
    assert (logits.argmax(1) == labels).float().mean().item() == summary["best_val_acc"]

    def longest(examples):  # each batch padded to its own longest clip
        (clips, lengths), labels = scope["padded"](examples)
        return (clips[..., :int(lengths.max())], lengths), labels

    monkeypatch.setitem(data.DATASETS, "calls", lambda cfg: dataclasses.replace(scope["calls"](cfg),
                                                                                collate=longest))
    before = sorted(tmp_path.iterdir())
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", best, "--export", tmp_path / "x.pt2",
                                  *CPU)
    line = assert_one_line_failure(code, out, err)
    assert "--export: the data's batches change shape with their examples (inputs_0 [1, 1, 40, " in line, line
    assert "pad every batch to one shape in the Source's collate" in line
    assert sorted(tmp_path.iterdir()) == before  # no file, no staging folder


def unexportable(self, x):  # a Python branch on a tensor's values: torch.export cannot trace it
    outputs = torch.nn.Sequential.forward(self, x)
    if x.sum() > 0:
        return outputs
    return -outputs


def wrong_steps(self, i, x):  # a graph that feeds the model raw pixels, as a hand-made export would
    return x.float()


BAD = {  # name: (extra arguments, the target's name, what to patch, the line's words)
    "an unknown suffix": ([], "model.h5", None, "--export {target}: .h5 is no format here; name the file "
                                                "model.onnx (ONNX, for onnxruntime) or model.pt2"),
    "no folder there": ([], "missing/model.onnx", None, "--export {target}: cannot write in"),
    "a file as the folder": ([], "best.pt/model.onnx", None, "--export {target}: cannot write in"),
    "a folder as the file": ([], "best.onnx", "folder", "--export {target}: a folder; give a file name"),
    "onnxscript not installed": ([], "model.onnx", "onnxscript", "--export .onnx needs onnxscript, not "
                                 "installed here: pip install onnx onnxscript onnxruntime"),
    "a model torch.export cannot trace": (
        [], "model.pt2", "forward", "--export: the model cannot be exported: GuardOnDataDependentSymNode: "
        "Could not guard on data-dependent expression"),
    "an export that differs": ([], "model.pt2", "steps", "--export: the exported model's outputs differ "
                               "from the PyTorch model's (max abs difference"),
    "--predict too": (["--predict", "x.png"], "model.onnx", None, "--predict and --export are two commands"),
}


@pytest.mark.parametrize("case", BAD)
def test_each_bad_case_is_one_line_and_leaves_no_file(case, digits_run, tmp_path, monkeypatch, capsys):
    more, name, patch, said = BAD[case]
    (tmp_path / "best.pt").write_bytes(b"")  # a file where a folder is asked for
    target = tmp_path / name
    if patch == "folder":
        target.mkdir()
    if patch == "onnxscript":
        monkeypatch.setitem(sys.modules, "onnxscript", None)  # `import onnxscript` raises ImportError
    if patch == "forward":
        monkeypatch.setattr(models.ResNetSmall, "forward", unexportable)
    if patch == "steps":
        monkeypatch.setattr(export.Deployed, "prepared", wrong_steps)
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", digits_run / "best.pt", "--export",
                                  target, *more, *CPU)
    line = assert_one_line_failure(code, out, err)
    assert said.format(target=target) in line, line
    assert sorted(tmp_path.rglob("*")) == before  # no file, no staging folder
    if patch == "forward":  # the line names the user's line the exporter stopped at
        assert "at test_export.py:" in line, line
        assert "in unexportable: `if x.sum() > 0:`" in line


def test_a_pt2_onto_a_full_disk_is_one_line_naming_the_disk(digits_run, tmp_path, monkeypatch, capsys):
    """Issue 54, 6: torch's own writer, its disk full, gave a line blaming the model ('[enforce fail at
    inline_container.cc:672] ; change that line of forward()'), then a C++ abort (exit 134). As .onnx does,
    it says 'No space left on device' in one line, and leaves nothing (the disk as test_faults fills it)."""
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if Path(path).name == "model.pt2" and "w" in mode:
            return io.BufferedWriter(DiskFull(1000))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(export, "open", full_disk, raising=False)
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", digits_run / "best.pt", "--export",
                                  tmp_path / "model.pt2", *CPU)
    line = assert_one_line_failure(code, out, err)
    assert line == "error: --export: cannot write model.pt2 (No space left on device)\n", line
    assert list(tmp_path.iterdir()) == []  # no file, no staging folder


def test_a_pt2_write_the_os_refuses_is_one_line_not_a_cpp_abort(digits_run, tmp_path):
    """The same with a real write error, which torch's C++ writer met: files limited to 100 kB (RLIMIT_FSIZE,
    as a quota would), the write fails with EFBIG; the process ends in one line, not exit 134."""
    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    done = subprocess.run([*LAUNCH, "evaluate.py", "--checkpoint", str(digits_run / "best.pt"),
                           "--export", str(tmp_path / "model.pt2"), *CPU], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, preexec_fn=limited)
    line = assert_one_line_failure(done.returncode, done.stdout, done.stderr)
    assert done.returncode == 2 and line == "error: --export: cannot write model.pt2 (File too large)\n", line
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_export_in_one_line(tmp_path, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "--export", tmp_path / "model.onnx", "--out-dir", tmp_path)
    assert "--export is evaluate.py's" in assert_one_line_failure(code, out, err)
    assert list(tmp_path.iterdir()) == []


def test_the_check_compares_classes_only_where_the_task_has_them():
    """Outputs within the tolerance pass as numbers (a regression's); a classifier's top class must agree
    too, and one example whose class flips within the tolerance is refused."""
    raw, reference = torch.zeros(8, 2), {None: torch.tensor([[1.0, 1.0 - 1e-6]] * 8)}

    def run(x):
        return [torch.tensor([[1.0 - 2e-6, 1.0 - 1e-6]] * len(x))]

    assert export.check(run, raw, reference, classes=False) == "max abs difference 2.0e-06"
    with pytest.raises(export.UserError, match=r"max abs difference 2.0e-06, the top class agrees on 0.00%"):
        export.check(run, raw, reference, classes=True)
    with pytest.raises(export.UserError, match=r"max abs difference 2.0e-04"):
        export.check(lambda x: [torch.tensor([[1.0 - 2e-4, 1.0]] * len(x))], raw, reference, classes=False)
