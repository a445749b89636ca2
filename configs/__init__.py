"""Every setting in one dataclass; presets in TOML; any field overridable as --field-name.

Each field carries its default, help and allowed values or range (`setting`). A field whose names are a
list the front owns (the datasets, optimizers, schedules) takes them from the `choices` its caller passes
down: this package imports no module of the template's. Precedence: defaults < --config FILE.toml < flags;
a resume puts the checkpoint's config in place of the first two. Bad input is a UserError: one line saying
what is wrong and the fix; the scripts print it and exit 2."""

from __future__ import annotations

import argparse
import difflib
import math
import shlex
import sys
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import tomllib

OUT_DIR_RESUMES = ("last", "auto")  # --resume of <out_dir>/last.pt: plain --resume (it must be there), auto
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")  # torch.compile's modes; off: eager
LOGS = ("tensorboard", "csv", "wandb", "mlflow")  # --log-to: where a run's points go (machinery/trackers.py)
EXPECTS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
OR_AUTO = {"lr": float, "num_workers": int}  # numbers that also take "auto"

# The ranges a number may be declared to lie in, and how each is checked: never nan or inf.
LIMITS = {"> 0": lambda v: 0 < v < math.inf, ">= 0": lambda v: 0 <= v < math.inf,
          ">= 10": lambda v: 10 <= v < math.inf, "in [0, 1]": lambda v: 0 <= v <= 1,
          "in [0, 1)": lambda v: 0 <= v < 1, "in (0, 1)": lambda v: 0 < v < 1,
          "in [0, 2**32)": lambda v: 0 <= v < 2**32}  # seeds: epoch_plan's generator takes 64 bits


def setting(default, help: str, *, choices: tuple[str, ...] | None = None, limits: str | None = None):
    """One Config field with everything about it: default, help, allowed values (`choices`; a field named
    in the caller's `choices` takes its names from there) or range."""
    assert limits is None or limits in LIMITS, limits
    return field(default=default, metadata=dict(help=help, choices=choices, limits=limits))


@dataclass
class Config:
    # data
    dataset: str = setting("digits", "digits works offline; mnist, fashion_mnist, cifar10 and cifar100 are "
                           "downloaded into --data-dir; imagefolder reads --data-dir/{train,val}/<class>/; "
                           "csv reads --data-dir/train.csv (and val.csv) rows of file,label")
    data_dir: str = setting("data", "where datasets are downloaded, or imagefolder's and csv's folder")
    image_size: int = setting(0, "image side in pixels for synthetic, imagefolder and csv; 0: the dataset's "
                              "own (synthetic 16, files 32)", limits=">= 0")
    num_classes: int = setting(10, "synthetic only; the other datasets know their classes", limits="> 0")
    channels: int = setting(3, "synthetic: channels generated; imagefolder and csv: 1 loads grayscale, 3 "
                            "RGB; the other datasets have their own", limits="> 0")
    synthetic_size: int = setting(2048, "synthetic: training images (val and test: a quarter of it each)",
                                  limits="> 0")
    synthetic_val_size: int = setting(0, "synthetic: val images, and as many test images; 0: a quarter of "
                                      "--synthetic-size", limits=">= 0")
    val_fraction: float = setting(0.1, "the share of the training examples held out as the val split (a "
                                  "fixed one, each class in proportion) where the data has none of its "
                                  "own: digits, the torchvision sets, csv without a val.csv",
                                  limits="in (0, 1)")
    loader: str = setting("auto", "device: tensors (and image files, decoded once) on the device, augmented "
                          "in batches; host: in host memory, each batch copied to the GPU; dataloader: "
                          "files read every epoch by worker processes; auto: device where the data fits, "
                          "else host, else dataloader", choices=("auto", "device", "host", "dataloader"))
    num_workers: int | str = setting("auto", "DataLoader worker processes, where files are read every "
                                     "epoch; 0: read in the main process; auto: 2, on CUDA the CPU cores "
                                     "per process up to 8", limits=">= 0")
    image_cache: str = setting("auto", "where image files decoded once are kept for later runs; auto: "
                               "--data-dir/.image-cache; off: decoded into memory each run, nothing kept")
    augment: bool = setting(True, "images: random crop (and flip, below) of training batches; off: neither")
    flip: bool = setting(True, "images: left-right flips, only where they keep the label: cifar10, "
                         "cifar100, imagefolder, csv")
    balance_classes: bool = setting(False, "draw training examples so that every class comes equally often "
                                    "(with replacement; the same draws per seed and epoch, on resume too)")
    # model and optimizer
    model: str = setting("resnet_small", "a name in models.MODELS (resnet_small, resnet9, ...), or any "
                         "torchvision classification model name")
    pretrained: bool = setting(False, "torchvision models: start from torchvision's default ImageNet weights "
                               "(their normalization and input size too)")
    init_from: str = setting("", "a new run starts from the weights in this best.pt/last.pt or state_dict "
                             "file (a head of another class count is re-initialised); \"\": off")
    width: int = setting(32, "resnet_small/resnet9: channels of the first stage", limits="> 0")
    dropout: float = setting(0.0, "resnet_small/resnet9: dropout before the head; 0: off", limits="in [0, 1)")
    optimizer: str = setting("sgd", "a name in models.OPTIMIZERS: sgd (with --momentum, --nesterov), adamw")
    lr: float | str = setting(0.2, "a number (onecycle: the peak); auto: the suggestion `python lr_find.py` "
                              "saved in --out-dir, refused if measured on another setup")
    momentum: float = setting(0.9, "sgd only; 0: plain sgd", limits=">= 0")
    nesterov: bool = setting(True, "sgd only, when --momentum > 0")
    weight_decay: float = setting(5e-4, "on weights, not on biases or normalization weights", limits=">= 0")
    label_smoothing: float = setting(0.0, "0: plain cross-entropy (classification)", limits="in [0, 1]")
    clip_grad: float = setting(0.0, "max gradient norm; 0 turns clipping off", limits=">= 0")
    ema: float = setting(0.0, "keep an exponential moving average of the weights with this decay (0.999, "
                         "say), which evaluation, best.pt and evaluate.py use; 0: off",
                         limits="in [0, 1)")
    # schedule (counts in epochs here, converted to optimizer steps by schedules.py); lr_find's sweep
    # does not depend on any of them, so --lr auto compares none
    schedule: str = setting("onecycle", "the learning rate over the run, stepped per optimizer step")
    epochs: int = setting(10, "passes over the training set", limits="> 0")
    batch_size: int = setting(128, "global: split across processes under torchrun", limits="> 0")
    accum_steps: int = setting(1, "batches per optimizer step (gradient accumulation)", limits="> 0")
    warmup_epochs: float = setting(0.0, "linear warmup before constant, step and cosine, and the length "
                                   "of the warmup schedule (required there); 0: none; onecycle warms up "
                                   "by --pct-start", limits=">= 0")
    step_size: float = setting(0.0, "step schedule: epochs between decays; 0: a third of the run",
                               limits=">= 0")
    gamma: float = setting(0.1, "step schedule: factor at each decay", limits="> 0")
    min_lr_ratio: float = setting(0.0, "cosine: the final lr as a fraction of --lr; 0: decays to 0",
                                  limits="in [0, 1]")
    pct_start: float = setting(0.25, "onecycle: the part rising to --lr", limits="in (0, 1)")
    div_factor: float = setting(25.0, "onecycle: starts at lr / div_factor", limits="> 0")
    final_div_factor: float = setting(1e4, "onecycle: ends at lr / div_factor / final_div_factor",
                                      limits="> 0")
    # lr_find.py
    find_start_lr: float = setting(1e-5, "range test: first lr", limits="> 0")
    find_end_lr: float = setting(10.0, "range test: the last lr (it stops earlier once the loss diverges)",
                                 limits="> 0")
    find_iters: int = setting(50, "range test: optimizer steps (a suggestion needs 10 or more)",
                              limits=">= 10")
    find_method: str = setting("auto", "range test: how the suggestion is read off the curve; auto: "
                               "the rule lr_find.DEFAULT_RULES gives --schedule and the optimizer",
                               choices=("auto",))
    # runtime
    device: str = setting("auto", "auto: cuda > mps > cpu; or cpu, cuda, cuda:N, mps, xpu")
    amp: str = setting("auto", "autocast; auto: bf16 where the GPU computes in it, else fp16 with "
                       "GradScaler, off on CPU and MPS", choices=("auto", "bf16", "fp16", "off"))
    channels_last: bool = setting(False, "images: channels_last memory (faster on GPUs)")
    compile: str = setting("off", "torch.compile the model in this mode (--compile alone: default); "
                           "reduce-overhead adds CUDA graphs (small models on a GPU, where launches bound "
                           "the step); off: eager", choices=COMPILE_MODES)
    seed: int = setting(0, "for weights, data order and augmentation (torch, numpy and Python's random)",
                        limits="in [0, 2**32)")
    log_to: str = setting("tensorboard,csv", "where a run's points, pictures and summary go: a comma list of "
                       "tensorboard, csv (metrics.csv), wandb, mlflow")
    log_model: bool = setting(False, "--log-to wandb or mlflow: best.pt as an artifact of the run")
    deterministic: bool = setting(False, "repeatable bit for bit on a GPU too: deterministic kernels only, "
                                  "no cuDNN autotuning, no TF32 (slower; CPU runs already repeat)")
    dist_timeout: float = setting(60.0, "torchrun: minutes a process waits for the others before the job "
                                  "fails (a download or a first compile on one rank must fit; NCCL's own "
                                  "default is 10)", limits="> 0")
    out_dir: str = setting("runs/default", "logs, checkpoints, config.json, summary.json, lr_find.json")
    log_every: int = setting(20, "optimizer steps between log points: the loss read from the device, and "
                             "it and the step's rate logged", limits="> 0")
    save_every: int = setting(0, "optimizer steps between checkpoints; 0: at epoch ends only",
                              limits=">= 0")
    early_stop: int = setting(0, "stop once the task's main metric has not improved for this many "
                              "evaluations in a row (best.pt stays the best); 0: off", limits=">= 0")
    min_delta: float = setting(0.0, "--early-stop: how much better the main metric must get to count as "
                               "improved; 0: any gain counts", limits=">= 0")
    resume: str = setting("", "continue <out_dir>/last.pt (plain --resume), or PATH; auto: continue "
                          "<out_dir>/last.pt if there is one, else start a new run (one command for a first "
                          "start and every restart: Slurm's requeues, torchrun's restarts); with the "
                          "checkpoint's settings, and flags given too override them where a resume may "
                          "change them (--out-dir, --log-every, ...) and are refused elsewhere")
    allow_more_epochs: bool = setting(False, "resume with a larger --epochs (constant, warmup and step "
                                      "schedules only: the others are shaped by the run's length)")
    # evaluate.py (how a saved model is run: never taken from its checkpoint's config)
    checkpoint: str = setting("runs/default/best.pt", "evaluate.py: the checkpoint it evaluates, or "
                              "predicts with")
    split: str = setting("val", "evaluate.py: the split it runs, val or the test split (where the data has "
                         "one); it writes eval.json next to the checkpoint (or into --out-dir)",
                         choices=("val", "test"))
    predict: str = setting("", "evaluate.py: an image, a folder (searched recursively) or a CSV (a header, "
                           "then file paths in its first column) to predict instead, into predictions.csv "
                           "next to the checkpoint (or into --out-dir); \"\": evaluate the --split")
    top_k: int = setting(5, "--predict: the most likely classes written per file (at most the class count)",
                         limits="> 0")
    tta: str = setting("none", "--predict: flip averages each image's outputs with its mirror image's",
                       choices=("none", "flip"))
    export: str = setting("", "evaluate.py: write the model to this file instead, model.onnx (ONNX) or "
                          "model.pt2 (torch.export), with its input steps inside (it takes uint8 images as "
                          "--predict reads them), kept once it matches the PyTorch model on --split's "
                          "examples; \"\": evaluate")

    def to_dict(self) -> dict:
        return asdict(self)


class UserError(ValueError):
    """Bad user input (config, data, checkpoint), or a stop; one line that says what happened and the
    fix. `code`: the exit status the scripts end with (2; a signal's stop: 128 + its number)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


_FIELDS = {f.name: f for f in fields(Config)}


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(name: str, raw):
    """Turn a TOML value or a command-line string into the field's type."""
    if name in OR_AUTO and isinstance(raw, str) and raw.strip().lower() in ("auto", "find"):
        if raw.strip().lower() == "find" and name == "lr":  # the range test is a command of its own
            raise UserError("--lr find: the range test runs as its own command: `python lr_find.py` with the "
                            "same options, then `python train.py ... --lr auto` trains with its rate")
        if raw.strip().lower() == "auto":
            return "auto"
    kind = OR_AUTO.get(name) or type(_FIELDS[name].default)
    if kind is bool:
        text = str(raw).strip().lower()  # True and False too: "true", "false"
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{name} expects true or false, got {raw!r}")
    if isinstance(raw, bool):
        raise UserError(f"{name} expects {EXPECTS[kind]}, got {raw!r}")
    try:
        if kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        return kind(raw)
    except (TypeError, ValueError):
        hint = " or 'auto'" if name in OR_AUTO else ""
        raise UserError(f"{name} expects {EXPECTS[kind]}{hint}, got {raw!r}") from None


FRONT_LISTS = ("dataset", "optimizer", "schedule", "find_method")  # fields the front's lists name


def choices_of(f, choices: dict | None = None) -> tuple[str, ...] | None:
    """A field's allowed values: its own, then the names `choices` (the front's lists) gives it; None (any)
    for a field the front names when it passed no list for it."""
    listed = (choices or {}).get(f.name)
    if listed is None:
        return None if f.name in FRONT_LISTS else f.metadata["choices"]
    return (*(f.metadata["choices"] or ()), *listed)


def validate(cfg: Config, choices: dict[str, Collection[str]] | None = None) -> Config:
    """Check each field against its allowed values (`choices`: the names the front's lists give a field,
    such as {"dataset": DATASETS}) or range, then the rules between fields."""
    for f in fields(Config):
        value, allowed, limits = getattr(cfg, f.name), choices_of(f, choices), f.metadata["limits"]
        if allowed and value not in allowed:
            raise UserError(f"unknown {f.name} {value!r}{_suggest(value, allowed)} "
                            f"(choose from {', '.join(allowed)})")
        if limits and value != "auto" and not LIMITS[limits](value):
            raise UserError(f"{f.name} must be a number {limits}, got {value}")
    if cfg.lr != "auto" and not 0 < cfg.lr < math.inf:
        raise UserError(f"lr must be a number > 0 (or auto), got {cfg.lr}")
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


def load_toml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        presets = ", ".join(f"configs/{p.name}" for p in sorted(Path(__file__).parent.glob("*.toml")))
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
        if isinstance(raw, dict) and name not in _FIELDS:  # TOML puts the keys after a [section] in it
            raise UserError(f"{path}: [{key}] is a section, and a preset's settings are read from the top "
                            "level only; move them above any [section] line, or drop the header")
        if name not in _FIELDS or name == "resume":
            raise UserError(f"{path}: unknown key {key!r}{_suggest(name, _FIELDS)}")
        if name in keys:  # batch-size and batch_size are one setting: which one would win is no answer
            raise UserError(f"{path}: {keys[name]!r} and {key!r} both set {name}; keep one")
        keys[name], out[name] = key, _convert(name, _toml_typed(path, key, name, raw))
    return out


def _toml_typed(path: str, key: str, name: str, raw):
    """A TOML value of its field's type as TOML writes it (3, 0.1, true, "runs/x"; lr "auto" too), else one
    line: str() or float() of a list, a table or a quoted number would run with a value it never said."""
    kind = OR_AUTO.get(name) or type(_FIELDS[name].default)
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    typed = {bool: isinstance(raw, bool), str: isinstance(raw, str)}.get(kind, number)
    if typed or (name in OR_AUTO and isinstance(raw, str)):  # lr, num_workers: a number, or "auto"
        return raw
    expects = EXPECTS[kind] + (" or 'auto'" if name in OR_AUTO else "")
    what = {bool: "a boolean", str: "a string", list: "a list", dict: "a table"}.get(type(raw))
    got = what or ("a number" if number else f"a {type(raw).__name__}")
    shown = repr(raw) if len(repr(raw)) <= 40 else repr(raw)[:37] + "..."
    raise UserError(f"{path}: {key} expects {expects}, got {got}: {shown}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


class _Switch(argparse.Action):
    """A boolean as people type it: --x, --x true|false|yes|no|on|off|1|0, --x=false, --no-x."""

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                raise UserError(f"{option_string} takes no value; write --{option_string[5:]} {value}")
            value = False
        setattr(namespace, self.dest, True if value is None else _convert(self.dest, value))


def _parser(description: str, choices: dict | None, offered: Collection[str]) -> _Parser:
    parser = _Parser(description=description, allow_abbrev=False)
    parser.add_argument("--config", help="TOML preset, e.g. configs/cifar10.toml")
    for f in (f for f in fields(Config) if f.name in offered):
        if f.name in ("resume", "compile"):  # given alone: plain --resume, torch.compile's default mode
            parser.add_argument(_flag(f.name), nargs="?", const={"resume": "last"}.get(f.name, "default"),
                                default=argparse.SUPPRESS, metavar=f.name.upper(), help=f.metadata["help"])
        elif isinstance(f.default, bool):
            negated = "--no-" + _flag(f.name)[2:]
            parser.add_argument(_flag(f.name), action=_Switch, nargs="?", metavar="true|false",
                                default=argparse.SUPPRESS,
                                help=f"{f.metadata['help']} (or {negated}; default {f.default})")
            parser.add_argument(negated, action=_Switch, nargs="?", dest=f.name, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        else:
            rule = ", ".join(choices_of(f, choices) or ()) or f.metadata["limits"]
            text = f"{f.metadata['help']} ({rule + '; ' if rule else ''}default {f.default!r})"
            parser.add_argument(_flag(f.name), default=argparse.SUPPRESS, metavar=f.name.upper(),
                                help=text.replace("%", "%%"))
    return parser


def parse_given(argv: list[str] | None = None, description: str = "", choices: dict | None = None, *,
                offered: Collection[str] | None = None, elsewhere: str = "another script takes it (train.py "
                "or evaluate.py); --help lists this one's options") -> dict:
    """The settings the command line gives (flags, and the keys of its --config file), each of its
    field's type; not yet checked together, since a resume fills in the rest from its checkpoint.
    `choices`: the names the front's lists give some fields, listed in --help (validate). `offered`: the
    fields this script takes (None: all); a flag of another field is refused in one line ending with
    `elsewhere` (whose they are), and a --config file's other keys are left to the scripts they set."""
    offered = _FIELDS if offered is None else offered
    args, unknown = _parser(description, choices, offered).parse_known_args(argv)
    if unknown:
        bad = unknown[0]
        if bad.startswith("-"):
            flag = bad.split("=")[0]
            if (name := flag[2:].replace("-", "_").removeprefix("no_")) in _FIELDS and name not in offered:
                raise UserError(f"{flag} is not an option here: {elsewhere}")
            flags = [_flag(n) for n in offered] + ["--config"]
            raise UserError(f"unknown option {flag}{_suggest(flag, flags)} (see --help)")
        raise UserError(f"unexpected argument {bad!r}; options look like --epochs 3")
    given = vars(args)
    config = given.pop("config", None)
    values = {k: v for k, v in load_toml(config).items() if k in offered} if config else {}
    for name, raw in given.items():
        values[name] = _convert(name, raw)
    return values


def parse_config(argv: list[str] | None = None, description: str = "", choices: dict | None = None, *,
                 offered: Collection[str] | None = None) -> Config:
    """Build the Config from defaults, an optional --config TOML and command-line flags, checked."""
    return validate(Config(**parse_given(argv, description, choices, offered=offered)), choices)


def command_line(script: str, cfg: Config, leave_out: tuple[str, ...]) -> str:
    """`python SCRIPT --flag value ...` giving cfg's settings that differ from the defaults."""
    args = ["python", script]
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in leave_out or f.name == "resume" or (value == f.default and f.name != "out_dir"):
            continue
        if isinstance(value, bool):
            args.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
        else:
            args += [_flag(f.name), str(value)]
    return shlex.join(args)


def first_line(err: object, limit: int | None = 160) -> str:
    """An exception's (or a reason's) first line, to quote in a line of ours; its type's name where it
    says nothing."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


def exit_with_error(message: str, status: int = 2):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)
