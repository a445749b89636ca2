"""What train.py and lr_find.py both need around the loop: device, AMP, processes, checkpoints;
and train.py's evaluation tallies and TensorBoard pictures."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import shutil
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from configs import UserError


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
    if is_distributed():
        dist.destroy_process_group()


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


# ---------------------------------------------------------------- output files

FIXES = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
         errno.EROFS: "use a writable disk", errno.ENOTDIR: "move the file in the way"}

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


@contextlib.contextmanager
def reporting_write_errors(path: str | Path, label: str | None = None):
    """Turn an OSError inside the block (say, from a TensorBoard writer) into one UserError line."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err, label=label) from None


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


def log_hparams(writer, hparams: dict, metrics: tuple[str, ...]) -> None:
    """The HPARAMS tab's row for this run. Its metric columns are the run's own scalar curves
    (their last values), so no extra one-point charts appear in SCALARS as add_hparams() makes."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    for summary in hparams_summaries(hparams, dict.fromkeys(metrics, 0.0)):
        writer.file_writer.add_summary(summary)


def log_inputs(writer, pixels: torch.Tensor, targets: torch.Tensor, names: list[str], step: int) -> None:
    """A training batch as the model receives it (after crop, flip, resize), back in pixels."""
    captions = [names[t] for t in targets.tolist()]
    writer.add_image("inputs", image_grid(pixels.cpu(), captions), step, dataformats="HWC")


def log_evaluation(writer, evaluation: Evaluation, names: list[str], denormalize: Callable,
                   step: int) -> None:
    """The confusion matrix and the most confidently wrong images of a validation pass."""
    writer.add_image("val/confusion", confusion_picture(evaluation.confusion, names), step,
                     dataformats="HWC")
    if evaluation.worst is None:
        return
    confidence, inputs, targets, predicted = evaluation.worst
    pixels = denormalize(inputs).cpu()
    shown = [i for i, c in enumerate(confidence.tolist()) if c >= 0]  # -1 marks right answers
    if not shown:
        return
    captions = [f"{names[t]} as {names[p]} {c:.0%}" for c, t, p in zip(
        confidence[shown].tolist(), targets[shown].tolist(), predicted[shown].tolist(), strict=True)]
    writer.add_image("val/most_confidently_wrong", image_grid(pixels[shown], captions), step,
                     dataformats="HWC")


def write_png_atomic(path: str | Path, picture) -> None:
    """A picture (H, W, 3 uint8 array) written whole or not at all, one line on failure."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    data = buffer.getvalue()
    _write_atomic(Path(path), lambda file: file.write(data), lambda: len(data))


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
