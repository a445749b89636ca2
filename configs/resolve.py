"""A config resolved against what a run finds: a checkpoint to resume or evaluate (its config, with
the flags given now on top, checked for what may change), or a sweep for --lr auto (lr_find.json,
checked for the setup and task it measured)."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from dataclasses import fields
from pathlib import Path

from configs import (
    _FIELDS,
    LR_WORDS,
    OUT_DIR_RESUMES,
    Config,
    UserError,
    _convert,
    command_line,
    registry,
    validate,
)
from lr_find import PNG_SWEEP_KEY


def resumed_config(saved: dict, given: dict, checkpoint: str | Path) -> Config:
    """The config a resume runs with: the checkpoint's, with the settings given now on top. --lr auto or
    find given again means the rate the run already used (a number in the checkpoint). --allow-more-epochs
    is a permission for this command only, never taken from the checkpoint. Without --out-dir,
    `--resume PATH` continues in PATH's folder."""
    given = dict(given)
    if given.get("lr") in LR_WORDS:
        del given["lr"]
    if "out_dir" not in given and given.get("resume", "last") not in OUT_DIR_RESUMES:
        given["out_dir"] = str(Path(checkpoint).parent)
    try:  # a damaged or hand-edited checkpoint's config: each value of its field's type, or one line
        saved = {k: _convert(k, v) for k, v in saved.items() if k in _FIELDS}
    except UserError as err:
        raise UserError(f"checkpoint {checkpoint}'s config is damaged ({err}); resume from another "
                        "checkpoint, or start a new run") from None
    return validate(Config(**{**Config().to_dict(), **saved, "allow_more_epochs": False, **given}))


LENGTH_FREE_SCHEDULES = ("constant", "warmup", "step")  # curves that do not depend on the run's end
# What --evaluate and --predict take from their command line; the model and data settings come from the
# checkpoint. The mode's own settings (MODE_SETTINGS) are the command's, given or not, never the checkpoint's.
EVALUATE_FROM_FLAGS = ("data_dir", "device", "batch_size", "num_workers", "loader", "amp", "out_dir")
MODE_SETTINGS = ("evaluate", "split", "predict", "checkpoint", "top_k", "tta")


def evaluated_config(cfg: Config, given: dict, saved: dict) -> Config:
    """The config --evaluate and --predict run with a checkpoint of ours (`saved`: its config): built as
    it was trained, run where the command line says (EVALUATE_FROM_FLAGS)."""
    here = {k: given[k] for k in EVALUATE_FROM_FLAGS if k in given}
    mode = {k: getattr(cfg, k) for k in MODE_SETTINGS}
    cfg = Config(**{**{k: v for k, v in saved.items() if k in _FIELDS}, **here, **mode, "resume": "",
                    "init_from": "", "evaluate": cfg.evaluate and str(Path(cfg.evaluate))})
    return validate(cfg)


def check_resumable(saved: dict, cfg: Config) -> None:
    """Refuse a resume whose config would change what the saved state means."""
    diffs = differences(saved, cfg, "may_change")
    length_free = cfg.schedule in LENGTH_FREE_SCHEDULES
    if cfg.allow_more_epochs and length_free and cfg.epochs > saved.get("epochs", Config().epochs):
        diffs = [d for d in diffs if not d.startswith("epochs:")]
    longer = length_free and any(d.startswith("epochs:") for d in diffs)
    if diffs:
        raise UserError(f"cannot resume: the config differs from the checkpoint's ({'; '.join(diffs)})"
                        f"; {'add --allow-more-epochs to train longer, or ' if longer else ''}resume "
                        "without those flags, or start a new run with a new --out-dir")


def differences(saved: dict, cfg: Config, rule: str, unread: tuple[str, ...] = ()) -> list[str]:
    """The settings that differ between a saved config and cfg, as "name: saved -> now", but those whose
    `rule` lets them differ (may_change: a resume; keeps_lr: a sweep's rate) and the `unread` (momentum
    between two adamw sweeps). A setting newer than the saved config ran as its default."""
    saved = {**Config().to_dict(), **saved}
    return [f"{f.name}: {saved[f.name]!r} -> {getattr(cfg, f.name)!r}" for f in fields(Config)
            if not f.metadata[rule] and f.name not in unread and saved[f.name] != getattr(cfg, f.name)]


def resolve_lr(cfg: Config, task, say=print) -> float | None:
    """The rate a run trains with: a number as given; None for --lr find, which sweeps once the model
    is built; for --lr auto, lr_find.json's suggestion for this schedule (onecycle's peak, the others'
    starting rate) if it was measured on this setup and task (task: its module)."""
    if cfg.lr != "auto":
        return None if cfg.lr == "find" else float(cfg.lr)
    path = Path(cfg.out_dir) / "lr_find.json"
    refind = command_line("lr_find.py", cfg, leave_out=("lr", "epochs", "log_every", "save_every"))
    others = "or use --lr find, or pass a number such as --lr 0.1"
    if not path.is_file():
        raise UserError(f"--lr auto needs {path}, which does not exist; run `{refind}` first, {others}")
    try:
        record = json.loads(path.read_text())
        measured_on, families = dict(record["config"]), dict(record.get("suggestions") or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a sweep lr_find.py wrote ({type(err).__name__}); run `{refind}`, "
                        f"{others}") from None
    optimizers = registry("optimizer")  # momentum counts only between sweeps of optimizers that read it
    read = {s for name in (measured_on.get("optimizer"), cfg.optimizer) if name in optimizers
            for s in optimizers[name].settings}
    unread = tuple(s for entry in optimizers.values() for s in entry.settings if s not in read)
    diffs = differences(measured_on, cfg, "keeps_lr", unread)
    swept, here = measured_on.get("task"), task_identity(task)
    if swept != here:  # the loss is code, not a setting: an edited task.py needs a new sweep
        diffs.append(f"task: {swept} -> {here}")
    serving = [f for f in families.values() if isinstance(f, dict) and cfg.schedule in f.get("schedules", [])]
    if not serving:
        diffs.append(f"schedule: none of its suggestions serves {cfg.schedule!r}")
    if diffs:
        raise UserError(f"{path} was measured on another setup ({'; '.join(diffs)}): its rate does "
                        f"not carry over; measure this one's with `{refind}`, {others}")
    suggestion, rule = serving[0].get("lr"), serving[0].get("method")
    if type(suggestion) not in (int, float) or not 0 < suggestion < math.inf:
        raise UserError(f"{path} holds no usable suggestion for --schedule {cfg.schedule} ({suggestion!r}); "
                        f"run `{refind}` with a wider --find-start-lr/--find-end-lr, {others}")
    what = "its peak" if cfg.schedule == "onecycle" else "its starting rate"
    say(f"lr auto: {suggestion:.4g} from {path}, the suggestion for --schedule {cfg.schedule} ({what}, "
        f"rule {rule})")
    picture = path.with_name("lr_find.png")
    if picture.is_file() and "sweep" in record and png_text(picture).get(PNG_SWEEP_KEY) != record["sweep"]:
        say(f"lr auto: {picture} is not the picture of this sweep (a sweep stopped between writing the two, "
            f"or a file was copied over); the rate above is {path}'s: run `{refind}` to draw both again")
    return float(suggestion)


def png_text(path: Path) -> dict[str, str]:
    """A PNG file's text chunks (keyword: text); {} if it is no PNG or cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return dict(getattr(image, "text", {}))
    except (OSError, SyntaxError, ValueError):  # PIL's decoders raise these on a damaged file
        return {}


def task_identity(task) -> dict:
    """The task a sweep measured (lr_find.json's config["task"]): its name and a hash of its source, so
    that an edited loss counts as another task."""
    return {"name": task.NAME, "source": hashlib.sha256(inspect.getsource(task).encode()).hexdigest()[:16]}
