"""Files a run writes and reads back: checkpoints, and every other output written whole.

A checkpoint is written atomically (temporary file, fsync, rename) and loaded with
weights_only=True; a failed write is one UserError line naming the file, the size it needed and
the space left, and the previous file stays as it was. Resuming checks the file and the config
before any state is put back. The run folder's own checks live here too: writable, room for a
checkpoint, no unfinished run to overwrite.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import random
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from configs import OUT_DIR_RESUMES, Config, UserError, first_line
from configs.resolve import check_resumable, resumed_config, task_identity
from distributed import lock_out_dir, release_all


def write_checkpoint(state: dict, path: str | Path) -> None:
    """Write atomically (a temporary file, fsync, os.replace): a crash or kill at any moment leaves either
    the old file or the new one, never a torn one; a failed write is one line (the module's docstring)."""
    _write_atomic(Path(path), lambda file: torch.save(state, file), lambda: _tensor_bytes(state))


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


# lr_find.py puts back the same RNGs in memory (its own copy, so that it can be copied into a project alone).

def capture_rng_state() -> dict:
    """Every global RNG a training step may draw from, as tensors and plain values only (so it
    survives ``torch.save``/``torch.load(weights_only=True)`` inside a checkpoint)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if (np := sys.modules.get("numpy")) is not None:  # touched only when the caller already imported it
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                          float(cached))
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"])[: torch.cuda.device_count()])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys).astype(np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------- files written whole, and the run folder

FIXES = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
         errno.EROFS: "use a writable disk", errno.ENOTDIR: "move the file in the way",
         errno.EISDIR: "move the folder in the way"}

def check_free_space(out_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse at start-up when out_dir's disk cannot hold last.pt: about the weights plus the optimizer's
    copies of them (SGD's momentum, Adam's two moments), counted from its defaults before it has any state."""
    defaults = optimizer.defaults
    copies = 2 if "betas" in defaults else int(bool(defaults.get("momentum", 0)))
    needed = sum(t.nbytes for t in model.state_dict().values()) * (1 + copies)
    free = _free_bytes(out_dir)
    if free is not None and free < needed:
        raise UserError(f"{out_dir} has {_size(free)} free but a checkpoint needs about {_size(needed)}; "
                        "free some space or pick another --out-dir")


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write any file the way checkpoints are written: whole or not at all, one line on failure."""
    _write_atomic(Path(path), lambda file: file.write(data), lambda: len(data))


def write_json_atomic(path: str | Path, value) -> None:
    write_bytes_atomic(path, (json.dumps(value, indent=2) + "\n").encode())


@contextlib.contextmanager
def reporting_write_errors(path: str | Path, label: str | None = None):
    """Turn an OSError inside the block (say, from a TensorBoard writer) into one UserError line,
    naming `label`, else the file that failed, else `path`."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err, label=label or err.filename) from None


def write_error(path: str | Path, err: OSError, size: int | None = None,
                label: str | None = None) -> UserError:
    """One line for a failed write: the file, why, the size it needed and the space left there."""
    free = _free_bytes(Path(path))
    facts = ([f"needs about {_size(size)}"] if size is not None else []) + (
        [f"{_size(free)} free"] if free is not None else [])
    detail = f" ({', '.join(facts)})" if facts else ""
    reason = err.strerror or str(err) or type(err).__name__
    fix = FIXES.get(err.errno, "fix its permissions")
    return UserError(f"cannot write {label or path}: {reason[:1].lower()}{reason[1:]}{detail}; {fix} "
                     "or pick another --out-dir")


def _write_atomic(path: Path, write: Callable, size: Callable[[], int]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            keeper = _ErrorKeeper(f)
            try:
                write(keeper)
            except RuntimeError as err:  # torch.save's report of an OSError: the keeper kept the OSError
                raise (keeper.error or err) from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        error = write_error(path, err, size())
        raise UserError(f"{error}; any earlier {path.name} is unchanged") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _ErrorKeeper:
    """torch.save reports an OSError from write() as a RuntimeError without its errno; keep it."""

    def __init__(self, file):
        self.file, self.flush, self.error = file, file.flush, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise


def _tensor_bytes(value) -> int:
    if isinstance(value, dict | list | tuple):
        return sum(map(_tensor_bytes, value.values() if isinstance(value, dict) else value))
    return value.nbytes if isinstance(value, torch.Tensor) else 0


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding `path`, or its nearest existing parent; None if unknown."""
    for folder in (path, *path.absolute().parents):
        with contextlib.suppress(OSError):  # a folder not made yet: its parent's disk
            return shutil.disk_usage(folder).free
    return None


def _size(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


@contextlib.contextmanager
def downloading(folder: Path, failed: str):
    """A download into `folder`, quiet: a failure (no network, a proxy, a bad hash, a full disk) is one
    UserError line, `failed` with its {reason}, and the folders it made are removed while empty."""
    created = [f for f in (folder, *folder.absolute().parents) if not f.exists()]  # deepest first
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    except Exception as err:
        for empty in created:
            with contextlib.suppress(OSError):
                empty.rmdir()
        raise UserError(failed.format(reason=first_line(getattr(err, "reason", "") or err, 100))) from None


# ---------------------------------------------------------------- resume

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "rng", "run", "config", "data")  # train.py's save()
RUN_COUNTERS = ("epoch", "batch", "step", "part")


def load_resume(cfg: Config, given: dict | None, task) -> tuple[dict, Path, Config]:
    """--resume: the checkpoint, its path, and the config the run continues with (the checkpoint's,
    with `given`, the settings the command line gave, on top; None: all of cfg's). Refuses in one
    line a file that is not a train.py checkpoint, another task's, nan/inf weights, and a config that
    would change what the saved state means."""
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
    cfg = resumed_config(ckpt["config"], cfg.to_dict() if given is None else given, path)
    check_resumable(ckpt["config"], cfg)
    # The run asked for is already complete: not an error (code 0), the scripts print it and exit 0.
    if run.get("stopped"):
        raise UserError(f"{path} holds a run that stopped early at epoch {run['epoch']} ({run['stopped']}): "
                        "nothing to do, nothing changed; train longer with a new run", code=0)
    if run["epoch"] >= cfg.epochs:
        raise UserError(f"{path} holds a complete run ({cfg.epochs} epochs, step {run['step']}): nothing to "
                        "do, nothing changed; train longer with a new run (or --epochs N --allow-more-epochs "
                        "for constant, warmup and step schedules)", code=0)
    return ckpt, path, cfg


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
    if inputs["reading"] is None:
        dataset = ckpt["config"].get("dataset")
        raise UserError(f"--predict reads image files (and --tta flip mirrors them), and {path} was trained "
                        f"on inputs that are not images (--dataset {dataset}); run its model on your tensors "
                        "in your own code")
    return ckpt


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


def check_same_data(ckpt: dict, path: Path, data: dict) -> None:
    """A resume's data must give the epochs the checkpoint's schedule was built for, and the splits that
    choose best.pt and report the result: the same number of training, val and test examples, of batches
    per epoch, and the same classes (outputs)."""
    saved = ckpt["data"]
    if saved == data:
        return
    what = [f"{key.replace('_', ' ')} {saved.get(key)} -> {data[key]}"
            for key in ("train_size", "val_size", "test_size", "batches") if saved.get(key) != data[key]]
    if saved.get("names") != data["names"]:
        names = saved.get("names") or []
        what.append(f"{len(names)} -> {len(data['names'])} classes ({names[:6]} -> {data['names'][:6]})")
    raise UserError(f"checkpoint {path} was trained on other data ({'; '.join(what)}): its schedule and "
                    "model do not fit this data; resume on the data it was trained on, or start a new run "
                    "with a new --out-dir")


def restore_training_state(ckpt: dict, path: Path, model: nn.Module, optimizer, scheduler, scaler) -> None:
    """A checkpoint's states back into the run's objects; one UserError line if they do not fit."""
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        restore_rng_state(ckpt["rng"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
        raise UserError(f"checkpoint {path} does not fit this model and optimizer ({first_line(err)}); "
                        "resume it with the settings it was written with, or start a new run") from None


def position(epoch: int, batch: int, epochs: int, batches: int) -> str:
    """Where a checkpoint continues, counted from 1 as the progress lines count."""
    if batch >= batches:
        return f"epoch {epoch + 1}/{epochs} trained, its evaluation next"
    return f"epoch {epoch + 1}/{epochs} at batch {batch + 1}/{batches}"


def claim_out_dir(out_dir: Path, resumed_from: Path | None = None) -> None:
    """Before any data is loaded: --out-dir can be written, holds no unfinished run (whose last.pt --resume
    would continue) that this one would overwrite, and no other live run. This process then owns the folder
    (distributed.lock_out_dir) and removes the temporary files that a save killed midway left there."""
    # A file written and deleted proves the folder writable; the folders made for it go again, so that a
    # run that then stops on another error leaves nothing behind.
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise UserError(f"cannot create --out-dir {out_dir}: a file is in the way; pick another "
                        "--out-dir") from None
    except OSError as err:
        raise write_error(out_dir, err, label=f"--out-dir {out_dir}") from None
    finally:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
    lock_out_dir(out_dir)  # first: a live run's folder is "in use", whatever its last.pt says by now
    last, saved = out_dir / "last.pt", {}
    if last.is_file() and (resumed_from is None or resumed_from.resolve() != last.resolve()):
        with contextlib.suppress(UserError):  # unreadable, so there is nothing to continue
            saved = load_checkpoint(last)
    step, total = saved.get("step", 0), saved.get("total_steps", 0)
    stopped = isinstance(saved.get("run"), dict) and saved["run"].get("stopped")  # --early-stop: finished
    if isinstance(step, int) and isinstance(total, int) and step < total and not stopped:
        release_all(out_dir / ".lock")
        this = f"resuming {resumed_from} there" if resumed_from else "a new run"
        raise UserError(f"{last} holds an unfinished run (step {step} of {total}) that {this} would "
                        f"overwrite; continue it with --resume --out-dir {out_dir}, or pick another "
                        "--out-dir, or delete the file to start over")
    for tmp in out_dir.glob(".*.tmp"):  # no other run is in the folder now: no one is writing these
        if not tmp.name.endswith(f".{os.getpid()}.tmp"):
            tmp.unlink(missing_ok=True)
