"""The checkpoint: written atomically, loaded with weights_only=True; the RNG states and the task it keeps.
What it holds is the dict train.py builds where it saves; resume.py reads it back."""

from __future__ import annotations

import hashlib
import inspect
import pickle
import random
import re
import sys
import zipfile
from pathlib import Path

import torch
from torch import nn

from configs import UserError, first_line
from machinery.files import free_bytes, shown_size, write_atomic


def write_checkpoint(state: dict, path: str | Path) -> None:
    """torch.save, written whole or not at all."""
    write_atomic(path, lambda file: torch.save(state, file), lambda: _tensor_bytes(state))


def load_checkpoint(path: str | Path) -> dict:
    """torch.load with weights_only=True: tensors and plain data only, never code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train first or pass --resume PATH")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refused(path, err) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(err, 120)}); "
                        "delete it or resume from another file") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} does not hold a dict of training state")
    return state


def refused(path: Path, err: pickle.UnpicklingError) -> UserError:
    """A file torch.load refused: not a checkpoint at all, or one holding more than tensors and plain data."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; this is something else
        return UserError(f"checkpoint {path} is not a PyTorch checkpoint (truncated or corrupt?); delete it "
                         "or resume from another file")
    reason = first_line(err, limit=None) if str(err).strip() else "unsafe content"
    if "Weights only load failed" in reason:
        reason = "it holds objects other than tensors and plain data"
    return UserError(f"checkpoint {path} refused: {reason}; only weights_only checkpoints load (nothing in "
                     "it was executed)")


def weights_of(state: dict) -> dict:
    """A checkpoint's weights (--ema's, "model", Lightning's, plain) without DDP's or compile's prefix."""
    weights = state.get("ema") or state.get("model", state.get("state_dict", state))
    if not isinstance(weights, dict):
        raise UserError("the checkpoint holds no state_dict (a dict of tensors)")
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", key): value for key, value in weights.items()}


def all_finite(tensors) -> bool:
    """True when no floating-point tensor holds a nan or inf; one device read for all of them."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def check_free_space(out_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema=None) -> None:
    """Refused at start-up: a disk without room for last.pt, best.pt and the one being written."""
    copies = 2 if "betas" in optimizer.defaults else int(bool(optimizer.defaults.get("momentum", 0)))
    size = sum(t.nbytes for t in model.state_dict().values()) * (1 + copies + (ema is not None))
    kept = sum(file.stat().st_size for file in (out_dir / "last.pt", out_dir / "best.pt") if file.is_file())
    needed = 3 * size - kept  # what is there already is replaced
    free = free_bytes(out_dir)
    if free is not None and free < needed:
        raise UserError(f"{out_dir} has {shown_size(free)} free but a checkpoint needs about "
                        f"{shown_size(size)} and a save up to {shown_size(needed)} (last.pt, best.pt and the "
                        "one being written); free some space or pick another --out-dir")


def _tensor_bytes(value) -> int:
    if isinstance(value, dict | list | tuple):
        return sum(map(_tensor_bytes, value.values() if isinstance(value, dict) else value))
    return value.nbytes if isinstance(value, torch.Tensor) else 0


def unlogged(losses: list, counts: list) -> dict:
    """The losses since the last log point, and their normalizers: a resume logs the mean they make."""
    return {"losses": torch.stack(losses).cpu() if losses else None,
            "counts": [count.cpu() if isinstance(count, torch.Tensor) else count for count in counts]}


# ---------------------------------------------------------------- RNG states (lr_find.py has its own copy)


def capture_rng_state() -> dict:
    """Every global RNG a step may draw from, as tensors and plain values; CUDA: this process's GPU's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    if (np := sys.modules.get("numpy")) is not None:  # touched only where imported
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                          float(cached))
    return state


def seed_rngs(seed: int) -> None:
    """--seed for torch (CPU and every GPU), numpy and Python's random: a fork may draw from any."""
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


# ---------------------------------------------------------------- the task a checkpoint was trained for


def task_identity(task) -> dict:
    """A task's name, and a hash of its source: an edited loss is another task."""
    return {"name": task.NAME, "source": hashlib.sha256(inspect.getsource(task).encode()).hexdigest()[:16]}


def check_task(ckpt: dict, path: Path, task, fix: str) -> str | None:
    """Another task's checkpoint is refused in one line; the same task edited since is a note, returned."""
    if ckpt.get("task") != task.NAME:
        raise UserError(f"checkpoint {path} was trained for the task {ckpt.get('task')!r}, and task.py is "
                        f"{task.NAME!r}; {fix}")
    if ckpt.get("task_source") != task_identity(task)["source"]:
        return f"task.py has changed since {path} was saved: the loss and metrics below are today's task.py's"
    return None


def changed_files(saved: dict, data: dict) -> list[str]:
    """The splits whose files differ from those a checkpoint's data record lists (none where either has no
    list: tensors, or a checkpoint older than the lists)."""
    before, now = saved.get("files") or {}, data.get("files") or {}
    return [split for split in now if split in before and before[split] != now[split]]


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
