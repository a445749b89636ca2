"""What a run shows and leaves behind for people: TensorBoard, summary.json and eval.json, predictions.csv,
and the lines printed at start-up and at the end.

What is shown comes from the task (task.py: its metrics and its pictures); this module only writes it, on
rank 0, and turns a failed write into one line.
"""

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
from machinery import processes, trackers
from machinery.files import reporting_write_errors, write_bytes_atomic, write_json_atomic
from machinery.pictures import write_png_atomic

# ---------------------------------------------------------------- TensorBoard


class TensorBoard(contextlib.AbstractContextManager):
    """Rank 0's logs of a train.py run, as --log-to names them (with active False, on the other ranks, every
    call does nothing): TensorBoard's writer, metrics.csv, and W&B or MLflow (machinery/trackers.py), all
    fed from here, the same points at the same log points. A failed write, here or in the writer's thread,
    is one UserError line naming out_dir; on any error the files are closed quietly, keeping the curves
    so far (a diverged run's).

    Scalars are written at log points alone (`write`: the loss and the step's rate), so that a step does
    no host work for them; `flush` (before each save) puts all so far in the files. metrics.csv has one
    `step,tag,value,wall_time` row a point, for pandas or a spreadsheet; a resume drops its rows past the
    checkpoint (and the test pass's), as TensorBoard's purge drops its points."""

    def __init__(self, out_dir: Path, cfg: Config, resumed, lr: float, active: bool):
        """One run, one set of curves: a new run first moves an earlier run's event files and metrics.csv
        into a subfolder named after that run's start (`moved`), so the two do not draw over each other. A
        resumed run (`resumed`: checkpoints.Resumed) tells TensorBoard to drop what the interrupted process
        logged after its checkpoint (purge_step), which it logs again, and continues its trackers' runs."""
        self.out_dir, self.writer, self.moved, self.csv = out_dir, None, None, None
        self.active, self.trackers, names = active, {}, cfg.log_to.split(",")
        if not active:
            return
        trackers.check_installed([name for name in names if name in trackers.OPENERS])  # before any file
        kept = (resumed and resumed.state.get("trackers")) or {}
        # the trackers first: one that cannot start (such as a store two runs create at once) leaves no file
        self.trackers = trackers.open_all(names, out_dir, {**cfg.to_dict(), "lr": lr}, kept, cfg.log_model)
        try:
            self._open_files(names, resumed)
        except BaseException as err:
            self.__exit__(type(err), err, None)  # the trackers' runs are marked as stopped
            raise

    def _open_files(self, names: list[str], resumed) -> None:
        """An earlier run's logs moved aside (a new run), then TensorBoard's writer and metrics.csv."""
        out_dir, resumed_step = self.out_dir, resumed and resumed.state["step"]
        with self._errors():
            earlier = sorted(out_dir.glob("events.out.tfevents.*"))  # ...tfevents.<unix time>.<host>...
            if resumed is None and (earlier or (out_dir / METRICS_CSV).exists()):
                started = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_start(earlier, out_dir)))
                self.moved, n = out_dir / started, 1
                while self.moved.exists():
                    n += 1
                    self.moved = out_dir / f"{started}-{n}"
                self.moved.mkdir()
                for path in [*earlier, *out_dir.glob(METRICS_CSV)]:
                    path.rename(self.moved / path.name)
            if "tensorboard" in names:
                quiet_tensorboard_thread()
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resumed is None else resumed_step + 1
                self.writer = SummaryWriter(str(out_dir), purge_step=purge)
            if "csv" in names:
                self.csv = metrics_csv(out_dir / METRICS_CSV, resumed_step)

    def run_ids(self) -> dict[str, str]:
        """Each tracker's run id, which the checkpoint keeps: a resume continues the same runs."""
        return {name: tracker.run_id for name, tracker in self.trackers.items()}

    def _errors(self):
        return reporting_write_errors(self.out_dir, f"TensorBoard logs in {self.out_dir}")

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None:
            with contextlib.suppress(OSError):
                for file in (self.writer, self.csv):
                    if file:
                        file.close()
            for tracker in self.trackers.values():
                with contextlib.suppress(Exception):  # the run's own error is the line to say
                    tracker.stop()

    def write(self, *rows: tuple[str, int, float]) -> None:
        """Points (tag, step, value) to the writer, whose thread writes them, to metrics.csv and to the
        trackers."""
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
            for file in (self.writer, self.csv):
                if file:
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
        """The HPARAMS tab's row for this run, the trackers' summary and files, then flush and close. The
        row's metric columns are the run's own scalar curves (their last values): add_hparams() would write
        each again, as one-point charts in a subfolder, so its summaries go to this writer's file instead."""
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


METRICS_CSV = "metrics.csv"
METRICS_COLUMNS = ("step", "tag", "value", "wall_time")


def run_start(events: list[Path], out_dir: Path) -> float:
    """When the run that left these logs in out_dir started: the time in its first event file's name (the
    writer's start), or else the wall_time of metrics.csv's first row (its first log point), or else that
    file's time (a header only: written at the run's start)."""
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


def metrics_csv(path: Path, resumed_step: int | None):
    """metrics.csv to append to: a new run's starts with its header; a resumed run's keeps the rows up to
    its checkpoint's step, written again whole (the test pass's rows go too: the run's end logs them)."""
    kept = []
    if resumed_step is not None and path.is_file():
        with open(path, newline="", encoding="utf-8") as f:
            kept = [row for row in list(csv.reader(f))[1:] if len(row) == len(METRICS_COLUMNS)
                    and row[0].isdigit() and int(row[0]) <= resumed_step and not row[1].startswith("test/")]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([METRICS_COLUMNS, *kept])
    write_bytes_atomic(path, text.getvalue().encode())
    return open(path, "a", newline="", encoding="utf-8")  # the writer's file: closed with it


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


def announce(cfg: Config, task, info, moved: Path | None) -> None:
    """What this run's data is, said once at start-up, with what was checked and changed (`moved`: where
    an earlier run's TensorBoard logs went)."""
    test = "" if info.test_size is None else f" / {info.test_size} test"
    inputs = info.members or "x".join(map(str, info.input_shape))  # several: each one's shape and dtype
    processes.say(f"{cfg.dataset}: {info.train_size} train / {info.val_size} val{test}, inputs {inputs}, "
                  f"{len(info.names)} outputs, via {info.loader}")
    moved = moved and f"TensorBoard logs of an earlier run moved to {moved}"
    processes.say(*filter(None, [*info.notes, task.pictures_note(info.images), moved]))


def describe_run(cfg: Config, model, where: tuple, lr: float, total_steps: int) -> None:
    """The line that says what trains: the model, where (device, AMP dtype) and how."""
    (device, amp_dtype), world_size = where, processes.world_size()
    processes.say(f"{cfg.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) on {device}"
                  f"{f' x{world_size} processes' if world_size > 1 else ''}, amp {amp_dtype or 'off'}, "
                  f"{cfg.schedule} schedule, lr {lr:.4g}, {total_steps} optimizer steps")


def progress_bar(total: int, done: int, desc: str) -> tqdm:
    """An epoch's progress bar, in a terminal on rank 0 (not in a log file); the loop updates it at log
    points only."""
    shown = processes.rank() == 0 and sys.stdout.isatty()
    return tqdm(total=total, initial=done, leave=False, desc=desc, disable=not shown)


class Speed:
    """Examples a second of each epoch (all processes'), from its first batch to its evaluation; the
    steady figure leaves out the first epoch, which pays for warm-up and compilation."""

    def __init__(self):
        self.rates, self.first, self.began = [], 0, 0.0

    def start(self, batch: int) -> None:
        self.first, self.began = batch, time.perf_counter()

    def end(self, batches: int, batch_size: int, device, images: bool) -> str:
        """The epoch's figure as its line shows it; "" where it trained no batch (a resume at its end)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the epoch's time includes the work still queued
        examples = batch_size * (batches - self.first)
        if not examples:
            return ""
        self.rates.append(examples / max(time.perf_counter() - self.began, 1e-9))
        return f"  ({self.rates[-1]:,.0f} {'img' if images else 'examples'}/s)"

    def steady(self) -> float | None:  # None: this part of the run trained no batch (a resume at its end)
        steady = self.rates[1:] or self.rates
        return sum(steady) / len(steady) if steady else None


def log_evaluation(result, task, names: list[str], batches, step: int, tensorboard: TensorBoard,
                   split: str = "val") -> None:
    """An evaluation's metrics and pictures to TensorBoard, as `split`/<name>, at the step where its epoch
    ended (the test split's: the run's last step); None (no test split): nothing."""
    if result is None:
        return
    tensorboard.write(*[(f"{split}/{name}", step, result.metrics[name]) for name in task.METRICS])
    pictures = task.pictures(result, names, batches.to_pixels)
    tensorboard.images({f"{split}/{name}": picture for name, picture in pictures.items()}, step)


# ---------------------------------------------------------------- summary.json and eval.json

SECONDS_COVER = ("seconds: this process's training loop, evaluation and checkpoints included, start-up "
                 "not; total_seconds: the same over every part of the run")
RESUMED_COVER = ("this run was resumed: total_seconds adds each earlier part's time up to the checkpoint "
                 "the next part resumed from (time after a part's last save was lost)")


def run_summary(task, evaluations: tuple, progress, seconds: float, facts: dict) -> dict:
    """summary.json: the task's last val metrics (val_<name>), the best main metric and best.pt's test
    metrics (test_<name>, where the data has a test split: `evaluations` is (val, test or None)), then how
    the run went: `progress` (train.Progress) as it ended, this part's `seconds`, and `facts` (epochs,
    examples_per_second, lr, world_size, device, ranks_in_sync, the splits' sizes). A run ends after one
    evaluation or more."""
    val, test = evaluations
    metrics = {f"val_{name}": val.metrics[name] for name in task.METRICS}
    metrics |= {f"test_{name}": test.metrics[name] for name in task.METRICS} if test else {}
    cover = SECONDS_COVER if progress.part == 1 else f"{SECONDS_COVER}; {RESUMED_COVER}"
    facts = dict(facts)
    return {**metrics, f"best_val_{task.MAIN_METRIC}": progress.best, "epochs": facts.pop("epochs"),
            "epochs_run": progress.epoch, "stopped": progress.stopped,  # --early-stop: why it ended sooner
            "steps": progress.step, "seconds": seconds, "total_seconds": progress.seconds_before + seconds,
            "parts": progress.part, "run_id": progress.run_id, "seconds_cover": cover, **facts, **val.details}


def write_summary(summary: dict, cfg: Config, task, val, names: list[str], tensorboard: TensorBoard) -> None:
    """A run's last words, on rank 0: TensorBoard's HPARAMS row, the task's saved pictures (such as
    confusion.png), summary.json, and one line."""
    out_dir, main = Path(cfg.out_dir), task.MAIN_METRIC
    pictures = task.pictures(val, names, None)
    hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)}
    tested = f"test_{main}" in summary
    splits = ("val", "test") if tested else ("val",)
    curves = [f"{split}/{name}" for split in splits for name in task.METRICS]
    for name in task.SAVED_PICTURES:
        if pictures.get(name) is not None:
            write_png_atomic(out_dir / f"{name}.png", pictures[name])
    write_json_atomic(out_dir / "summary.json", summary)
    tensorboard.finish({**hparams, "lr": summary["lr"]}, curves, summary)  # summary.json to the trackers
    total, parts = summary["total_seconds"], summary["parts"]
    early = f", stopped early after epoch {summary['epochs_run']}" if summary["stopped"] else ""
    test = f", test {main} {task.show(main, summary[f'test_{main}'])} (best.pt)" if tested else ""
    print(f"done: val {main} {task.show(main, summary[f'val_{main}'])} (best "
          f"{task.show(main, summary[f'best_val_{main}'])}){test} in {summary['seconds']:.1f}s"
          f"{f' ({total:.1f}s over {parts} parts)' if parts > 1 else ''}{early}; logs and checkpoints in "
          f"{out_dir}")


def report_evaluation(task, val, report: dict, pictures: dict, out_dir: Path) -> None:
    """evaluate.py's report (its evaluate_checkpoint builds it): printed, and written as eval.json and
    eval_<picture>.png."""
    split = report["split"]
    try:
        said = task.describe(val, split)
    except TypeError:  # a task.py forked before describe() took the split: its words, with the split's name
        said = task.describe(val).replace("val ", f"{split} ")
    print(f"{report['checkpoint']} on the {report[f'{split}_size']} {report['dataset']} {split} examples: "
          f"{said}")
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
    write_bytes_atomic(path, text.getvalue().encode("utf-8", "surrogateescape"))  # names' bytes as on disk
    table = [[cell.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for cell in row]  # shown
             for row in table[:shown + 1]]
    columns = min(len(table[0]), 5)  # the file, and the task's first columns
    widths = [max(len(row[i]) for row in table[:shown + 1]) for i in range(columns)]
    for row in table[:shown + 1]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())
    more = f" (the first {shown} above)" if len(rows) > shown else ""
    count = f"{len(rows)} {'file' if len(rows) == 1 else 'files'}"
    print(f"{count} predicted -> {path}{more}" + (f"; {skipped}" if skipped else ""))


