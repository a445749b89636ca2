"""What a run shows and leaves for people: its logs (TensorBoard and metrics.csv; W&B and MLflow where
--log-to names them: trackers.py), the lines it prints, summary.json, and the pictures task.py draws with
image_grid and confusion_picture. What is shown comes from the task (its metrics and pictures); this module
writes it, on rank 0, and turns a failed write into one line."""

from __future__ import annotations

import contextlib
import csv
import io
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from configs import Config
from machinery.files import reporting_write_errors, write_bytes_atomic, write_json_atomic
from machinery.processes import rank, say

METRICS_CSV = "metrics.csv"
METRICS_COLUMNS = ("step", "tag", "value", "wall_time")


class Logs(contextlib.AbstractContextManager):
    """Rank 0's logs of a run in the sinks --log-to names, the same points at the same log points (`active`
    False, on the other ranks: nothing). A failed write is one line; on any error the files close quietly."""

    def __init__(self, out_dir: Path, cfg: Config, lr: float, *, resumed=None, active: bool = True):
        self.out_dir, self.active, self.trackers = out_dir, active, {}
        self.writer = self.csv = self.moved = None  # `moved`: where an earlier run's logs went
        names = cfg.log_to.split(",")
        if active and {"wandb", "mlflow"} & set(names):  # first: one that cannot start leaves no file
            from machinery import trackers

            config = {**cfg.to_dict(), "lr": lr}
            self.trackers = trackers.open_all(names, out_dir, config, resumed, cfg.log_model)
        try:
            if active:
                self._open_files(names, resumed)
        except BaseException as err:
            self.__exit__(type(err), err, None)  # the trackers' runs are marked as stopped
            raise

    def _open_files(self, names: list[str], resumed) -> None:
        """An earlier run's logs go aside (a new run); a resumed one's past its checkpoint are dropped."""
        step = resumed and resumed.state["step"]
        with self._errors():
            earlier = sorted(self.out_dir.glob("events.out.tfevents.*"))
            if resumed is None and (earlier or (self.out_dir / METRICS_CSV).exists()):
                self.moved = moved_aside(self.out_dir, earlier)
            if "tensorboard" in names:
                quiet_tensorboard_thread()
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resumed is None else step + 1  # what was logged after the checkpoint goes
                self.writer = SummaryWriter(str(self.out_dir), purge_step=purge)
            if "csv" in names:
                self.csv = metrics_csv(self.out_dir / METRICS_CSV, step)

    def run_ids(self) -> dict[str, str]:
        """Each tracker's run id, which the checkpoint keeps: a resume continues the same runs."""
        return {name: tracker.run_id for name, tracker in self.trackers.items()}

    def _errors(self):
        return reporting_write_errors(self.out_dir, f"TensorBoard logs in {self.out_dir}")

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None:  # the run's own error is the line to say: these close quietly
            with contextlib.suppress(OSError):
                for file in filter(None, (self.writer, self.csv)):
                    file.close()
            for tracker in self.trackers.values():
                with contextlib.suppress(Exception):
                    tracker.stop()

    def write(self, *rows: tuple[str, int, float]) -> None:
        """Points (tag, step, value): to the writer (whose thread writes them), metrics.csv and trackers."""
        if self.active:
            with self._errors():
                now = time.time()
                for tag, step, value in rows if self.writer else ():
                    self.writer.add_scalar(tag, value, step, walltime=now)
                if self.csv:
                    csv.writer(self.csv, lineterminator="\n").writerows(
                        (step, tag, float(value), round(now, 3)) for tag, step, value in rows)
                for tracker in self.trackers.values():
                    tracker.scalars(rows)

    def flush(self) -> None:
        """Everything so far into the files: before a save, so that the logs hold each step saved."""
        with self._errors():
            for file in filter(None, (self.writer, self.csv)):
                file.flush()

    def images(self, pictures: dict, step: int) -> None:
        """Pictures by tag, each an (H, W, 3) uint8 array; None is skipped."""
        shown = {tag: picture for tag, picture in pictures.items() if picture is not None}
        if self.active and shown:
            with self._errors():
                for tag, picture in shown.items() if self.writer else ():
                    self.writer.add_image(tag, picture, step, dataformats="HWC")
                for tracker in self.trackers.values():
                    tracker.images(shown, step)

    def finish(self, hparams: dict, metrics: list[str], summary: dict) -> None:
        """The HPARAMS row (of the run's own curves: add_hparams would write them again), the trackers'."""
        if not self.active:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        with self._errors():
            for tracker in self.trackers.values():
                tracker.finish(summary, [self.out_dir / "config.json", self.out_dir / "summary.json"])
            if self.csv:
                self.csv.close()
            if self.writer:
                for row in hparams_summaries(hparams, dict.fromkeys(metrics, 0.0)):
                    self.writer.file_writer.add_summary(row)
                self.writer.flush()  # raises what the writer thread met; close() would drop it
                self.writer.close()


def metrics_csv(path: Path, resumed_step: int | None):
    """metrics.csv to append to: a new run's header, or a resumed run's rows up to its checkpoint's step."""
    kept = [] if resumed_step is None else kept_rows(path, resumed_step)
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([METRICS_COLUMNS, *kept])
    write_bytes_atomic(path, text.getvalue().encode())
    return open(path, "a", newline="", encoding="utf-8")


def kept_rows(path: Path, resumed_step: int) -> list[list[str]]:
    """A resumed run's metrics.csv rows up to its checkpoint's step, as TensorBoard's purge keeps its points
    (the test pass's go too: the run's end logs them)."""
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[1:]
    return [row for row in rows if len(row) == len(METRICS_COLUMNS) and row[0].isdigit()
            and int(row[0]) <= resumed_step and not row[1].startswith("test/")]


def moved_aside(out_dir: Path, events: list[Path]) -> Path:
    """An earlier run's event files and metrics.csv, moved into a subfolder named after that run's start."""
    started = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_start(events, out_dir)))
    moved, n = out_dir / started, 1
    while moved.exists():
        n += 1
        moved = out_dir / f"{started}-{n}"
    moved.mkdir()
    for path in [*events, *out_dir.glob(METRICS_CSV)]:
        path.rename(moved / path.name)
    return moved


def run_start(events: list[Path], out_dir: Path) -> float:
    """When the run that left these logs started: the time in its first event file's name, or else the
    wall_time of metrics.csv's first row, or else that file's time (a header only)."""
    times = [int(p.name.split(".")[3]) for p in events if p.name.split(".")[3].isdigit()]
    metrics = out_dir / METRICS_CSV
    if metrics.is_file():
        with open(metrics, newline="", encoding="utf-8") as f:
            rows = csv.reader(f)
            next(rows, None)  # the header
            first = next(rows, None)
        try:
            times.append(float(first[METRICS_COLUMNS.index("wall_time")]))
        except (TypeError, IndexError, ValueError):
            times.append(metrics.stat().st_mtime)
    return min(times, default=time.time())


def quiet_tensorboard_thread() -> None:
    """The writer thread's OSError is raised again at the next write, as one line: no thread traceback too."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


# ---------------------------------------------------------------- what the loop shows


def announce(cfg: Config, task, info, moved: Path | None, trains: tuple) -> None:
    """What this run's data is, what was checked and changed, and what trains, said once at start-up."""
    test = "" if info.test_size is None else f" / {info.test_size} test"
    inputs = info.members or "x".join(map(str, info.input_shape))  # several: each one's shape and dtype
    say(f"{cfg.dataset}: {info.train_size} train / {info.val_size} val{test}, inputs {inputs}, "
        f"{len(info.names)} outputs, via {info.loader}")
    moved = moved and f"TensorBoard logs of an earlier run moved to {moved}"
    say(*filter(None, [*info.notes, task.pictures_note(info.images), moved]))
    model, process, amp_dtype, lr, total_steps, lr_note = trains
    processes = f" x{process.world_size} processes" if process.world_size > 1 else ""
    say(f"{cfg.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) on {process.device}"
        f"{processes}, amp {amp_dtype or 'off'}, {cfg.schedule} schedule, lr {lr:.4g}, {total_steps} "
        "optimizer steps", *filter(None, [lr_note]))


def progress_bar(total: int, done: int, desc: str) -> tqdm:
    """An epoch's progress bar, in a terminal on rank 0 (not in a log file), updated at log points."""
    shown = rank() == 0 and sys.stdout.isatty()
    return tqdm(total=total, initial=done, leave=False, desc=desc, disable=not shown)


class Speed:
    """Examples a second of each epoch (all processes'), from its first batch to its evaluation; the steady
    figure leaves out the first epoch, which pays for warm-up and compilation."""

    def __init__(self):
        self.rates, self.first, self.began = [], 0, 0.0

    def start(self, stream, batch: int):
        """An epoch's batches (`stream`), from batch `batch`: timed from now on; what the loop draws from."""
        self.first, self.began = batch, time.perf_counter()
        return stream

    def end(self, batches: int, batch_size: int, device, images: bool) -> str:
        """The epoch's figure as its line shows it; "" where it trained no batch (a resume at its end)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the epoch's time includes the work still queued
        examples = batch_size * (batches - self.first)
        if not examples:
            return ""
        self.rates.append(examples / max(time.perf_counter() - self.began, 1e-9))
        return f"  ({self.rates[-1]:,.0f} {'img' if images else 'examples'}/s)"

    def facts(self) -> dict:  # for summary.json; None: this part trained no batch (a resume at its end)
        steady = self.rates[1:] or self.rates
        return {"examples_per_second": sum(steady) / len(steady) if steady else None}


def log_evaluation(result, task, names: list[str], batches, step: int, logs: Logs, split: str = "val"):
    """An evaluation's metrics and pictures as `split`/<name>, at its epoch's last step (None: no split)."""
    if result is None:
        return
    logs.write(*[(f"{split}/{name}", step, result.metrics[name]) for name in task.METRICS])
    pictures = task.pictures(result, names, batches.to_pixels)
    logs.images({f"{split}/{name}": picture for name, picture in pictures.items()}, step)


# ---------------------------------------------------------------- summary.json

SECONDS_COVER = ("seconds: this process's training loop, evaluation and checkpoints included, start-up "
                 "not; total_seconds: the same over every part of the run")
RESUMED_COVER = ("this run was resumed: total_seconds adds each earlier part's time up to the checkpoint "
                 "the next part resumed from (time after a part's last save was lost)")


def run_summary(task, evaluations: tuple, progress, seconds: float, facts: dict) -> dict:
    """summary.json: the last val metrics, the best main metric, best.pt's test metrics (or none), how the
    run went (`progress`), this part's `seconds`, and `facts` (epochs, speed, lr, device, sizes...)."""
    val, test = evaluations
    metrics = {f"val_{name}": val.metrics[name] for name in task.METRICS}
    metrics |= {f"test_{name}": test.metrics[name] for name in task.METRICS} if test else {}
    cover = SECONDS_COVER if progress.part == 1 else f"{SECONDS_COVER}; {RESUMED_COVER}"
    facts = dict(facts)
    return {**metrics, f"best_val_{task.MAIN_METRIC}": progress.best, "epochs": facts.pop("epochs"),
            "epochs_run": progress.epoch, "stopped": progress.stopped,  # --early-stop: why it ended sooner
            "steps": progress.step, "seconds": seconds, "total_seconds": progress.seconds_before + seconds,
            "parts": progress.part, "run_id": progress.run_id, "seconds_cover": cover, **facts, **val.details}


def write_summary(summary: dict, cfg: Config, task, val, names: list[str], logs: Logs) -> None:
    """A run's last words: the HPARAMS row, the task's saved pictures, summary.json, and one line."""
    out_dir, main = Path(cfg.out_dir), task.MAIN_METRIC
    pictures = task.pictures(val, names, None)
    hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)}
    tested = f"test_{main}" in summary
    curves = [f"{split}/{name}" for split in ("val", "test")[:1 + tested] for name in task.METRICS]
    for name in task.SAVED_PICTURES:
        if pictures.get(name) is not None:
            write_png_atomic(out_dir / f"{name}.png", pictures[name])
    write_json_atomic(out_dir / "summary.json", summary)
    logs.finish({**hparams, "lr": summary["lr"]}, curves, summary)  # summary.json to the trackers
    total, parts = summary["total_seconds"], summary["parts"]
    early = f", stopped early after epoch {summary['epochs_run']}" if summary["stopped"] else ""
    test = f", test {main} {task.show(main, summary[f'test_{main}'])} (best.pt)" if tested else ""
    print(f"done: val {main} {task.show(main, summary[f'val_{main}'])} (best "
          f"{task.show(main, summary[f'best_val_{main}'])}){test} in {summary['seconds']:.1f}s"
          f"{f' ({total:.1f}s over {parts} parts)' if parts > 1 else ''}{early}; logs and checkpoints in "
          f"{out_dir}")


# ---------------------------------------------------------------- pictures
# (H, W, 3) uint8 arrays, drawn with PIL: about 10 ms each, so they can be drawn at every evaluation


def write_png_atomic(path: str | Path, picture) -> None:
    """A picture (H, W, 3 uint8 array) written whole or not at all, one line on failure."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    write_bytes_atomic(path, buffer.getvalue())


def image_grid(pixels: torch.Tensor, captions: list[str], columns: int = 8):
    """Images (N, C, H, W in [0, 1]) side by side, captioned, in tiles of 64-160 px (small ones enlarged by
    nearest neighbour: pixels stay sharp); one channel is gray, other counts are shown by their first."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

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
    font, gap, text = ImageFont.load_default(size=11), 4, 14
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
    from PIL import Image, ImageDraw, ImageFont

    n = len(confusion)
    cell = max(4, min(32, 640 // n))
    font = ImageFont.load_default(size=10 if cell >= 12 else max(cell - 1, 6))
    labels = [_fitted(name, 110, font) for name in names] if cell >= 8 else [""] * n
    margin = 8 + max([int(font.getlength(label)) for label in labels] + [0])
    head = 22
    canvas = Image.new("RGB", (margin + n * cell + 8, head + margin + n * cell + 8), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), "rows: true class, columns: predicted, % of each row", fill="black",
              font=ImageFont.load_default(size=11))
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


def _fitted(text: str, width: int, font) -> str:
    """`text`, shortened with '..' until it fits `width` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "..") > width:
        text = text[:-1]
    return text + ".."
