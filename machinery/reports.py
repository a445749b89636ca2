"""What evaluate.py leaves: its report (printed, eval.json, the task's pictures) and --predict's
predictions.csv, each written whole."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from machinery.files import write_bytes_atomic, write_json_atomic
from machinery.logs import write_png_atomic


def report_evaluation(task, val, report: dict, pictures: dict, out_dir: Path) -> None:
    """evaluate.py's report (its evaluate_checkpoint builds it): printed, and written as eval.json and
    eval_<picture>.png."""
    split = report["split"]
    said = task.describe(val, split)
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
