"""Every setting in one dataclass; presets in TOML; any field overridable as --field-name.

Precedence: dataclass defaults < --config FILE.toml < command-line flags. Bad input becomes a
UserError with one line saying what is wrong and how to fix it; the scripts print it and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib

SCHEDULES = ("constant", "step", "onecycle", "warmup", "cosine")
DATASETS = ("digits", "mnist", "fashion_mnist", "cifar10", "cifar100", "imagefolder", "synthetic")
OPTIMIZERS = ("sgd", "adamw")
AMP_MODES = ("auto", "bf16", "fp16", "off")
LOADERS = ("auto", "device", "dataloader")
FIND_METHODS = ("steepest", "min/10", "valley")


@dataclass
class Config:
    # data
    dataset: str = "digits"
    data_dir: str = "data"
    image_size: int = 0  # 0: the dataset's own size (synthetic: 16, imagefolder: 32)
    num_classes: int = 10  # synthetic only; the other datasets know their classes
    channels: int = 3  # synthetic only
    synthetic_size: int = 2048
    loader: str = "auto"  # device: tensors on the device, augmented in batches; dataloader: workers
    num_workers: int = 2
    augment: bool = True  # random crop (and flip, below) on training batches; off turns both off
    flip: bool = True  # left-right flips, only where they keep the label: cifar10, cifar100, imagefolder
    # model and optimizer
    model: str = "resnet_small"  # or resnet9, or any torchvision classification model name
    pretrained: bool = False  # torchvision models: start from torchvision's default ImageNet weights
    init_from: str = ""  # a new run starts from the weights in this best.pt/last.pt or state_dict file
    width: int = 32
    dropout: float = 0.0  # resnet_small/resnet9: dropout before the classifier; 0: none
    optimizer: str = "sgd"
    lr: float | str = 0.2  # a float, or "auto" to take the suggestion from lr_find.json
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    clip_grad: float = 0.0  # max gradient norm; 0 turns clipping off
    # schedule (counts in epochs here, converted to optimizer steps by schedules.py)
    schedule: str = "onecycle"
    epochs: int = 10
    batch_size: int = 128  # global: split across processes under torchrun
    accum_steps: int = 1
    warmup_epochs: float = 0.0
    step_size: float = 0.0  # step schedule: epochs between decays; 0 means a third of the run
    gamma: float = 0.1
    min_lr_ratio: float = 0.0
    pct_start: float = 0.25
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    # lr_find.py
    find_start_lr: float = 1e-7
    find_end_lr: float = 10.0
    find_iters: int = 50
    find_method: str = "steepest"
    # runtime
    device: str = "auto"  # auto picks cuda > mps > cpu
    amp: str = "auto"  # auto: bf16 where supported, else fp16 + GradScaler; off on CPU
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    out_dir: str = "runs/default"
    log_every: int = 20  # optimizer steps between reads of the loss from the device
    save_every: int = 0  # optimizer steps between checkpoints (0: at epoch ends only)
    resume: str = ""  # "" off; "auto" (plain --resume): <out_dir>/last.pt; or a path
    allow_more_epochs: bool = False  # resume with a larger --epochs (changes the schedule's length)
    evaluate: str = ""  # a checkpoint: run the validation split once through it, train nothing

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class UserError(ValueError):
    """Bad user input (config, data, checkpoint); one line that says what is wrong and the fix."""


_FIELDS = {f.name: f for f in fields(Config)}
_CHOICES = {
    "schedule": SCHEDULES,
    "dataset": DATASETS,
    "optimizer": OPTIMIZERS,
    "amp": AMP_MODES,
    "loader": LOADERS,
    "find_method": FIND_METHODS,
}
_POSITIVE = ("epochs", "batch_size", "accum_steps", "log_every", "find_iters", "width",
             "synthetic_size", "num_classes", "channels", "div_factor", "final_div_factor",
             "find_start_lr", "find_end_lr")
_NON_NEGATIVE = ("num_workers", "image_size", "weight_decay", "clip_grad", "warmup_epochs",
                 "step_size", "momentum", "save_every", "seed")
_UNIT = ("label_smoothing", "min_lr_ratio")


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _article(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string"}.get(kind, kind.__name__)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(name: str, raw):
    """Turn a TOML value or a command-line string into the field's type."""
    default = _FIELDS[name].default
    if name == "lr":
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return "auto"
        kind = float
    else:
        kind = type(default)
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{name} expects true or false, got {raw!r}")
    if isinstance(raw, bool):
        raise UserError(f"{name} expects {_article(kind)}, got {raw!r}")
    try:
        if kind is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw)
        return kind(raw)
    except (TypeError, ValueError):
        hint = " or 'auto'" if name == "lr" else ""
        raise UserError(f"{name} expects {_article(kind)}{hint}, got {raw!r}") from None


def validate(cfg: Config) -> Config:
    """Check ranges and names; raise UserError naming the key and the allowed values."""
    for name, choices in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in choices:
            raise UserError(
                f"unknown {name} {value!r}{_suggest(value, choices)} (choose from {', '.join(choices)})"
            )
    if cfg.lr != "auto" and not cfg.lr > 0:
        raise UserError(f"lr must be > 0 (or 'auto'), got {cfg.lr}")
    for name in _POSITIVE:
        if not getattr(cfg, name) > 0:
            raise UserError(f"{name} must be > 0, got {getattr(cfg, name)}")
    for name in _NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            raise UserError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    for name in _UNIT:
        if not 0 <= getattr(cfg, name) <= 1:
            raise UserError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")
    if not 0 <= cfg.dropout < 1:
        raise UserError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if not 0 < cfg.pct_start < 1:
        raise UserError(f"pct_start must be in (0, 1), got {cfg.pct_start}")
    if cfg.gamma <= 0:
        raise UserError(f"gamma must be > 0, got {cfg.gamma}")
    if cfg.find_start_lr >= cfg.find_end_lr:
        raise UserError(
            f"find_start_lr ({cfg.find_start_lr}) must be below find_end_lr ({cfg.find_end_lr})"
        )
    if cfg.schedule == "onecycle" and cfg.warmup_epochs:
        raise UserError("warmup_epochs does not apply to onecycle; its warm phase is pct_start")
    return cfg


def load_toml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        presets = sorted(p.name for p in Path(__file__).parent.glob("*.toml"))
        raise UserError(
            f"config file {path} not found (presets: {', '.join('configs/' + p for p in presets)})"
        )
    try:
        values = tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path}: not valid TOML ({err})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not valid TOML (TOML files are UTF-8 text)") from None
    except OSError as err:
        raise UserError(f"config file {path} cannot be read ({err.strerror or err})") from None
    out = {}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS or name == "resume":
            raise UserError(f"{path}: unknown key {key!r}{_suggest(name, _FIELDS)}")
        out[name] = _convert(name, raw)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


class _Switch(argparse.Action):
    """A boolean as people type it: --x, --x true|false|yes|no|on|off|1|0, --x=false, --no-x."""

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs="?", default=default, help=help,
                         metavar="true|false")

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                raise UserError(f"{option_string} takes no value; write --{option_string[5:]} {value}")
            value = False
        setattr(namespace, self.dest, True if value is None else _convert(self.dest, value))


def _parser(description: str) -> _Parser:
    parser = _Parser(description=description, allow_abbrev=False)
    parser.add_argument("--config", help="TOML preset, e.g. configs/cifar10.toml")
    for f in fields(Config):
        if f.name == "resume":
            parser.add_argument("--resume", nargs="?", const="auto", default=argparse.SUPPRESS,
                                help="continue from <out_dir>/last.pt, or from the given path")
        elif isinstance(f.default, bool):
            negated = "--no-" + _flag(f.name)[2:]
            parser.add_argument(_flag(f.name), action=_Switch, default=argparse.SUPPRESS,
                                help=f"or {negated}; default {f.default}")
            parser.add_argument(negated, action=_Switch, dest=f.name, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        else:
            choices = _CHOICES.get(f.name)
            parser.add_argument(_flag(f.name), default=argparse.SUPPRESS, metavar=f.name.upper(),
                                help=(f"{'|'.join(choices)}; " if choices else "")
                                + f"default {f.default}")
    return parser


def parse_config(argv: list[str] | None = None, description: str = "") -> Config:
    """Build the Config from defaults, an optional --config TOML and command-line flags."""
    args, unknown = _parser(description).parse_known_args(argv)
    if unknown:
        bad = unknown[0]
        if bad.startswith("-"):
            flag = bad.split("=")[0]
            flags = [_flag(n) for n in _FIELDS] + ["--config"]
            raise UserError(f"unknown option {flag}{_suggest(flag, flags)} (see --help)")
        raise UserError(f"unexpected argument {bad!r}; options look like --epochs 3")
    given = vars(args)
    values = load_toml(given.pop("config")) if given.get("config") else {}
    given.pop("config", None)
    for name, raw in given.items():
        values[name] = raw if isinstance(raw, bool) or name == "resume" else _convert(name, raw)
    return validate(Config(**values))


def parse_or_exit(argv: list[str] | None = None, description: str = "") -> Config:
    """parse_config for scripts: a UserError becomes one line on stderr and exit status 2."""
    try:
        return parse_config(argv, description)
    except UserError as err:
        exit_with_error(str(err))


def exit_with_error(message: str, status: int = 2):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)
