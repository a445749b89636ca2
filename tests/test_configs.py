import dataclasses

import pytest

import configs
import lr_find
import train
from configs import Config, UserError, parse_config, parse_given

FRONT = {**train.CHOICES, "find_method": lr_find.METHODS}  # what train.py and lr_find.py pass down
CHOICES = {f.name: configs.choices_of(f.name, FRONT) for f in dataclasses.fields(Config)
           if configs.choices_of(f.name, FRONT)}


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
    if name == "log_to":  # a comma list of LOGS
        return "tensorboard"
    if name == "num_workers":  # a number, or auto
        return "3"
    if isinstance(default, int):
        return str(default + 1)
    if isinstance(default, float):
        return str(default + 0.5)
    return f"{default}-changed" if default else "runs/a/best.pt"  # an empty default: a path


def test_every_field_has_a_flag():
    """Each flag, set to a value other than the default, changes its own field and no other."""
    needs = {"warmup_epochs": ["--schedule", "cosine"],  # onecycle has no warmup_epochs
             "peak_tflops": ["--throughput"]}  # the peak --throughput's MFU divides by
    for field in dataclasses.fields(Config):
        flag, default = "--" + field.name.replace("_", "-"), field.default
        if isinstance(default, bool):
            argv, value = [flag if not default else "--no-" + flag[2:]], not default
        else:
            text = "runs/a/last.pt" if field.name == "resume" else other_value(field.name, default)
            argv = [flag, text]
            value = (int(text) if field.name == "num_workers" else
                     text if isinstance(default, str) and field.name != "lr" else type(default)(text))
        expected = dataclasses.replace(Config(), **{field.name: value})
        if field.name in needs:
            argv += needs[field.name]
            expected = dataclasses.replace(expected, **parse_given(needs[field.name]))
        cfg = parse_config(argv)
        assert getattr(cfg, field.name) == value != default, field.name
        assert cfg == expected, field.name


def test_lr_auto_and_resume_forms():
    assert parse_config(["--lr", "auto"]).lr == "auto"
    assert parse_config(["--resume"]).resume == "last"
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
        parse_config(argv, choices=FRONT)
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


# ---------------------------------------------------------------- each rule at its field (issue 12)

OUTSIDE = {"> 0": "0", ">= 0": "-1", ">= 10": "9", "in [0, 1]": "1.5", "in [0, 1)": "1", "in (0, 1)": "0",
           "in [0, 2**32)": str(2**32)}


@pytest.mark.parametrize("name", list(configs.LIMITS))
def test_each_declared_range_is_enforced(name):
    """A value just outside the range LIMITS gives the field is refused, naming the field and range."""
    limits = configs.LIMITS[name]
    with pytest.raises(UserError) as err:
        parse_config(["--" + name.replace("_", "-"), OUTSIDE[limits]])
    assert str(err.value).startswith(f"{name} must be a number {limits}")
    if limits not in ("in [0, 1]", "in [0, 1)", "in (0, 1)"):  # and never inf, nor nan
        for value in ("inf", "nan"):
            with pytest.raises(UserError, match=f"{name} (must be a number|expects an integer)"):
                parse_config(["--" + name.replace("_", "-"), value])


def test_every_field_has_help_and_numbers_a_range():
    """Each field has a line in configs/help.toml (no other line is there) and, a number, a range in LIMITS;
    a table names only Config's fields."""
    texts = configs.help_texts()
    for field in dataclasses.fields(Config):
        assert len(texts[field.name]) > 10, field.name
        number = isinstance(field.default, int | float) and not isinstance(field.default, bool)
        assert configs.LIMITS.get(field.name) or not number or field.name == "lr", field.name
    assert list(texts) == list(configs.DEFAULTS)  # in Config's order
    assert set(configs.LIMITS) | set(configs.ALLOWED) <= set(configs.DEFAULTS)


def test_the_choices_are_read_where_they_are_defined():
    """Each list of names is defined once, in the module that builds them (the datasets in data.py, the
    optimizers in models.py, the schedules in schedules.py, lr_find's rules in lr_find.py), and every
    field that names one takes its choices from there, passed down by the scripts ("auto" lets lr_find
    pick its rule by schedule)."""
    import torch

    import data
    import models
    import schedules
    from machinery import processes

    assert train.CHOICES["dataset"] is data.DATASETS
    assert train.CHOICES["optimizer"] is models.OPTIMIZERS
    assert train.CHOICES["schedule"] is schedules.SCHEDULES
    assert {lr_find.family_of(s) for s in schedules.SCHEDULES} == {"peak", "base"}  # each one's suggestion
    for mode in CHOICES["amp"]:
        processes.amp_dtype(torch.device("cpu"), mode)
    assert CHOICES == {"dataset": tuple(data.DATASETS), "loader": ("auto", "device", "host", "dataloader"),
                       "optimizer": tuple(models.OPTIMIZERS), "schedule": schedules.SCHEDULES,
                       "find_method": ("auto", *lr_find.METHODS), "amp": ("auto", "bf16", "fp16", "off"),
                       "tta": ("none", "flip"), "split": ("val", "test"),
                       "compile": ("off", "default", "reduce-overhead", "max-autotune")}

def test_a_new_registry_entry_is_a_choice_at_once(monkeypatch):
    """A dataset or optimizer added to its dict is accepted, listed in --help, and nowhere else to add."""
    import data
    import models

    monkeypatch.setitem(data.DATASETS, "mine", data.digits)
    monkeypatch.setitem(models.OPTIMIZERS, "sgd2", models.OPTIMIZERS["sgd"])
    cfg = parse_config(["--dataset", "mine", "--optimizer", "sgd2"], choices=train.CHOICES)
    assert (cfg.dataset, cfg.optimizer) == ("mine", "sgd2")
    with pytest.raises(UserError, match="choose from .*mine"):
        parse_config(["--dataset", "mien"], choices=train.CHOICES)


def test_help_says_what_0_and_auto_mean(capsys):
    """Every 0 that means something other than zero, and every 'auto', is explained in --help."""
    with pytest.raises(SystemExit) as done:
        parse_config(["--help"])
    assert done.value.code == 0
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps lines, even at hyphens
    texts = configs.help_texts()
    for field in dataclasses.fields(Config):
        text = texts[field.name]
        assert "".join(text.split()) in shown, field.name
        if field.default == 0 and not isinstance(field.default, bool) and field.name != "seed":
            assert "0:" in text or "0 turns" in text, field.name
        if field.default == "auto" or "auto" in (configs.choices_of(field.name, FRONT) or ()):
            assert "auto:" in text, field.name
    lr_help = texts["lr"]
    assert "auto:" in lr_help


# ---------------------------------------------------------------- each script's own flags (issue 53)

@pytest.mark.parametrize("argv, command", [
    (["--checkpoint", "runs/a/best.pt"], "`python evaluate.py --checkpoint runs/x/best.pt`"),
    (["--split", "test"], "`python evaluate.py --split test --checkpoint runs/x/best.pt`"),
    (["--predict", "x.png"], "`python evaluate.py --predict PATH --checkpoint runs/x/best.pt`"),
    (["--top-k=3"], "`python evaluate.py --predict PATH --top-k 3 --checkpoint runs/x/best.pt`"),
    (["--tta", "flip"], "`python evaluate.py --predict PATH --tta flip --checkpoint runs/x/best.pt`"),
    (["--export", "model.onnx"], "`python evaluate.py --export model.onnx --checkpoint runs/x/best.pt`"),
])
def test_train_neither_lists_nor_takes_evaluates_flags(argv, command, tmp_path, monkeypatch, capsys):
    """Each of evaluate.py's flags given to train.py is one line naming the evaluate.py command that takes
    it; nothing is written. --help lists train.py's own flags only."""
    from conftest import run_main

    code, out, err = run_main(monkeypatch, capsys, *argv, "--out-dir", tmp_path / "run")
    flag = argv[0].split("=")[0]
    assert code == 2 and err == f"error: {flag} is evaluate.py's: {command}\n" and "Traceback" not in out
    assert list(tmp_path.iterdir()) == []
    code, out, _ = run_main(monkeypatch, capsys, "--help")
    options = {line.split()[0] for line in out.splitlines() if line.startswith("  --")}
    assert code == 0 and flag not in options and "--epochs" in options and flag not in out.split("usage:")[1]


def test_a_run_reads_no_help_text(monkeypatch):
    """configs/help.toml is read to print --help only: parsing and checking a run's flags never opens it."""
    def opened():
        raise AssertionError("help_texts() read outside --help")

    monkeypatch.setattr(configs, "help_texts", opened)
    assert parse_config(["--epochs", "2", "--no-augment", "--compile", "--resume"]).epochs == 2
    with pytest.raises(UserError, match="did you mean '--epochs'"):
        parse_config(["--epoch", "2"])
