"""Fine-tuning: --pretrained (offline, and from a local weights file), --init-from, --evaluate."""

import json

import pytest
import torch
from conftest import build_loaders, fingerprint, run_evaluate, run_main
from PIL import Image

import train
from configs import parse_config
from machinery import checkpoints
from models import build_model

TINY = ["--dataset", "synthetic", "--synthetic-size", "64", "--num-classes", "2", "--image-size", "8",
        "--width", "4", "--batch-size", "16", "--epochs", "1", "--device", "cpu", "--num-workers", "0"]
SQUEEZENET = "squeezenet1_1-b8a52dc0.pth"  # the file torchvision's default squeezenet1_1 weights are


def assert_one_line_error(code, out: str, err: str) -> str:
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-epoch run on two classes: last.pt, best.pt, summary.json."""
    out = tmp_path_factory.mktemp("finished")
    train.train(parse_config([*TINY, "--epochs", "2", "--out-dir", str(out)]))
    return out


def test_pretrained_offline_is_one_line_naming_the_file_and_the_folder(torch_home, tmp_path,
                                                                       monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--image-size", "32", "--model",
                              "squeezenet1_1", "--pretrained", "--out-dir", tmp_path / "run")
    line = assert_one_line_error(code, out, err)
    assert SQUEEZENET in line and str(torch_home / "hub" / "checkpoints") in line
    assert "no network here" in line and "$TORCH_HOME/hub/checkpoints" in line
    assert not torch_home.exists(), "the failed download left folders behind"
    assert not (tmp_path / "run").exists(), "a run was half-built"


def test_pretrained_loads_the_local_weights_file_and_swaps_the_head(torch_home, tmp_path, capsys):
    import torchvision

    torch.manual_seed(0)  # stands in for the ImageNet file: 1000 classes, weights we know
    weights = torchvision.models.squeezenet1_1(weights=None).state_dict()
    (torch_home / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(weights, torch_home / "hub" / "checkpoints" / SQUEEZENET)
    cfg = parse_config([*TINY, "--image-size", "32", "--model", "squeezenet1_1", "--pretrained"])
    said = []
    model = build_model(cfg, 3, 2, notes=said)
    assert said == [
        "pretrained weights: torchvision's SqueezeNet1_1_Weights.IMAGENET1K_V1; classifier head "
        "classifier.1 re-initialised for 2 classes (was 1000)"]
    built = model.state_dict()
    assert built.keys() == weights.keys()
    for key, tensor in built.items():
        if key.startswith("classifier.1."):
            assert tensor.shape == (2, *weights[key].shape[1:]), key
        else:
            assert torch.equal(tensor, weights[key]), key

    # ImageFolder data at the weights' size (224), normalized with their mean and std.
    root = tmp_path / "images"
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for k in range(4):
                Image.new("RGB", (40, 30), (60 * k, 90, 200)).save(root / split / name / f"{k}.png")
    folder = ["--dataset", "imagefolder", "--data-dir", str(root), "--batch-size", "4"]
    batches, _, _, info = build_loaders(parse_config([*folder, "--model", "squeezenet1_1", "--pretrained"]),
                                     torch.device("cpu"))
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert info.input_shape[1:] == (224, 224) and next(iter(batches))[0].shape == (4, 3, 224, 224)
    assert torch.allclose(batches.denormalize(torch.zeros(1, 3, 1, 1)).flatten(), mean)
    assert torch.allclose(batches.scale[None].flatten(), 1 / (255 * std))

    # and a run trains from them, saying so once
    summary = train.train(parse_config([*folder, "--image-size", "32", "--model", "squeezenet1_1",
                                        "--pretrained", "--device", "cpu", "--num-workers", "0",
                                        "--epochs", "1", "--out-dir", str(tmp_path / "run")]))
    out = capsys.readouterr().out
    assert out.count("pretrained weights: torchvision's SqueezeNet1_1_Weights.IMAGENET1K_V1") == 1
    assert summary["steps"] == 2 and summary["val_loss"] == summary["val_loss"]  # not nan


def test_init_from_loads_equal_tensors_and_starts_a_new_run(finished, tmp_path, capsys):
    saved = checkpoints.load_checkpoint(finished / "best.pt")["model"]
    model = build_model(parse_config([*TINY, "--init-from", str(finished / "best.pt")]), 3, 2)
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    plain = tmp_path / "weights.pth"  # a plain state_dict, as DDP's module saves it
    torch.save({f"module.{k}": v for k, v in saved.items()}, plain)
    model = build_model(parse_config([*TINY, "--init-from", str(plain)]), 3, 2)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    capsys.readouterr()

    summary = train.train(parse_config([*TINY, "--init-from", str(finished / "best.pt"),
                                        "--out-dir", str(tmp_path / "run")]))
    assert summary["steps"] == 4 and summary["epochs"] == 1  # a run of its own, counted from 0
    assert f"weights from {finished / 'best.pt'}\n" in capsys.readouterr().out
    assert checkpoints.load_checkpoint(tmp_path / "run" / "last.pt")["config"]["init_from"]


def test_init_from_with_another_class_count_reinitialises_only_the_head(finished, capsys):
    saved = checkpoints.load_checkpoint(finished / "best.pt")["model"]
    cfg = parse_config([*TINY, "--num-classes", "3", "--init-from", str(finished / "best.pt")])
    said = []
    built = build_model(cfg, 3, 3, notes=said).state_dict()
    assert said == [f"weights from {finished / 'best.pt'}; classifier head 8 re-initialised for 3 classes "
                    "(was 2)"]
    differ = [k for k in saved if not (built[k].shape == saved[k].shape and torch.equal(built[k], saved[k]))]
    assert differ == ["8.weight", "8.bias"] and built["8.weight"].shape == (3, 16)


def test_init_from_another_architecture_is_one_line(finished, tmp_path, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--width", "8", "--init-from",
                              finished / "best.pt", "--out-dir", tmp_path / "run")
    line = assert_one_line_error(code, out, err)
    assert f"--init-from {finished / 'best.pt'} does not fit" in line
    assert "0.0.weight [4, 3, 3, 3] there, [8, 3, 3, 3] here" in line and " more)" in line
    assert "it holds resnet_small width 4" in line
    assert not (tmp_path / "run" / "last.pt").exists()


def test_evaluate_reproduces_the_summary_and_touches_no_checkpoint(finished, monkeypatch, capsys):
    before = fingerprint(finished)
    summary = json.loads((finished / "summary.json").read_text())
    for name, key in (("last.pt", "val_acc"), ("best.pt", "best_val_acc")):
        code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", finished / name, "--device", "cpu")
        assert code == 0 and err == "", err
        report = json.loads((finished / "eval.json").read_text())
        assert report["val_acc"] == summary[key]
        assert f"val acc {summary[key]:.2%}" in out
        assert sum(map(sum, report["confusion"])) == report["val_size"] == 16
        assert list(report["per_class_acc"]) == ["0", "1"]
        if name == "last.pt":
            assert report["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert (finished / "eval_confusion.png").stat().st_size > 0
    assert fingerprint(finished) == before
