"""What a run shows and leaves behind for people: TensorBoard, summary.json and eval.json, and the
pictures in both (drawn with PIL, about 10 ms each, so they can be drawn at every evaluation).

What is shown comes from the task (task.py: its metrics and its pictures); this module only
writes it, on rank 0, and turns a failed write into one line.
"""

from __future__ import annotations

import contextlib
import csv
import io
import threading
import time
import uuid
from pathlib import Path

import torch

from checkpoints import reporting_write_errors, write_bytes_atomic, write_json_atomic
from configs import Config

# ---------------------------------------------------------------- TensorBoard


class TensorBoard(contextlib.AbstractContextManager):
    """Rank 0's TensorBoard writer for a train.py run (with active False, on the other ranks, every
    call does nothing). A failed write, here or in the writer's thread, is one UserError line naming
    out_dir; on any error the writer is closed quietly, keeping the curves so far (a diverged run's).

    Scalars are kept on the host (`point`) and written at once (`write`: log points and saves), in this
    thread, appended to the writer's own event file: TensorBoard's add_scalar hands each point to its
    writer thread, ~5x the CPU a point (docs/speed.md). Pictures go through the writer."""

    def __init__(self, out_dir: Path, resumed_step: int | None, active: bool):
        """One run, one set of curves: a new run first moves an earlier run's event files into a subfolder
        named after that run's start (`moved`), so the two do not draw over each other. A resumed run tells
        TensorBoard to drop what the interrupted process logged after its checkpoint (purge_step), which it
        logs again."""
        self.out_dir, self.writer, self.moved, self.points = out_dir, None, None, []
        if not active:
            return
        quiet_tensorboard_thread()
        from torch.utils.tensorboard import SummaryWriter

        with self._errors():
            earlier = sorted(out_dir.glob("events.out.tfevents.*"))  # ...tfevents.<unix time>.<host>...
            if resumed_step is None and earlier:
                stamps = [int(p.name.split(".")[3]) for p in earlier if p.name.split(".")[3].isdigit()]
                started = time.strftime("%Y%m%d-%H%M%S", time.localtime(min(stamps, default=time.time())))
                self.moved, n = out_dir / started, 1
                while self.moved.exists():
                    n += 1
                    self.moved = out_dir / f"{started}-{n}"
                self.moved.mkdir()
                for path in earlier:
                    path.rename(self.moved / path.name)
            suffix = f".{uuid.uuid4().hex[:8]}"  # names this writer's event file among the run's
            purge = None if resumed_step is None else resumed_step + 1
            self.writer = SummaryWriter(str(out_dir), purge_step=purge, filename_suffix=suffix)
            self.event_file = next(out_dir.glob(f"events.out.tfevents.*{suffix}"))

    def _errors(self):
        return reporting_write_errors(self.out_dir, f"TensorBoard logs in {self.out_dir}")

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None and self.writer:
            with contextlib.suppress(OSError):
                self.writer.close()

    def point(self, tag: str, step: int, value: float) -> None:
        """A scalar, kept until the next write()."""
        if self.writer:
            self.points.append((tag, step, value))

    def write(self) -> None:
        """The points kept so far, framed in memory and appended to the event file in one write, once
        the writer has written what it was given before (its thread then waits for more)."""
        if not (self.writer and self.points):
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        buffer, now = io.BytesIO(), time.time()
        with self._errors():
            framed = RecordWriter(buffer)
            for tag, step, value in self.points:
                point = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
                framed.write(Event(wall_time=now, step=step, summary=point).SerializeToString())
            self.writer.flush()
            with open(self.event_file, "ab") as f:
                f.write(buffer.getvalue())
        self.points = []

    def images(self, pictures: dict, step: int) -> None:
        """Pictures by tag, each an (H, W, 3) uint8 array; None is skipped."""
        if self.writer:
            with self._errors():
                for tag, picture in pictures.items():
                    if picture is not None:
                        self.writer.add_image(tag, picture, step, dataformats="HWC")

    def finish(self, hparams: dict, metrics: list[str]) -> None:
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


def quiet_tensorboard_thread() -> None:
    """Keep Python from printing a traceback when TensorBoard's writer thread dies of an OSError: that
    thread keeps its error and raises it again at the next write or flush, in the main thread, where
    reporting_write_errors makes it one line. Other threads report as before."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


# ---------------------------------------------------------------- what the loop shows


def announce(cfg: Config, task, info, moved: Path | None, say) -> None:
    """What this run's data is, said once at start-up, with what was checked and changed (`moved`: where
    an earlier run's TensorBoard logs went)."""
    test = "" if info.test_size is None else f" / {info.test_size} test"
    say(f"{cfg.dataset}: {info.train_size} train / {info.val_size} val{test}, inputs "
        f"{'x'.join(map(str, info.input_shape))}, {len(info.names)} outputs, via {info.loader}")
    moved = moved and f"TensorBoard logs of an earlier run moved to {moved}"
    for note in filter(None, [*info.notes, task.pictures_note(info.images), moved]):
        say(note)


def log_evaluation(result, task, names: list[str], to_pixels, step: int, tensorboard: TensorBoard, *,
                   split: str = "val") -> None:
    """An evaluation's metrics and pictures to TensorBoard, as `split`/<name>, at the step where its epoch
    ended (the test split's: the run's last step)."""
    for name in task.METRICS:
        tensorboard.point(f"{split}/{name}", step, result.metrics[name])
    tensorboard.write()
    pictures = task.pictures(result, names, to_pixels)
    tensorboard.images({f"{split}/{name}": picture for name, picture in pictures.items()}, step)


# ---------------------------------------------------------------- summary.json and eval.json

SECONDS_COVER = ("seconds: this process's training loop, evaluation and checkpoints included, start-up "
                 "not; total_seconds: the same over every part of the run")
RESUMED_COVER = ("this run was resumed: total_seconds adds each earlier part's time up to the checkpoint "
                 "the next part resumed from (time after a part's last save was lost)")


def run_summary(task, val, progress, seconds: float, facts: dict, *, test=None) -> dict:
    """summary.json: the task's last val metrics (val_<name>), the best main metric and best.pt's test
    metrics (test_<name>, where the data has a test split), then how the run went: `progress`
    (train.Progress) as it ended, this part's `seconds`, and `facts` (epochs, examples_per_second, lr,
    world_size, device, ranks_in_sync, the splits' sizes). A run ends after one evaluation or more."""
    metrics = {f"val_{name}": val.metrics[name] for name in task.METRICS}
    metrics |= {f"test_{name}": test.metrics[name] for name in task.METRICS} if test else {}
    cover = SECONDS_COVER if progress.part == 1 else f"{SECONDS_COVER}; {RESUMED_COVER}"
    facts = dict(facts)
    return {**metrics, f"best_val_{task.MAIN_METRIC}": progress.best, "epochs": facts.pop("epochs"),
            "epochs_run": progress.epoch, "stopped": progress.stopped,  # --early-stop: why it ended sooner
            "steps": progress.step, "seconds": seconds, "total_seconds": progress.seconds_before + seconds,
            "parts": progress.part, "seconds_cover": cover, **facts, **val.details}


def write_summary(summary: dict, cfg: Config, task, val, names: list[str], tensorboard: TensorBoard) -> None:
    """A run's last words, on rank 0: TensorBoard's HPARAMS row, the task's saved pictures (such as
    confusion.png), summary.json, and one line."""
    out_dir, main = Path(cfg.out_dir), task.MAIN_METRIC
    pictures = task.pictures(val, names, None)
    hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)}
    tested = f"test_{main}" in summary
    splits = ("val", "test") if tested else ("val",)
    curves = [f"{split}/{name}" for split in splits for name in task.METRICS]
    tensorboard.finish({**hparams, "lr": summary["lr"]}, curves)
    for name in task.SAVED_PICTURES:
        if pictures.get(name) is not None:
            write_png_atomic(out_dir / f"{name}.png", pictures[name])
    write_json_atomic(out_dir / "summary.json", summary)
    total, parts = summary["total_seconds"], summary["parts"]
    early = f", stopped early after epoch {summary['epochs_run']}" if summary["stopped"] else ""
    test = f", test {main} {task.show(main, summary[f'test_{main}'])} (best.pt)" if tested else ""
    print(f"done: val {main} {task.show(main, summary[f'val_{main}'])} (best "
          f"{task.show(main, summary[f'best_val_{main}'])}){test} in {summary['seconds']:.1f}s"
          f"{f' ({total:.1f}s over {parts} parts)' if parts > 1 else ''}{early}; logs and checkpoints in "
          f"{out_dir}")


def report_evaluation(task, val, report: dict, pictures: dict, out_dir: Path) -> None:
    """--evaluate's report (train.evaluate_checkpoint builds it): printed, and written as eval.json and
    eval_<picture>.png."""
    split = report["split"]
    print(f"{report['checkpoint']} on the {report[f'{split}_size']} {report['dataset']} {split} examples: "
          f"{task.describe(val)}")
    for line in task.report(val):
        print(f"  {line}")
    write_json_atomic(out_dir / "eval.json", report)
    wrote = [out_dir / "eval.json"]
    for name in task.SAVED_PICTURES:
        if pictures.get(name) is not None:
            write_png_atomic(out_dir / f"eval_{name}.png", pictures[name])
            wrote.append(out_dir / f"eval_{name}.png")
    print(f"wrote {' and '.join(map(str, wrote))}")


def write_predictions(path: Path, header: list[str], rows: list[list], files: list[Path], skipped: str,
                      tta: str, shown: int = 5) -> None:
    """--predict's predictions.csv, written whole: a `file` column, the task's columns, and under --tta
    flip a `tta` column saying so; then its first rows as a table, and the count."""
    extra = [tta] if tta != "none" else []
    table = [["file", *header, *(["tta"] if extra else [])]] + [
        [str(file), *(f"{v:.6g}" if isinstance(v, float) else str(v) for v in row), *extra]
        for file, row in zip(files, rows, strict=True)]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(table)
    write_bytes_atomic(path, text.getvalue().encode())
    columns = min(len(table[0]), 5)  # the file, and the task's first columns
    widths = [max(len(row[i]) for row in table[:shown + 1]) for i in range(columns)]
    for row in table[:shown + 1]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())
    more = f" (the first {shown} above)" if len(rows) > shown else ""
    count = f"{len(rows)} {'file' if len(rows) == 1 else 'files'}"
    print(f"{count} predicted -> {path}{more}" + (f"; {skipped}" if skipped else ""))


# ---------------------------------------------------------------- pictures


def write_png_atomic(path: str | Path, picture) -> None:
    """A picture (H, W, 3 uint8 array) written whole or not at all, one line on failure."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    write_bytes_atomic(path, buffer.getvalue())


def image_grid(pixels: torch.Tensor, captions: list[str], columns: int = 8):
    """Images (N, C, H, W, values in [0, 1]) side by side, each with its caption underneath. Small images
    are enlarged (nearest neighbour, so pixels stay sharp) and large ones shrunk, to tiles of 64-160 px;
    one channel is shown as gray, other channel counts by their first."""
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
