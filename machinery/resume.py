"""A resume: the checkpoint a run continues from, checked before any state goes back (the file, its task,
its config against the one given now, its data), then every state restored. --resume auto with no last.pt
yet is a first start."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from configs import OUT_DIR_RESUMES, Config, UserError, first_line, validate
from configs.resolve import check_resumable, resumed_config
from machinery.checkpoints import all_finite, changed_files, check_task, load_checkpoint, restore_rng_state
from machinery.processes import say

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "rng", "run", "config", "data")  # train.py's save
RUN_COUNTERS = ("epoch", "batch", "step", "part")


@dataclass
class Resumed:
    """A checkpoint a run continues from, and where it was read."""

    path: Path
    state: dict

    def restore(self, info, epochs: int, record: type, **objects):
        """The checkpoint's states back into the run's `objects` (a None is skipped), then its RNGs, on data
        (`info`) that gives the epochs its schedule was built for, or one line; where the run stands, as a
        `record` (train.Progress), which must know each field of the saved run."""
        check_same_data(self, info.data_record())
        if unknown := sorted(set(self.state["run"]) - {f.name for f in dataclasses.fields(record)}):
            raise UserError(f"checkpoint {self.path} was written by another version of train.py (its run "
                            f"record holds {', '.join(unknown)}, which this train.py's {record.__name__} "
                            "lacks): resume it with the version that wrote it (check out that commit), or "
                            "start a new run with another --out-dir, from its weights with --init-from "
                            f"{self.path}")
        try:
            for key, target in objects.items():
                if target is not None and self.state.get(key) is not None:
                    target.load_state_dict(self.state[key])
            restore_rng_state(self.state["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
            raise UserError(f"checkpoint {self.path} does not fit this model and optimizer "
                            f"({first_line(err)}); resume it with the settings it was written with, or start "
                            "a new run") from None
        run = {**self.state["run"], "part": self.state["run"]["part"] + 1}
        where = ("its training done: the test pass and summary.json next" if run.get("stopped") or
                 run["epoch"] >= epochs else position(run["epoch"], run["batch"], epochs, info.batches))
        say(f"resumed from {self.path} at step {run['step']} ({where})")
        return record(**run)

    def unlogged(self, device: torch.device) -> tuple[list, list]:
        """The losses and normalizers checkpoints.unlogged kept, on `device`, as the loop held them."""
        saved = self.state.get("unlogged")
        if not saved:
            return [], []
        losses = [] if saved["losses"] is None else [*saved["losses"].to(device)]
        counts = [count.to(device) if isinstance(count, torch.Tensor) else count for count in saved["counts"]]
        return losses, counts


def load(cfg: Config, given: dict | None, task, choices: dict | None = None) -> tuple[Config, Resumed | None]:
    """The config a run goes on with, and the checkpoint it continues; --resume auto with no last.pt yet
    starts a new run (None)."""
    if cfg.resume == "auto" and not (Path(cfg.out_dir) / "last.pt").is_file():
        say(f"--resume auto: no {Path(cfg.out_dir) / 'last.pt'} yet, so a new run")
        return validate(replace(cfg, resume=""), choices), None
    return load_resume(cfg, given, task, choices)


def load_resume(cfg: Config, given: dict | None, task, choices: dict | None = None) -> tuple[Config, Resumed]:
    """--resume: the config the run continues with (the checkpoint's, with `given`, the settings the
    command line gave, on top; None: all of cfg's; checked against `choices`), and the checkpoint. Refuses
    in one line a file that is not a train.py checkpoint, another task's, nan/inf weights, and a config
    that would change what the saved state means."""
    path = Path(cfg.out_dir) / "last.pt" if cfg.resume in OUT_DIR_RESUMES else Path(cfg.resume)
    ckpt = load_checkpoint(path)
    if missing := [key for key in CHECKPOINT_KEYS if key not in ckpt]:
        raise UserError(f"checkpoint {path} lacks {', '.join(missing)}: not a train.py checkpoint of this "
                        "version")
    if not all(isinstance(ckpt[key], dict) for key in ("model", "config", "data")):
        raise UserError(f"checkpoint {path} is not a train.py checkpoint (its model, config or data is not "
                        "a dict)")
    check_task(ckpt, path, task, "resume it with the task.py it was trained with, or start a new run")
    if not all_finite([t for t in ckpt["model"].values() if isinstance(t, torch.Tensor)]):
        raise UserError(f"checkpoint {path} holds nan or inf weights (a diverged run); start a new "
                        "run with a lower --lr")
    run = ckpt["run"]
    if not (isinstance(run, dict) and all(type(run.get(k)) is int and run[k] >= 0 for k in RUN_COUNTERS)):
        counters = {k: run.get(k) for k in RUN_COUNTERS} if isinstance(run, dict) else run
        raise UserError(f"checkpoint {path} is damaged: its run counters {counters} are not whole numbers; "
                        "resume from another checkpoint")
    cfg = resumed_config(ckpt["config"], cfg.to_dict() if given is None else given, path, choices)
    check_resumable(ckpt["config"], cfg)
    # The run asked for is already complete and its summary.json written: not an error (code 0), the scripts
    # print it and exit 0. Complete without its summary (stopped in its test pass, or resumed into another
    # folder), train() finishes it: the test pass through best.pt, and summary.json.
    if not summarized(Path(cfg.out_dir), run):
        return cfg, Resumed(path, ckpt)
    if run.get("stopped"):
        raise UserError(f"{path} holds a run that stopped early at epoch {run['epoch']} ({run['stopped']}): "
                        "nothing to do, nothing changed; train longer with a new run", code=0)
    if run["epoch"] >= cfg.epochs:
        raise UserError(f"{path} holds a complete run ({cfg.epochs} epochs, step {run['step']}): nothing to "
                        "do, nothing changed; train longer with a new run (or --epochs N --allow-more-epochs "
                        "for constant, warmup and step schedules)", code=0)
    return cfg, Resumed(path, ckpt)


def summarized(out_dir: Path, run: dict) -> bool:
    """Whether `run` (a checkpoint's) ended, and out_dir/summary.json is that run's (by its run_id)."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):  # none, or cut short: the run's end is to be done again
        return False
    return isinstance(summary, dict) and summary.get("run_id") == run.get("run_id") and summary.get(
        "steps") == run["step"]


def check_same_data(resumed: Resumed, data: dict) -> None:
    """A resume's data must give the epochs the checkpoint's schedule was built for, and the splits that
    choose best.pt and report the result: the same number of training, val and test examples, of batches
    per epoch, the same classes (outputs), and for files the same ones in each split."""
    saved = resumed.state["data"]
    what = [f"{key.replace('_', ' ')} {saved.get(key)} -> {data[key]}"
            for key in ("train_size", "val_size", "test_size", "batches") if saved.get(key) != data[key]]
    if saved.get("names") != data["names"]:
        names = saved.get("names") or []
        what.append(f"{len(names)} -> {len(data['names'])} classes ({names[:6]} -> {data['names'][:6]})")
    what += [f"other {split} files" for split in changed_files(saved, data)  # as many, but other ones
             if saved.get(f"{split}_size") == data[f"{split}_size"]]
    if not what:
        return
    raise UserError(f"checkpoint {resumed.path} was trained on other data ({'; '.join(what)}): its "
                    "schedule and model do not fit this data; resume on the data it was trained on, or start "
                    "a new run with a new --out-dir")


def position(epoch: int, batch: int, epochs: int, batches: int) -> str:
    """Where a checkpoint continues, counted from 1 as the progress lines count."""
    if batch >= batches:
        return f"epoch {epoch + 1}/{epochs} trained, its evaluation next"
    return f"epoch {epoch + 1}/{epochs} at batch {batch + 1}/{batches}"


