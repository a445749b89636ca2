"""The checkpoint: written atomically (files.py), loaded with weights_only=True, and checked before a
resume puts any state back: the file, its task, its config against the one given now, its data.

What a checkpoint holds is the dict train.py builds where it saves; this module knows only the keys a
resume and evaluate.py read back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import pickle
import random
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from configs import OUT_DIR_RESUMES, Config, UserError, first_line
from configs.resolve import check_resumable, resumed_config
from machinery import processes
from machinery.files import free_bytes, shown_size, write_atomic


def write_checkpoint(state: dict, path: str | Path) -> None:
    """torch.save, written whole or not at all (files.write_atomic)."""
    write_atomic(path, lambda file: torch.save(state, file), lambda: _tensor_bytes(state))


def load_checkpoint(path: str | Path) -> dict:
    """torch.load with weights_only=True: tensors and plain data only, never code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train first or pass --resume PATH")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; this is something else
            raise UserError(f"checkpoint {path} is not a PyTorch checkpoint (truncated or corrupt?); "
                            "delete it or resume from another file") from None
        reason = first_line(err, limit=None) if str(err).strip() else "unsafe content"
        if "Weights only load failed" in reason:
            reason = "it holds objects other than tensors and plain data"
        raise UserError(f"checkpoint {path} refused: {reason}; only weights_only checkpoints "
                        "load (nothing in it was executed)") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(err, 120)}); "
                        "delete it or resume from another file") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} does not hold a dict of training state")
    return state


def all_finite(tensors) -> bool:
    """True when no floating-point tensor holds a nan or inf; one device read for all of them."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def check_free_space(out_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse at start-up when out_dir's disk cannot hold last.pt: about the weights plus the optimizer's
    copies of them (SGD's momentum, Adam's two moments), counted from its defaults before it has any state."""
    defaults = optimizer.defaults
    copies = 2 if "betas" in defaults else int(bool(defaults.get("momentum", 0)))
    needed = sum(t.nbytes for t in model.state_dict().values()) * (1 + copies)
    free = free_bytes(out_dir)
    if free is not None and free < needed:
        raise UserError(f"{out_dir} has {shown_size(free)} free but a checkpoint needs about "
                        f"{shown_size(needed)}; free some space or pick another --out-dir")


def _tensor_bytes(value) -> int:
    if isinstance(value, dict | list | tuple):
        return sum(map(_tensor_bytes, value.values() if isinstance(value, dict) else value))
    return value.nbytes if isinstance(value, torch.Tensor) else 0


# lr_find.py puts back the same RNGs in memory (its own copy, so that it can be copied into a project alone).

def capture_rng_state() -> dict:
    """Every global RNG a training step may draw from, as tensors and plain values only (so it
    survives ``torch.save``/``torch.load(weights_only=True)`` inside a checkpoint). CUDA: the generator of
    this process's own GPU. Under torchrun every rank seeds its GPU's alike and draws as much from it each
    step (the same model, equal shards), so rank 0's, which its checkpoint keeps, is every rank's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    if (np := sys.modules.get("numpy")) is not None:  # touched only when the caller already imported it
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                          float(cached))
    return state


def seed_rngs(seed: int) -> None:
    """--seed for torch (CPU and every GPU), numpy and Python's random: a fork's augmentation may draw from
    any of them. DataLoader workers seed all three from their loader's generator (torch does)."""
    torch.manual_seed(seed)
    random.seed(seed)
    if (np := sys.modules.get("numpy")) is not None:
        np.random.seed(seed)


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():  # into this process's own GPU, whatever its index
        own = state["cuda"][0] if isinstance(state["cuda"], (list, tuple)) else state["cuda"]  # older: [all]
        torch.cuda.set_rng_state(own, torch.cuda.current_device())
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys).astype(np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------- resume

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "rng", "run", "config", "data")  # train.py's save
RUN_COUNTERS = ("epoch", "batch", "step", "part")


@dataclass
class Resumed:
    """A checkpoint a run continues from, and where it was read."""

    path: Path
    state: dict


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


def changed_files(saved: dict, data: dict) -> list[str]:
    """The splits whose files differ from those a checkpoint's data record lists (none where either has no
    list: tensors, or a checkpoint older than the lists)."""
    before, now = saved.get("files") or {}, data.get("files") or {}
    return [split for split in now if split in before and before[split] != now[split]]


def restore(resumed: Resumed | None, info, epochs: int, record: type, **objects):
    """A checkpoint's states back into the run's `objects` (model, optimizer, scheduler, scaler, ema: a None
    is skipped), then its RNGs, on data (`info`: batches.DataInfo) that gives the epochs its schedule was
    built for; one UserError line if anything does not fit. Returns where the run stands, its part counted,
    as a `record` (train.Progress), which must know each of the saved run's fields (a new run: a new one)."""
    if resumed is None:
        return record()
    check_same_data(resumed, info.data_record())
    if unknown := sorted(set(resumed.state["run"]) - {f.name for f in dataclasses.fields(record)}):
        raise UserError(f"checkpoint {resumed.path} was written by another version of train.py (its run "
                        f"record holds {', '.join(unknown)}, which this train.py's {record.__name__} lacks): "
                        "resume it with the version that wrote it (check out that commit), or start a new "
                        f"run with another --out-dir, from its weights with --init-from {resumed.path}")
    try:
        for key, target in objects.items():
            if target is not None and resumed.state.get(key) is not None:
                target.load_state_dict(resumed.state[key])
        restore_rng_state(resumed.state["rng"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
        raise UserError(f"checkpoint {resumed.path} does not fit this model and optimizer "
                        f"({first_line(err)}); resume it with the settings it was written with, or start a "
                        "new run") from None
    run = {**resumed.state["run"], "part": resumed.state["run"]["part"] + 1}
    where = ("its training done: the test pass and summary.json next" if run.get("stopped") or
             run["epoch"] >= epochs else position(run["epoch"], run["batch"], epochs, info.batches))
    processes.say(f"resumed from {resumed.path} at step {run['step']} ({where})")
    return record(**run)


def unlogged(losses: list, counts: list) -> dict:
    """The loop's losses since its last log point and their normalizers, as a checkpoint keeps them (a save
    may read the device): a run resumed between two log points logs the mean an uninterrupted run logs."""
    return {"losses": torch.stack(losses).cpu() if losses else None,
            "counts": [count.cpu() if isinstance(count, torch.Tensor) else count for count in counts]}


def restore_unlogged(resumed: Resumed | None, device: torch.device) -> tuple[list, list]:
    """The losses and normalizers `unlogged` kept, on `device`, each as the loop held it (a new run: none)."""
    saved = resumed.state.get("unlogged") if resumed else None
    if not saved:
        return [], []
    losses = [] if saved["losses"] is None else [*saved["losses"].to(device)]
    counts = [count.to(device) if isinstance(count, torch.Tensor) else count for count in saved["counts"]]
    return losses, counts


def position(epoch: int, batch: int, epochs: int, batches: int) -> str:
    """Where a checkpoint continues, counted from 1 as the progress lines count."""
    if batch >= batches:
        return f"epoch {epoch + 1}/{epochs} trained, its evaluation next"
    return f"epoch {epoch + 1}/{epochs} at batch {batch + 1}/{batches}"


# ---------------------------------------------------------------- the task a checkpoint was trained for


def task_identity(task) -> dict:
    """The task a sweep or checkpoint was made for: its name and a hash of its source, so that an
    edited loss counts as another task."""
    return {"name": task.NAME, "source": hashlib.sha256(inspect.getsource(task).encode()).hexdigest()[:16]}


def check_task(ckpt: dict, path: Path, task, fix: str) -> str | None:
    """A checkpoint of train.py's is used with the task it was trained for (task: the task module): another
    task is refused in one line, naming both; the same task edited since is a note, returned to be said."""
    if ckpt.get("task") != task.NAME:
        raise UserError(f"checkpoint {path} was trained for the task {ckpt.get('task')!r}, and task.py is "
                        f"{task.NAME!r}; {fix}")
    if ckpt.get("task_source") != task_identity(task)["source"]:
        return f"task.py has changed since {path} was saved: the loss and metrics below are today's task.py's"
    return None


def check_classes(ckpt: dict, path: Path, names: list[str], fix: str) -> None:
    """The data's classes (outputs) are the ones the checkpoint's model was trained for, in its order."""
    saved = ckpt["data"].get("names") if isinstance(ckpt.get("data"), dict) else None
    if saved is not None and saved != names:
        raise UserError(f"checkpoint {path} was trained on {len(saved)} classes {saved[:6]}, and the data "
                        f"here has {len(names)}: {names[:6]}; its outputs mean other classes: {fix}")


def load_predictor(path: Path, task) -> dict:
    """--predict's checkpoint: train.py's, for this task, holding its class names and how its images
    were read ("inputs"); any other is refused in one line before anything is built."""
    if not path.is_file():
        raise UserError(f"--checkpoint {path}: no such file; train first (the default is runs/default/"
                        "best.pt) or pass --checkpoint PATH, a best.pt or last.pt of train.py")
    ckpt = load_checkpoint(path)
    inputs = ckpt.get("inputs")
    if not (isinstance(ckpt.get("config"), dict) and isinstance(ckpt.get("data"), dict)
            and isinstance(inputs, dict) and "reading" in inputs):
        raise UserError(f"checkpoint {path} records no image preprocessing: it predates --predict or is not "
                        "train.py's; train it again with this version to predict with it")
    check_task(ckpt, path, task, "predict with the task.py it was trained with")
    if inputs.get("members"):
        raise UserError(f"--predict reads one image per file, and {path}'s model takes several inputs "
                        f"({inputs['members']}); run it on your tensors in your own code")
    if inputs["reading"] is None:
        dataset = ckpt["config"].get("dataset")
        raise UserError(f"--predict reads image files (and --tta flip mirrors them), and {path} was trained "
                        f"on inputs that are not images (--dataset {dataset}); run its model on your tensors "
                        "in your own code")
    return ckpt
