import dataclasses

import pytest

from configs import _CHOICES as CHOICES
from configs import Config, UserError, parse_config


def test_defaults_are_the_offline_quick_start():
    cfg = parse_config([])
    assert (cfg.dataset, cfg.model, cfg.optimizer, cfg.nesterov, cfg.schedule) == (
        "digits", "resnet_small", "sgd", True, "onecycle")


def test_flags_override_toml_which_overrides_defaults(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('epochs = 7\nlr = 0.05\nschedule = "cosine"\nchannels_last = true\n')
    cfg = parse_config(["--config", str(preset), "--epochs", "3", "--batch-size", "64",
                        "--out-dir", "runs/x", "--device", "cpu", "--seed", "1", "--no-nesterov"])
    assert (cfg.epochs, cfg.lr, cfg.schedule, cfg.batch_size) == (3, 0.05, "cosine", 64)
    assert (cfg.out_dir, cfg.device, cfg.seed, cfg.channels_last, cfg.nesterov) == (
        "runs/x", "cpu", 1, True, False)


def other_value(name: str, default):
    """A valid value for field `name` that is not its default, as a command-line string."""
    if name in CHOICES:
        return next(choice for choice in CHOICES[name] if choice != default)
    if isinstance(default, int):
        return str(default + 1)
    if isinstance(default, float):
        return str(default + 0.5)
    return f"{default}-changed" if default else "runs/a/best.pt"  # an empty default: a path


def test_every_field_has_a_flag():
    """Each flag, set to a value other than the default, changes its own field and no other."""
    needs = {"warmup_epochs": ["--schedule", "cosine"]}  # onecycle has no warmup_epochs
    for field in dataclasses.fields(Config):
        flag, default = "--" + field.name.replace("_", "-"), field.default
        if isinstance(default, bool):
            argv, value = [flag if not default else "--no-" + flag[2:]], not default
        else:
            text = "runs/a/last.pt" if field.name == "resume" else other_value(field.name, default)
            argv = [flag, text]
            value = text if isinstance(default, str) and field.name != "lr" else type(default)(text)
        expected = dataclasses.replace(Config(), **{field.name: value})
        if field.name in needs:
            argv += needs[field.name]
            expected.schedule = "cosine"
        cfg = parse_config(argv)
        assert getattr(cfg, field.name) == value != default, field.name
        assert cfg == expected, field.name


def test_lr_auto_and_resume_forms():
    assert parse_config(["--lr", "auto"]).lr == "auto"
    assert parse_config(["--resume"]).resume == "auto"
    assert parse_config(["--resume", "runs/a/last.pt"]).resume == "runs/a/last.pt"


@pytest.mark.parametrize("name", ["cifar10", "mnist", "fashion_mnist"])
def test_presets_load(name):
    cfg = parse_config(["--config", f"configs/{name}.toml"])
    assert cfg.dataset == name


@pytest.mark.parametrize("argv, words", [
    (["--epoch", "3"], ["--epoch", "--epochs"]),
    (["--epochs", "two"], ["epochs", "integer"]),
    (["--lr", "-1"], ["lr", "> 0"]),
    (["--lr", "fast"], ["lr", "auto"]),
    (["--batch-size", "0"], ["batch_size", "> 0"]),
    (["--schedule", "cosin"], ["schedule", "cosine"]),
    (["--dataset", "cifar"], ["dataset", "cifar10"]),
    (["--config", "configs/nope.toml"], ["configs/nope.toml", "not found", "cifar10.toml"]),
    (["--label-smoothing", "2"], ["label_smoothing", "[0, 1]"]),
    (["--schedule", "onecycle", "--warmup-epochs", "1"], ["pct_start"]),
    (["stray"], ["stray"]),
])
def test_bad_input_names_the_key_and_fix(argv, words):
    with pytest.raises(UserError) as err:
        parse_config(argv)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_toml_typos_and_types(tmp_path):
    bad_key = tmp_path / "k.toml"
    bad_key.write_text("epoch = 3\n")
    with pytest.raises(UserError, match="unknown key 'epoch'; did you mean 'epochs'"):
        parse_config(["--config", str(bad_key)])
    bad_type = tmp_path / "t.toml"
    bad_type.write_text('epochs = "many"\n')
    with pytest.raises(UserError, match="epochs expects an integer"):
        parse_config(["--config", str(bad_type)])
    broken = tmp_path / "b.toml"
    broken.write_text("epochs = \n")
    with pytest.raises(UserError, match="not valid TOML"):
        parse_config(["--config", str(broken)])
