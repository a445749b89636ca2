"""A config resolved against a saved one: a checkpoint to resume (its config, with the flags given now on
top, checked for what may change), to evaluate or predict with (built as it was trained), or a sweep's
(--lr auto compares what could move the best rate)."""

from __future__ import annotations

from pathlib import Path

from configs import (
    DEFAULTS,
    MODE_SETTINGS,
    OUT_DIR_RESUMES,
    Config,
    UserError,
    _convert,
    validate,
)

# What a resume may change: how a run is run or watched, never what its saved state means.
MAY_CHANGE_ON_RESUME = ("data_dir", "loader", "num_workers", "image_cache", "init_from", "find_start_lr",
                        "find_end_lr", "find_iters", "find_method", "device", "compile", "out_dir",
                        "log_every", "save_every", "early_stop", "min_delta", "resume", "allow_more_epochs",
                        "checkpoint", "split", "predict", "top_k", "tta", "export", "average", "dist_timeout",
                        "log_to", "log_model", "seeds", "throughput", "peak_tflops", "profile")
# What cannot move the best learning rate (paths, devices, the schedule's shape, how a run is watched):
# --lr auto compares every other setting with the config its sweep measured.
KEEPS_LR = (*(name for name in MAY_CHANGE_ON_RESUME if name != "init_from"), "synthetic_val_size", "lr",
            "ema", "schedule", "epochs", "warmup_epochs", "step_size", "gamma", "min_lr_ratio", "pct_start",
            "div_factor", "final_div_factor", "channels_last", "seed", "deterministic", "keep_best")
LENGTH_FREE_SCHEDULES = ("constant", "warmup", "step")  # curves that do not depend on the run's end
# What evaluate.py takes from its command line; the model and data settings come from the checkpoint.
# The mode's own settings (MODE_SETTINGS) are the command's, given or not, never the checkpoint's.
EVALUATE_FROM_FLAGS = ("data_dir", "device", "batch_size", "num_workers", "loader", "image_cache", "amp",
                       "out_dir", "dist_timeout")
# What builds the model and data of a plain state_dict, which records neither; a train.py checkpoint's own
# settings: given again, they must say what it says.
STATE_DICT_SETTINGS = ("dataset", "image_size", "num_classes", "channels", "synthetic_size",
                       "synthetic_val_size", "val_fraction", "model", "pretrained", "width")
EVALUATE_SETTINGS = (*EVALUATE_FROM_FLAGS, *MODE_SETTINGS, *STATE_DICT_SETTINGS)  # evaluate.py's flags


def resumed_config(saved: dict, given: dict, checkpoint: str | Path, choices: dict | None = None) -> Config:
    """The config a resume runs with: the checkpoint's, with the settings given now on top. --lr auto
    given again means the rate the run already used (a number in the checkpoint). --allow-more-epochs
    is a permission for this command only, never taken from the checkpoint. Without --out-dir,
    `--resume PATH` continues in PATH's folder."""
    given = dict(given)
    if given.get("lr") == "auto":
        del given["lr"]
    if "out_dir" not in given and given.get("resume", "last") not in OUT_DIR_RESUMES:
        given["out_dir"] = str(Path(checkpoint).parent)
    try:  # a damaged or hand-edited checkpoint's config: each value of its field's type, or one line
        saved = {k: _convert(k, v) for k, v in saved.items() if k in DEFAULTS}
    except UserError as err:
        raise UserError(f"checkpoint {checkpoint}'s config is damaged ({err}); resume from another "
                        "checkpoint, or start a new run") from None
    return validate(Config(**{**DEFAULTS, **saved, "allow_more_epochs": False, **given}), choices)


def evaluated_config(cfg: Config, given: dict, saved: dict, choices: dict | None = None) -> Config:
    """The config evaluate.py runs a checkpoint of ours with (`saved`: its config): built as it was
    trained, run where the command line says (EVALUATE_FROM_FLAGS). A model or data setting given that
    is not the checkpoint's is one line: the weights fit the model they were trained in."""
    saved_as = {**DEFAULTS, **saved}  # a setting newer than the checkpoint ran as its default
    for name in (k for k in STATE_DICT_SETTINGS if k in given and given[k] != saved_as[k]):
        raise UserError(f"--{name.replace('_', '-')} {given[name]}: the checkpoint's run was trained with "
                        f"{name} {saved_as[name]!r}, and evaluate.py builds its model and data as the run "
                        f"did; leave --{name.replace('_', '-')} out (it is for a plain state_dict)")
    here = {k: given[k] for k in EVALUATE_FROM_FLAGS if k in given}
    mode = {k: getattr(cfg, k) for k in MODE_SETTINGS}
    return validate(Config(**{**{k: v for k, v in saved.items() if k in DEFAULTS}, **here, **mode,
                              "resume": "", "init_from": ""}), choices)


def check_resumable(saved: dict, cfg: Config) -> None:
    """Refuse a resume whose config would change what the saved state means."""
    diffs = differences(saved, cfg, MAY_CHANGE_ON_RESUME)
    length_free = cfg.schedule in LENGTH_FREE_SCHEDULES
    if cfg.allow_more_epochs and length_free and cfg.epochs > saved.get("epochs", DEFAULTS["epochs"]):
        diffs = [d for d in diffs if not d.startswith("epochs:")]
    longer = length_free and any(d.startswith("epochs:") for d in diffs)
    if diffs:
        raise UserError(f"cannot resume: the config differs from the checkpoint's ({'; '.join(diffs)})"
                        f"; {'add --allow-more-epochs to train longer, or ' if longer else ''}resume "
                        "without those flags, or start a new run with a new --out-dir")


def differences(saved: dict, cfg: Config, allowed: tuple[str, ...],
                unread: tuple[str, ...] = ()) -> list[str]:
    """The settings that differ between a saved config and cfg, as "name: saved -> now", but those
    `allowed` to differ (MAY_CHANGE_ON_RESUME, KEEPS_LR) and the `unread` (momentum between two adamw
    sweeps). A setting newer than the saved config ran as its default."""
    saved = {**DEFAULTS, **saved}
    return [f"{name}: {saved[name]!r} -> {getattr(cfg, name)!r}" for name in DEFAULTS
            if name not in allowed and name not in unread and saved[name] != getattr(cfg, name)]
