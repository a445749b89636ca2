"""Every setting: one line of Config each, its range and allowed values in the tables below it, its help text
in configs/help.toml; presets in TOML; any field overridable as --field-name. Precedence: defaults < --config
FILE.toml < flags; a resume puts the checkpoint's config in place of the first two. A field whose names are a
list the front owns (the datasets, optimizers, schedules) takes them from the `choices` its caller passes
down: this package imports no module of the template's. Bad input is a UserError: one line saying what is
wrong and the fix. What only --config, --help or an error needs is imported where it is used."""

from __future__ import annotations

import math
from argparse import SUPPRESS, Action, ArgumentParser
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass

OUT_DIR_RESUMES = ("last", "auto")  # --resume of <out_dir>/last.pt: plain --resume (it must be there), auto
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")  # torch.compile's modes; off: eager
LOGS = ("tensorboard", "csv", "wandb", "mlflow")  # --log-to: where a run's points go (machinery/trackers.py)


@dataclass
class Config:
    # data
    dataset: str = "digits"
    data_dir: str = "data"
    image_size: int = 0
    num_classes: int = 10
    channels: int = 3
    synthetic_size: int = 2048
    synthetic_val_size: int = 0
    val_fraction: float = 0.1
    loader: str = "auto"
    num_workers: int | str = "auto"
    image_cache: str = "auto"
    augment: bool = True
    flip: bool = True
    balance_classes: bool = False
    # model and optimizer
    model: str = "resnet_small"
    pretrained: bool = False
    init_from: str = ""
    width: int = 32
    dropout: float = 0.0
    optimizer: str = "sgd"
    lr: float | str = 0.2
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    clip_grad: float = 0.0
    ema: float = 0.0
    # schedule (counts in epochs here, converted to optimizer steps by schedules.py); lr_find's sweep
    # does not depend on any of them, so --lr auto compares none
    schedule: str = "onecycle"
    epochs: int = 10
    batch_size: int = 128
    accum_steps: int = 1
    warmup_epochs: float = 0.0
    step_size: float = 0.0
    gamma: float = 0.1
    min_lr_ratio: float = 0.0
    pct_start: float = 0.25
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    # lr_find.py
    find_start_lr: float = 1e-5
    find_end_lr: float = 10.0
    find_iters: int = 50
    find_method: str = "auto"
    # runtime
    device: str = "auto"
    amp: str = "auto"
    channels_last: bool = False
    compile: str = "off"
    throughput: bool = False
    peak_tflops: float = 0.0
    profile: int = 0
    seed: int = 0
    seeds: int = 0
    log_to: str = "tensorboard,csv"
    log_model: bool = False
    deterministic: bool = False
    dist_timeout: float = 60.0
    out_dir: str = "runs/default"
    log_every: int = 20
    save_every: int = 0
    early_stop: int = 0
    min_delta: float = 0.0
    keep_best: int = 0
    resume: str = ""
    allow_more_epochs: bool = False
    # evaluate.py (how a saved model is run: never taken from its checkpoint's config)
    checkpoint: str = "runs/default/best.pt"
    split: str = "val"
    predict: str = ""
    top_k: int = 5
    tta: str = "none"
    export: str = ""
    average: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = Config().to_dict()
# The range each number must lie in; lr's (> 0, or auto) is checked in validate.
LIMITS = {"image_size": ">= 0", "num_classes": "> 0", "channels": "> 0", "synthetic_size": "> 0",
          "synthetic_val_size": ">= 0", "val_fraction": "in (0, 1)", "num_workers": ">= 0", "width": "> 0",
          "dropout": "in [0, 1)", "momentum": ">= 0", "weight_decay": ">= 0", "label_smoothing": "in [0, 1]",
          "clip_grad": ">= 0", "ema": "in [0, 1)", "epochs": "> 0", "batch_size": "> 0", "accum_steps": "> 0",
          "warmup_epochs": ">= 0", "step_size": ">= 0", "gamma": "> 0", "min_lr_ratio": "in [0, 1]",
          "pct_start": "in (0, 1)", "div_factor": "> 0", "final_div_factor": "> 0", "find_start_lr": "> 0",
          "find_end_lr": "> 0", "find_iters": ">= 10", "seed": "in [0, 2**32)", "seeds": ">= 0",
          "dist_timeout": "> 0", "log_every": "> 0", "save_every": ">= 0", "early_stop": ">= 0",
          "min_delta": ">= 0", "top_k": "> 0", "peak_tflops": ">= 0", "profile": ">= 0", "keep_best": ">= 0"}
# How each range is checked: never nan or inf. Seeds: epoch_plan's generator takes 64 bits.
IN_RANGE = {"> 0": lambda v: 0 < v < math.inf, ">= 0": lambda v: 0 <= v < math.inf,
            ">= 10": lambda v: 10 <= v < math.inf, "in [0, 1]": lambda v: 0 <= v <= 1,
            "in [0, 1)": lambda v: 0 <= v < 1, "in (0, 1)": lambda v: 0 < v < 1,
            "in [0, 2**32)": lambda v: 0 <= v < 2**32}
# The values a field may take; find_method's rules, and the names FRONT_LISTS' fields take, are passed down.
ALLOWED = {"loader": ("auto", "device", "host", "dataloader"), "find_method": ("auto",),
           "amp": ("auto", "bf16", "fp16", "off"), "compile": COMPILE_MODES, "split": ("val", "test"),
           "tta": ("none", "flip")}
FRONT_LISTS = ("dataset", "optimizer", "schedule", "find_method")  # fields the front's lists name
OR_AUTO = {"lr": float, "num_workers": int}  # numbers that also take "auto"
ALONE = {"resume": "last", "compile": "default", "average": "measure"}  # given alone: no value to give
EXPECTS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
MODE_SETTINGS = ("checkpoint", "split", "predict", "top_k", "tta", "export", "average")
TRAIN_SETTINGS = tuple(name for name in DEFAULTS if name not in MODE_SETTINGS)  # train.py's flags


class UserError(ValueError):
    """Bad user input (config, data, checkpoint), or a stop; one line that says what happened and the
    fix. `code`: the exit status the scripts end with (2; a signal's stop: 128 + its number)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def parse_given(argv: list[str] | None = None, description: str = "", choices: dict | None = None, *,
                offered: Collection[str] | None = None,
                elsewhere: str | Callable[[str], str] = "another script takes it (train.py or evaluate.py); "
                "--help lists this one's options") -> dict:
    """The settings the flags and --config give, typed, not yet checked. `offered`: this script's fields
    (None: all); another's flag is one line, ending with `elsewhere`; other TOML keys are skipped."""
    offered = DEFAULTS if offered is None else offered
    args, unknown = _Parser(description, choices, offered).parse_known_args(argv)
    if unknown:
        _refuse(unknown[0], offered, elsewhere)
    given = vars(args)
    config = given.pop("config", None)
    preset = {k: v for k, v in load_toml(config).items() if k in offered} if config else {}
    return {**preset, **{name: _convert(name, raw) for name, raw in given.items()}}


def parse_config(argv: list[str] | None = None, description: str = "", choices: dict | None = None, *,
                 offered: Collection[str] | None = None) -> Config:
    """Build the Config from defaults, an optional --config TOML and command-line flags, checked."""
    return validate(Config(**parse_given(argv, description, choices, offered=offered)), choices)


def validate(cfg: Config, choices: dict[str, Collection[str]] | None = None) -> Config:
    """Each field in its allowed values (`choices`: the front's lists, {"dataset": DATASETS}) or range."""
    for name, value in vars(cfg).items():
        allowed, limits = choices_of(name, choices), LIMITS.get(name)
        if allowed and value not in allowed:
            raise UserError(f"unknown {name} {value!r}{_suggest(value, allowed)} "
                            f"(choose from {', '.join(allowed)})")
        if limits and value != "auto" and not IN_RANGE[limits](value):
            raise UserError(f"{name} must be a number {limits}, got {value}")
    if cfg.lr != "auto" and not 0 < cfg.lr < math.inf:
        raise UserError(f"lr must be a number > 0 (or auto), got {cfg.lr}")
    if cfg.peak_tflops and not cfg.throughput:
        raise UserError("--peak-tflops is the peak that --throughput's MFU divides by: add --throughput")
    if cfg.find_start_lr >= cfg.find_end_lr:
        raise UserError(f"find_start_lr ({cfg.find_start_lr}) must be below find_end_lr ({cfg.find_end_lr})")
    if cfg.schedule == "onecycle" and cfg.warmup_epochs:
        raise UserError("warmup_epochs does not apply to onecycle; its warm phase is pct_start")
    if unknown := [name for name in cfg.log_to.split(",") if name not in LOGS]:
        raise UserError(f"unknown --log-to {unknown[0]!r}{_suggest(unknown[0], LOGS)}: a comma list of "
                        f"{', '.join(LOGS)}")
    if cfg.schedule == "warmup" and not cfg.warmup_epochs:
        raise UserError("the warmup schedule needs --warmup-epochs > 0 (e.g. --warmup-epochs 1); "
                        "for a constant rate without warmup use --schedule constant")
    return cfg


def choices_of(name: str, choices: dict | None = None) -> tuple[str, ...] | None:
    """A field's allowed values: ALLOWED's, then the front's list in `choices`; None: any."""
    listed = (choices or {}).get(name)
    if listed is None:
        return None if name in FRONT_LISTS else ALLOWED.get(name)
    return (*ALLOWED.get(name, ()), *listed)


def command_line(script: str, cfg: Config, leave_out: tuple[str, ...]) -> str:
    """`python SCRIPT --flag value ...` giving cfg's settings that differ from the defaults."""
    import shlex

    args = ["python", script]
    for name, default in DEFAULTS.items():
        value = getattr(cfg, name)
        if name in leave_out or name == "resume" or (value == default and name != "out_dir"):
            continue
        if isinstance(value, bool):
            args.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        else:
            args += [_flag(name), str(value)]
    return shlex.join(args)


def help_texts() -> dict[str, str]:
    """Each field's --help text, from configs/help.toml: read only when --help is asked for."""
    from pathlib import Path

    import tomllib

    return tomllib.loads(Path(__file__).with_name("help.toml").read_text(encoding="utf-8"))


def first_line(err: object, limit: int | None = 160) -> str:
    """An exception's (or a reason's) first line, to quote in a line of ours; its type's name where it
    says nothing."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


def exit_with_error(message: str, status: int = 2):
    import sys

    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


def load_toml(path: str) -> dict:
    from pathlib import Path

    import tomllib

    file = Path(path)
    if not file.is_file():
        presets = ", ".join(f"configs/{p.name}" for p in sorted(Path(__file__).parent.glob("*.toml"))
                            if p.name != "help.toml")
        raise UserError(f"config file {path} not found (presets: {presets})")
    try:
        values = tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path}: not valid TOML ({err})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not valid TOML (TOML files are UTF-8 text)") from None
    except OSError as err:
        raise UserError(f"config file {path} cannot be read ({err.strerror or err})") from None
    out, keys = {}, {}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if isinstance(raw, dict) and name not in DEFAULTS:  # TOML puts the keys after a [section] in it
            raise UserError(f"{path}: [{key}] is a section, and a preset's settings are read from the top "
                            "level only; move them above any [section] line, or drop the header")
        if name not in DEFAULTS or name == "resume":
            raise UserError(f"{path}: unknown key {key!r}{_suggest(name, DEFAULTS)}")
        if name in keys:  # batch-size and batch_size are one setting: which one would win is no answer
            raise UserError(f"{path}: {keys[name]!r} and {key!r} both set {name}; keep one")
        keys[name], out[name] = key, _convert(name, _toml_typed(path, key, name, raw))
    return out


def _toml_typed(path: str, key: str, name: str, raw):
    """A TOML value of its field's type as TOML writes it (3, 0.1, true, "runs/x"; lr "auto" too), else one
    line: str() or float() of a list, a table or a quoted number would run with a value it never said."""
    kind = OR_AUTO.get(name) or type(DEFAULTS[name])
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    typed = {bool: isinstance(raw, bool), str: isinstance(raw, str)}.get(kind, number)
    if typed or (name in OR_AUTO and isinstance(raw, str)):  # lr, num_workers: a number, or "auto"
        return raw
    expects = EXPECTS[kind] + (" or 'auto'" if name in OR_AUTO else "")
    what = {bool: "a boolean", str: "a string", list: "a list", dict: "a table"}.get(type(raw))
    got = what or ("a number" if number else f"a {type(raw).__name__}")
    shown = repr(raw) if len(repr(raw)) <= 40 else repr(raw)[:37] + "..."
    raise UserError(f"{path}: {key} expects {expects}, got {got}: {shown}")


def _convert(name: str, raw):
    """A flag's text, a TOML value or a saved one as its field's type; "auto" where a number may be."""
    kind = OR_AUTO.get(name) or type(DEFAULTS[name])
    if name in OR_AUTO and isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    if kind is bool:
        return _boolean(name, raw)
    if isinstance(raw, bool) or kind is int and isinstance(raw, float) and not raw.is_integer():
        raise _not_a(kind, name, raw)
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise _not_a(kind, name, raw) from None


def _boolean(name: str, raw) -> bool:
    text = str(raw).strip().lower()  # True and False too: "true", "false"
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise UserError(f"{name} expects true or false, got {raw!r}")


def _not_a(kind: type, name: str, raw) -> UserError:
    """The line for a value its field's type cannot take; --lr find names the command that runs the sweep."""
    if name == "lr" and isinstance(raw, str) and raw.strip().lower() == "find":
        return UserError("--lr find: the range test runs as its own command: `python lr_find.py` with the "
                         "same options, then `python train.py ... --lr auto` trains with its rate")
    hint = " or 'auto'" if name in OR_AUTO and not isinstance(raw, bool) else ""
    return UserError(f"{name} expects {EXPECTS[kind]}{hint}, got {raw!r}")


class _Parser(ArgumentParser):
    """The offered fields' flags, in Config's order; an error is a UserError. Each flag's help is written
    from configs/help.toml only when --help is asked for (format_help)."""

    def __init__(self, description: str, choices: dict | None, offered: Collection[str]):
        super().__init__(description=description, allow_abbrev=False, argument_default=SUPPRESS)
        self.front, self.fields = choices, []  # for --help: the front's lists, each field's flag
        self.add_argument("--config", help="TOML preset, e.g. configs/cifar10.toml")
        for name in (name for name in DEFAULTS if name in offered):
            if name in ALONE:
                flag = self.add_argument(_flag(name), nargs="?", const=ALONE[name], metavar=name.upper())
            elif isinstance(DEFAULTS[name], bool):  # --x, --x true|false, --no-x
                flag = self.add_argument(_flag(name), action=_Switch, nargs="?", metavar="true|false")
                self.add_argument("--no-" + _flag(name)[2:], action=_Switch, nargs="?", dest=name,
                                  help=SUPPRESS)
            else:
                flag = self.add_argument(_flag(name), metavar=name.upper())
            self.fields.append(flag)

    def error(self, message: str):
        raise UserError(message)

    def format_help(self) -> str:
        texts = help_texts()
        for flag in self.fields:
            flag.help = _described(flag.dest, texts[flag.dest], self.front)
        return super().format_help()


def _described(name: str, text: str, choices: dict | None) -> str:
    """A flag's --help entry: its text, then its choices or range and its default."""
    default = DEFAULTS[name]
    if name in ALONE:
        return text
    if isinstance(default, bool):
        return f"{text} (or --no-{_flag(name)[2:]}; default {default})"
    rule = ", ".join(choices_of(name, choices) or ()) or LIMITS.get(name)
    return f"{text} ({rule + '; ' if rule else ''}default {default!r})".replace("%", "%%")


class _Switch(Action):
    """A boolean as people type it: --x, --x true|false|yes|no|on|off|1|0, --x=false, --no-x."""

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                raise UserError(f"{option_string} takes no value; write --{option_string[5:]} {value}")
            value = False
        setattr(namespace, self.dest, True if value is None else _convert(self.dest, value))


def _refuse(bad: str, offered: Collection[str], elsewhere: str | Callable[[str], str]):
    """One line for the first word the parser did not take: another script's flag, a typo, a stray word."""
    if not bad.startswith("-"):
        raise UserError(f"unexpected argument {bad!r}; options look like --epochs 3")
    flag = bad.split("=")[0]
    if (name := flag[2:].replace("-", "_").removeprefix("no_")) in DEFAULTS and name not in offered:
        whose = elsewhere(name) if callable(elsewhere) else f"{flag} is not an option here: {elsewhere}"
        raise UserError(whose)
    flags = [_flag(n) for n in offered] + ["--config"]
    raise UserError(f"unknown option {flag}{_suggest(flag, flags)} (see --help)")


def _suggest(word: str, options) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def evaluate_takes(name: str) -> str:
    """train.py's line for one of evaluate.py's flags (MODE_SETTINGS): the evaluate.py command to run."""
    shown = {"checkpoint": "", "split": " --split test", "predict": " --predict PATH",
             "top_k": " --predict PATH --top-k 3", "tta": " --predict PATH --tta flip",
             "export": " --export model.onnx", "average": " --average"}[name]
    flag = "--" + name.replace("_", "-")
    return f"{flag} is evaluate.py's: `python evaluate.py{shown} --checkpoint runs/x/best.pt`"
