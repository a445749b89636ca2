"""What runs around the training loop, so that train.py reads as the loop itself.

First what train.py and lr_find.py's command line share: device and AMP, torchrun, checkpoint files
and RNG states, output files written whole. Then train.py's alone: resume and checkpoint contents,
stop rules (Ctrl-C, divergence), --lr find (its sweep is lr_find.py's command's too), evaluation
tallies, TensorBoard, the summary, pictures.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import io
import itertools
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from configs import Config, UserError, check_resumable, resumed_config


def pick_device(name: str = "auto") -> torch.device:
    """cuda > mps > cpu unless forced; under torchrun each process takes its LOCAL_RANK's GPU."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda" and device.index is not None and world_size > 1:
        raise UserError(f"--device {name} would put all {world_size} torchrun processes on one GPU; "
                        "use --device cuda (each process takes its LOCAL_RANK's GPU)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device cuda was asked for but no CUDA GPU is visible; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    return device


def amp_setup(device: torch.device, mode: str) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """Autocast dtype and GradScaler: bf16 where the device has it, else fp16 with a scaler."""
    dtype = amp_dtype(device, mode)
    return dtype, torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def amp_dtype(device: torch.device, mode: str) -> torch.dtype | None:
    """The autocast dtype `mode` means on `device`; None is off.

    "auto" is off on CPU and MPS, where autocast rarely pays; bf16 or fp16 can still be forced.
    On CUDA it is bf16 only where the GPU computes in it natively (Ampere and later): V100 and
    T4 emulate bf16 slowly, which torch counts as supported unless including_emulation=False.
    """
    if mode == "auto":
        if device.type != "cuda":
            return None
        mode = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ---------------------------------------------------------------- processes (torchrun)

def setup_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun: one process per GPU (nccl), or gloo on CPU."""
    if "RANK" not in os.environ:
        return 0, 1, pick_device(device_name)
    device = pick_device(device_name)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any, so that all of them stop at the same step."""
    if not is_distributed():
        return flag
    return all_reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0


def from_rank0(value):
    """Rank 0's value on every rank, for decisions only rank 0 can make (its files, say)."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def on_rank0(work: Callable, *args) -> None:
    """`work(*args)` on rank 0 alone (a check of its files, a write), its UserError raised on every
    rank: rank 0 decides, and one broadcast makes all ranks go on, or stop, together."""
    problem = None
    if not is_distributed():
        work(*args)
    elif dist.get_rank() == 0:
        try:
            work(*args)
        except UserError as err:
            problem = str(err)
    problem = from_rank0(problem)  # on every rank: the ranks that did not run `work` wait here
    if problem:
        raise UserError(problem)


def sync_buffers(module: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank.

    DDP broadcasts buffers at the start of each forward, so after the last one every rank holds
    statistics updated by its own shard; syncing before evaluation and saving removes that skew.
    """
    if is_distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def ranks_agree(module: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters and buffers (a DDP sanity check)."""
    if not is_distributed():
        return True
    flat = torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([float(torch.equal(flat, reference))], device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def cleanup_distributed() -> None:
    """Leave the process group, then pause a moment before the process exits. Gloo's worker threads
    let go of a finished collective's tensors just after the caller's wait returns, and need the GIL
    to free one that Python created; a process that is already exiting then aborts with "terminate
    called without an active exception" (seen at exit of torchrun runs, error paths included)."""
    if is_distributed():
        dist.destroy_process_group()
        time.sleep(0.1)  # the GIL is free: the worker threads finish


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP's `.module` and torch.compile's `._orig_mod` wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, fsync, then os.replace.

    A crash or kill at any moment leaves either the old file or the new one, never a torn one.
    A failed write (disk full, no permission, read-only) raises UserError naming the path, the
    size it needed and the free space, and leaves the old file as it was.
    """

    def write(file) -> None:
        keeper = _ErrorKeeper(file)
        try:
            torch.save(state, keeper)
        except RuntimeError:
            if keeper.error is None:
                raise
            raise keeper.error from None

    _write_atomic(Path(path), write, lambda: _tensor_bytes(state))


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
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "unsafe content"
        if "Weights only load failed" in reason:
            reason = "it holds objects other than tensors and plain data"
        raise UserError(f"checkpoint {path} refused: {reason}; only weights_only checkpoints "
                        "load (nothing in it was executed)") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first[:120]}); "
                        "delete it or resume from another file") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} does not hold a dict of training state")
    return state


def all_finite(tensors) -> bool:
    """True when no floating-point tensor holds a nan or inf; one device read for all of them."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


# lr_find.py keeps a private copy of these two, so that it can be copied into a project alone.

def capture_rng_state() -> dict:
    """Every global RNG a training step may draw from, as tensors and plain values only (so it
    survives ``torch.save``/``torch.load(weights_only=True)`` inside a checkpoint)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")  # touched only when the caller already imported it
    if np is not None:
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
        np = sys.modules.get("numpy") or importlib.import_module("numpy")
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------- output files

FIXES = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
         errno.EROFS: "use a writable disk", errno.ENOTDIR: "move the file in the way",
         errno.EISDIR: "move the folder in the way"}

def check_writable_dir(path: str | Path, what: str = "--out-dir") -> None:
    """Prove that `path` can be created and written, before any time is spent training.

    Folders it had to create are removed again, so a run that then stops on another error
    leaves nothing behind.
    """
    path = Path(path)
    created = [folder for folder in (path, *path.parents) if not folder.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise UserError(f"cannot create {what} {path}: a file is in the way; pick another {what}") from None
    except OSError as err:
        raise write_error(path, err, label=f"{what} {path}") from None
    finally:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()


def check_free_space(path: str | Path, needed: int, what: str) -> None:
    """Refuse at start-up when `path`'s disk cannot hold `needed` bytes (one checkpoint, say)."""
    free = _free_bytes(Path(path))
    if free is not None and free < needed:
        raise UserError(f"{path} has {_size(free)} free but {what} needs about {_size(needed)}; "
                        "free some space or pick another --out-dir")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file the way checkpoints are written: whole or not at all, one line on failure."""
    data = text.encode()
    _write_atomic(Path(path), lambda file: file.write(data), lambda: len(data))


def write_json_atomic(path: str | Path, value) -> None:
    write_text_atomic(path, json.dumps(value, indent=2) + "\n")


def write_png_atomic(path: str | Path, picture) -> None:
    """A picture (H, W, 3 uint8 array) written whole or not at all, one line on failure."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    data = buffer.getvalue()
    _write_atomic(Path(path), lambda file: file.write(data), lambda: len(data))


@contextlib.contextmanager
def reporting_write_errors(path: str | Path, label: str | None = None):
    """Turn an OSError inside the block (say, from a TensorBoard writer) into one UserError line,
    naming `label`, else the file that failed, else `path`."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err, label=label or err.filename) from None


def quiet_tensorboard_thread() -> None:
    """Keep Python from printing a traceback when TensorBoard's writer thread dies of an OSError.

    That thread keeps its error and raises it again at the next write or flush, in the main
    thread, where reporting_write_errors makes it one line. Other threads report as before.
    """
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


def write_error(path: str | Path, err: OSError, size: int | None = None,
                label: str | None = None) -> UserError:
    """One line for a failed write: the file, why, the size it needed and the space left there."""
    free = _free_bytes(Path(path))
    facts = ([f"needs about {_size(size)}"] if size is not None else []) + (
        [f"{_size(free)} free"] if free is not None else [])
    detail = f" ({', '.join(facts)})" if facts else ""
    fix = FIXES.get(err.errno, "fix its permissions")
    return UserError(f"cannot write {label or path}: {_reason(err)}{detail}; {fix} or pick "
                     "another --out-dir")


def _write_atomic(path: Path, write: Callable, size: Callable[[], int]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
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
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding `path`, or its nearest existing parent; None if unknown."""
    for folder in (path, *path.absolute().parents):
        with contextlib.suppress(OSError):
            if folder.exists():
                return shutil.disk_usage(folder).free
    return None


def _size(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def _reason(err: OSError) -> str:
    text = err.strerror or str(err) or type(err).__name__
    return text[:1].lower() + text[1:]


# ---------------------------------------------------------------- train.py's checkpoints and resume

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "epoch", "batch", "step", "rng", "config")


def training_state(model: nn.Module, optimizer, scheduler, scaler, **progress) -> dict:
    """A checkpoint: the states a run continues from bit for bit, every RNG's included, plus
    `progress`: where it stands (epoch, batch, step, ...) and its config."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "rng": capture_rng_state(),
            "scaler": scaler.state_dict() if scaler is not None else None, **progress}


def load_resume(cfg: Config, given: dict | None) -> tuple[dict, Path, Config]:
    """--resume: the checkpoint, its path, and the config the run continues with (the checkpoint's,
    with `given`, the settings the command line gave, on top; None: all of cfg's). Refuses in one
    line a file that is not a train.py checkpoint, nan/inf weights, and a config that would change
    what the saved state means."""
    path = Path(cfg.out_dir) / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
    ckpt = load_checkpoint(path)
    missing = [key for key in CHECKPOINT_KEYS if key not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} lacks {', '.join(missing)}: not a train.py checkpoint")
    if not (isinstance(ckpt["model"], dict) and isinstance(ckpt["config"], dict)):
        raise UserError(f"checkpoint {path} is not a train.py checkpoint (model or config is not a dict)")
    if not all_finite([t for t in ckpt["model"].values() if isinstance(t, torch.Tensor)]):
        raise UserError(f"checkpoint {path} holds nan or inf weights (a diverged run); start a new "
                        "run with a lower --lr")
    cfg = resumed_config(ckpt["config"], cfg.to_dict() if given is None else given, path)
    check_resumable(ckpt["config"], cfg)
    return ckpt, path, cfg


def restore_training_state(ckpt: dict, path: Path, model: nn.Module, optimizer, scheduler, scaler) -> None:
    """training_state's states back into the run's objects; one UserError line if they do not fit."""
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        restore_rng_state(ckpt["rng"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise UserError(f"checkpoint {path} does not fit this model and optimizer ({first}); "
                        "resume it with the settings it was written with, or start a new run") from None


def position(epoch: int, batch: int, epochs: int, batches: int) -> str:
    """Where a checkpoint continues, counted from 1 as the progress lines count."""
    if epoch >= epochs:
        return "the run was already complete"
    if batch >= batches:
        return f"epoch {epoch + 1}/{epochs} trained, its evaluation next"
    return f"epoch {epoch + 1}/{epochs} at batch {batch + 1}/{batches}"


def refuse_unfinished_run(path: Path) -> None:
    """A new run must not replace the last.pt of an unfinished run, which --resume would continue."""
    if not path.is_file():
        return
    try:
        saved = load_checkpoint(path)
    except UserError:
        return  # unreadable, so there is nothing to continue
    if saved.get("step", 0) < saved.get("total_steps", 0):
        raise UserError(f"{path} holds an unfinished run (step {saved['step']} of {saved['total_steps']}); "
                        "continue it with --resume, or pick another --out-dir, or delete the file to start "
                        "over")


def checkpoint_bytes(model: nn.Module, cfg: Config) -> int:
    """About the size of last.pt: the weights plus the optimizer's copies (momentum; AdamW's two)."""
    weights = sum(t.nbytes for t in model.state_dict().values())
    return weights * (1 + (2 if cfg.optimizer == "adamw" else int(cfg.momentum > 0)))


# ---------------------------------------------------------------- train.py's stop rules and --lr find

class StopFlag:
    """SIGINT/SIGTERM only set a flag; the loop saves a checkpoint after the step, then stops."""

    def __init__(self):
        self.signal = 0
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._set)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _set(self, signum, frame):
        if self.signal:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.signal = signum

    def now(self, log_point: bool, device: torch.device) -> bool:
        """Stop after this step? Alone: as soon as a signal came. Under torchrun every rank must stop
        at the same step (one that left would hang the others in DDP's next all-reduce), so they
        agree by an all-reduce, at log points only, where the loop reads the device anyway."""
        if not is_distributed():
            return bool(self.signal)
        return log_point and any_rank(bool(self.signal), device)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signal or signal.SIGTERM)  # a rank stopped by the others': as SIGTERM


# A logged training loss above this multiple of the run's first batch loss is not coming back
# (lr_find.py stops its sweep at the same factor over its best loss).
DIVERGENCE_FACTOR = 4.0


def divergence(train_loss: float, start_loss: float) -> str | None:
    """What says this logged training loss diverged, or None."""
    if not math.isfinite(train_loss):
        return f"train loss {train_loss}"
    if start_loss > 0 and train_loss > DIVERGENCE_FACTOR * start_loss:
        return f"train loss {train_loss:.4g}, over {DIVERGENCE_FACTOR:g}x the first batch's {start_loss:.4g}"
    return None


def diverged(what: str, step: int, at_lr: float, lr: float, last: Path, saved_step: int | None) -> UserError:
    """The line a diverged run stops with: where, what to try, and what `last` (last.pt) holds."""
    kept = "this run wrote no checkpoint" if saved_step is None else f"{last} still holds step {saved_step}"
    return UserError(f"training diverged at step {step} ({what}; lr {at_lr:.3g}): try a lower --lr than "
                     f"{lr:.3g}, e.g. --lr {lr / 10:.2g}, or `python lr_find.py` with the same options "
                     f"to find one; {kept}")


def sweep_lr(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, batches, amp_dtype, scaler,
             device: torch.device, batches_per_step: int = 1, progress: Callable | None = None):
    """lr_find.py's range test on train.py's model, data and a sweep `optimizer`, as both `python
    lr_find.py` and --lr find run it; lr_find puts the model and every RNG back bit for bit."""
    import lr_find  # only here: train.py needs lr_find.py for --lr find alone

    stream = (batch for epoch in itertools.count() for batch in batches.epoch(epoch))
    with contextlib.closing(stream):
        return lr_find.lr_find(
            model, optimizer, functools.partial(F.cross_entropy, label_smoothing=cfg.label_smoothing), stream,
            start_lr=cfg.find_start_lr, end_lr=cfg.find_end_lr, num_iter=cfg.find_iters,
            accum_steps=cfg.accum_steps * batches_per_step, autocast_dtype=amp_dtype, scaler=scaler,
            device=device, schedule=cfg.schedule, progress=progress,
            method=None if cfg.find_method == "auto" else cfg.find_method)


def find_lr(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, batches, amp_dtype,
            scaler, device: torch.device) -> float:
    """--lr find: sweep_lr, then write what lr_find.py writes and return the suggestion.

    Under torchrun rank 0 sweeps alone while the others wait for the rate: it accumulates
    world_size of its batches per step, so each step sees the global batch as DDP will. All ranks
    sweeping together would need the stop rule agreed at every step; one rank keeps lr_find as it is.
    """
    found = problem = None
    world_size = dist.get_world_size() if is_distributed() else 1
    if not is_distributed() or dist.get_rank() == 0:
        import lr_find

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = sweep_lr(cfg, model, optimizer, batches, amp_dtype, scaler, device, world_size)
            with reporting_write_errors(cfg.out_dir):
                wrote = lr_find.save_sweep(result, cfg.to_dict(), cfg.out_dir)
            found = result.suggestion
            if found is None:
                why = "; ".join(str(w.message) for w in caught) or "no usable points"
                problem = (f"the range test suggested no learning rate ({why}); look at {wrote[-1]}, "
                           "widen --find-start-lr/--find-end-lr or raise --find-iters, or pass --lr N")
        except ValueError as err:  # lr_find's checks of its arguments; UserError included
            problem = f"--lr find: {err}"
        if found is not None:
            alone = f"; rank 0 alone, {world_size}x its batches per step" if world_size > 1 else ""
            print(f"lr find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
                  f"{result.stop_reason}{alone}; suggested lr {found:.4g} ({result.method}); wrote "
                  f"{', '.join(str(path) for path in wrote)}")
    found, problem = from_rank0((found, problem))
    if problem:
        raise UserError(problem)
    return found


# ---------------------------------------------------------------- evaluation tallies and TensorBoard

WORST_SHOWN = 16  # the most confidently wrong validation images in their figure
INPUTS_SHOWN = 32  # training images in the figure of what the model receives


@dataclass
class Evaluation:
    """One pass over the validation split: read from the device once, in Tally.result()."""

    loss: float
    acc: float
    confusion: list[list[int]]  # rows: true class, columns: predicted class
    worst: tuple | None = None  # (confidence, inputs, targets, predictions), still on the device

    @property
    def per_class_acc(self) -> list[float | None]:
        """Each class's accuracy (None for a class absent from the split)."""
        return [row[i] / sum(row) if sum(row) else None for i, row in enumerate(self.confusion)]


class Tally:
    """Loss sum, confusion matrix and the most confidently wrong examples of one validation pass,
    kept on the device (a read per batch would wait for the device every batch).

    Under torchrun the counts are summed over processes; the wrong examples are this one's shard's.
    """

    def __init__(self, num_classes: int, device: torch.device, keep: int = WORST_SHOWN):
        self.num_classes, self.keep = num_classes, keep
        self.loss_sum = torch.zeros((), device=device)
        self.confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=device)
        self.worst: tuple | None = None

    def add(self, logits: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        logits = logits.float()
        self.loss_sum += torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        predicted = logits.argmax(1)
        self.confusion.index_add_(0, targets * self.num_classes + predicted, torch.ones_like(targets))
        confidence = logits.softmax(1).amax(1).masked_fill_(predicted == targets, -1.0)  # -1: right
        top = confidence.topk(min(self.keep, len(targets))).indices
        batch = (confidence[top], inputs[top], targets[top], predicted[top])
        if self.worst is not None:
            batch = tuple(torch.cat(pair) for pair in zip(self.worst, batch, strict=True))
            top = batch[0].topk(min(self.keep, len(batch[0]))).indices
            batch = tuple(t[top] for t in batch)
        self.worst = batch

    def result(self) -> Evaluation:
        values = all_reduce_sum(torch.cat([self.loss_sum.view(1), self.confusion.float()])).tolist()
        n = self.num_classes
        confusion = [[round(v) for v in values[1 + r * n: 1 + (r + 1) * n]] for r in range(n)]
        count = sum(map(sum, confusion))
        correct = sum(confusion[i][i] for i in range(n))
        return Evaluation(values[0] / count, correct / count, confusion, self.worst)


def summary_writer(out_dir: Path, resumed_step: int | None = None) -> tuple:
    """TensorBoard's writer for a train.py run in out_dir (one run, one set of curves), and the
    folder an earlier run's logs were moved to, or None.

    A new run first moves an earlier run's event files into a subfolder named after that run's
    start, so the two do not draw over each other. A resumed run tells TensorBoard to drop what
    the interrupted process logged after its checkpoint (purge_step), which it logs again.
    """
    from torch.utils.tensorboard import SummaryWriter

    if resumed_step is not None:
        return SummaryWriter(str(out_dir), purge_step=resumed_step + 1), None
    earlier = sorted(out_dir.glob("events.out.tfevents.*"))  # events.out.tfevents.<unix time>.<host>...
    if earlier:
        stamps = [int(p.name.split(".")[3]) for p in earlier if p.name.split(".")[3].isdigit()]
        started = time.strftime("%Y%m%d-%H%M%S", time.localtime(min(stamps, default=time.time())))
        if (out_dir / "hparams").is_dir():  # where add_hparams() put HPARAMS data before
            earlier.append(out_dir / "hparams")
        folder, n = out_dir / started, 1
        while folder.exists():
            n += 1
            folder = out_dir / f"{started}-{n}"
        folder.mkdir()
        for path in earlier:
            path.rename(folder / path.name)
        return SummaryWriter(str(out_dir)), folder
    return SummaryWriter(str(out_dir)), None


class TensorBoard:
    """Rank 0's TensorBoard writer for a train.py run (with active False, on the other ranks, every
    call does nothing). A failed write, here or in the writer's thread, is one UserError line naming
    out_dir; on any error the writer is closed quietly, keeping the curves so far (a diverged run's)."""

    def __init__(self, out_dir: Path, resumed_step: int | None, active: bool = True):
        self.out_dir, self.writer, self.moved = out_dir, None, None  # moved: an earlier run's logs
        if active:
            quiet_tensorboard_thread()
            with self._errors():
                self.writer, self.moved = summary_writer(out_dir, resumed_step)

    def _errors(self):
        return reporting_write_errors(self.out_dir, f"TensorBoard logs in {self.out_dir}")

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None and self.writer:
            with contextlib.suppress(OSError):
                self.writer.close()

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer:
            with self._errors():
                self.writer.add_scalar(tag, value, step)

    def inputs(self, inputs: torch.Tensor, targets: torch.Tensor, denormalize: Callable, names: list[str],
               step: int) -> None:
        """A training batch as the model receives it (after crop, flip, resize), back in pixels."""
        if self.writer:
            captions = [names[t] for t in targets[:INPUTS_SHOWN].tolist()]
            pixels = denormalize(inputs[:INPUTS_SHOWN]).cpu()
            with self._errors():
                self.writer.add_image("inputs", image_grid(pixels, captions), step, dataformats="HWC")

    def evaluation(self, val: Evaluation, names: list[str], denormalize: Callable, step: int) -> None:
        """Loss and accuracy, the confusion matrix and the most confidently wrong images."""
        if not self.writer:
            return
        with self._errors():
            self.writer.add_scalar("val/loss", val.loss, step)
            self.writer.add_scalar("val/acc", val.acc, step)
            self.writer.add_image("val/confusion", confusion_picture(val.confusion, names), step,
                                  dataformats="HWC")
            if val.worst is None:
                return
            confidence, inputs, targets, predicted = val.worst
            shown = [i for i, c in enumerate(confidence.tolist()) if c >= 0]  # -1 marks right answers
            if not shown:
                return
            captions = [f"{names[t]} as {names[p]} {c:.0%}" for c, t, p in zip(
                confidence[shown].tolist(), targets[shown].tolist(), predicted[shown].tolist(), strict=True)]
            self.writer.add_image("val/most_confidently_wrong",
                                  image_grid(denormalize(inputs).cpu()[shown], captions), step,
                                  dataformats="HWC")

    def finish(self, hparams: dict, metrics: tuple[str, ...] = ("val/acc", "val/loss")) -> None:
        """The HPARAMS tab's row for this run, then flush and close. Its metric columns are the run's
        own scalar curves (their last values), so no one-point charts appear as add_hparams() makes."""
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        with self._errors():
            for summary in hparams_summaries(hparams, dict.fromkeys(metrics, 0.0)):
                self.writer.file_writer.add_summary(summary)
            self.writer.flush()  # raises what the writer thread met; close() would drop it
            self.writer.close()


# ---------------------------------------------------------------- summaries

SECONDS_COVER = ("seconds: this process's training loop, evaluation and checkpoints included, start-up "
                 "not; total_seconds: the same over every part of the run")
RESUMED_COVER = ("this run was resumed: total_seconds adds each earlier part's time up to the checkpoint "
                 "the next part resumed from (time after a part's last save was lost)")


def run_summary(cfg: Config, lr: float, model: nn.Module, device: torch.device, val: Evaluation | None,
                names: list[str], best_acc: float, steps: int, epoch_rates: list[float], seconds: float,
                seconds_before: float, part: int) -> dict:
    """summary.json. Every rank builds it: ranks_in_sync compares them, a collective."""
    steady = epoch_rates[1:] or epoch_rates  # the first epoch pays for warm-up and compilation
    return {"val_acc": val.acc if val else math.nan, "val_loss": val.loss if val else math.nan,
            "best_val_acc": best_acc, "epochs": cfg.epochs, "steps": steps, "seconds": seconds,
            "total_seconds": seconds_before + seconds, "parts": part,
            "seconds_cover": SECONDS_COVER if part == 1 else f"{SECONDS_COVER}; {RESUMED_COVER}",
            "images_per_second": sum(steady) / len(steady) if steady else math.nan,
            "lr": lr, "world_size": dist.get_world_size() if is_distributed() else 1, "device": str(device),
            "ranks_in_sync": ranks_agree(model),
            "per_class_acc": dict(zip(names, val.per_class_acc, strict=True)) if val else None}


def write_summary(summary: dict, cfg: Config, val: Evaluation | None, names: list[str],
                  tensorboard: TensorBoard) -> None:
    """A run's last words, on rank 0: TensorBoard's HPARAMS row, confusion.png, summary.json, a line."""
    out_dir = Path(cfg.out_dir)
    hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)}
    tensorboard.finish({**hparams, "lr": summary["lr"]})
    if val:
        write_png_atomic(out_dir / "confusion.png", confusion_picture(val.confusion, names))
    write_json_atomic(out_dir / "summary.json", summary)
    total, parts = summary["total_seconds"], summary["parts"]
    print(f"done: val acc {summary['val_acc']:.2%} (best {summary['best_val_acc']:.2%}) in "
          f"{summary['seconds']:.1f}s{f' ({total:.1f}s over {parts} parts)' if parts > 1 else ''}; logs "
          f"and checkpoints in {out_dir}")


def report_evaluation(val: Evaluation, names: list[str], val_size: int, checkpoint: Path, step: int | None,
                      dataset: str, out_dir: Path, is_main: bool) -> dict:
    """--evaluate's report: printed, and written as eval.json and eval_confusion.png (rank 0)."""
    report = {"checkpoint": str(checkpoint), "step": step, "dataset": dataset,
              "val_size": val_size, "val_acc": val.acc, "val_loss": val.loss,
              "per_class_acc": dict(zip(names, val.per_class_acc, strict=True)),
              "confusion": val.confusion}
    if is_main:
        print(f"{checkpoint} on the {report['val_size']} {dataset} validation images: val acc "
              f"{val.acc:.2%}  val loss {val.loss:.4f}")
        for name, acc in report["per_class_acc"].items():
            print(f"  {name:>12}  {'no images' if acc is None else f'{acc:.2%}'}")
        write_json_atomic(out_dir / "eval.json", report)
        write_png_atomic(out_dir / "eval_confusion.png", confusion_picture(val.confusion, names))
        print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval_confusion.png'}")
    return report


# Pictures are drawn with PIL, which torchvision already needs: about 10 ms each, so they can be
# drawn at every evaluation (a matplotlib figure takes about 0.5 s, plus 0.7 s to import).

def image_grid(pixels: torch.Tensor, captions: list[str], columns: int = 8):
    """Images (N, C, H, W, values in [0, 1]) side by side, each with its caption underneath.

    Small images are enlarged (nearest neighbour, so pixels stay sharp) and large ones shrunk, to
    tiles of 64-160 px; one channel is shown as gray, other channel counts by their first.
    """
    import numpy as np
    from PIL import Image, ImageDraw

    pixels = pixels.float()
    side = max(pixels.shape[-2:])
    if side < 64:
        pixels = torch.nn.functional.interpolate(pixels, scale_factor=-(-64 // side), mode="nearest")
    elif side > 160:
        size = [round(d * 160 / side) for d in pixels.shape[-2:]]
        pixels = torch.nn.functional.interpolate(pixels, size=size, mode="bilinear", antialias=True)
    pixels = pixels[:, :3] if pixels.shape[1] == 3 else pixels[:, :1].expand(-1, 3, -1, -1)
    tiles = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    n, h, w = tiles.shape[:3]
    font, gap, text = _font(11), 4, 14
    columns = min(columns, n)
    rows = -(-n // columns)
    canvas = Image.new("RGB", (columns * (w + gap) + gap, rows * (h + text + gap) + gap), "white")
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        x, y = gap + (i % columns) * (w + gap), gap + (i // columns) * (h + text + gap)
        canvas.paste(Image.fromarray(tiles[i]), (x, y))
        draw.text((x, y + h + 1), _fitted(captions[i], w, font), fill="black", font=font)
    return np.asarray(canvas)


def confusion_picture(confusion: list[list[int]], names: list[str]):
    """Rows: true class; columns: predicted class; each row normalized to sum to 100%."""
    import numpy as np
    from PIL import Image, ImageDraw

    n = len(confusion)
    cell = max(4, min(32, 640 // n))
    font = _font(10 if cell >= 12 else max(cell - 1, 6))
    labels = [_fitted(name, 110, font) for name in names] if cell >= 8 else [""] * n
    margin = 8 + max([int(font.getlength(label)) for label in labels] + [0])
    head = 22
    width, height = margin + n * cell + 8, head + margin + n * cell + 8
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), "rows: true class, columns: predicted, % of each row", fill="black", font=_font(11))
    top = Image.new("RGB", (margin, n * cell), "white")  # column labels, drawn across, then turned
    top_draw = ImageDraw.Draw(top)
    for i, (row, label) in enumerate(zip(confusion, labels, strict=True)):
        y = head + margin + i * cell
        draw.text((margin - 4, y + cell / 2), label, fill="black", font=font, anchor="rm")
        top_draw.text((4, i * cell + cell / 2), label, fill="black", font=font, anchor="lm")
        total = sum(row)
        for j, count in enumerate(row):
            share = count / total if total else 0.0
            color = tuple(round(255 - share * (255 - c)) for c in (8, 48, 107))  # white to dark blue
            x = margin + j * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=color,
                           outline=(225, 225, 225) if cell >= 12 else None)
            if cell >= 24 and count:
                draw.text((x + cell / 2, y + cell / 2), str(round(100 * share)), font=font, anchor="mm",
                          fill="white" if share > 0.5 else "black")
    canvas.paste(top.rotate(90, expand=True), (margin, head))
    return np.asarray(canvas)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # a scalable font (Pillow >= 10.1 with FreeType)
    except TypeError:
        return ImageFont.load_default()


def _fitted(text: str, width: int, font) -> str:
    """`text`, shortened with '..' until it fits `width` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "..") > width:
        text = text[:-1]
    return text + ".."
