"""The README's pictures, from the project's own commands: `python -m bench.figures [--out-dir DIR]`.

Runs the README's quick start, `python lr_find.py` then `python train.py --lr auto` (digits, about
half a minute on a CPU), and writes into docs/: lr_find.png as lr_find.py drew it, training.png
(the run's curves, read back from its TensorBoard logs) and confusion.png as train.py drew it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
DOCS = ROOT / "docs"


def run(*command: str) -> None:
    print("$", " ".join(["python", *command]), flush=True)
    subprocess.run([sys.executable, *command], cwd=ROOT, check=True)


def scalars(log_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Each TensorBoard scalar of a run: its steps and values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)])
            for tag in events.Tags()["scalars"]}


def draw_training(curves: dict, path: Path) -> None:
    """Loss (train every --log-every steps, val every epoch) beside val accuracy and the lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(8, 2.8), dpi=90)
    loss_ax.plot(*curves["train/loss"], label="train loss")
    loss_ax.plot(*curves["val/loss"], "o-", label="val loss")
    loss_ax.set(xlabel="optimizer step", ylabel="loss", yscale="log", title="python train.py --lr auto")
    loss_ax.legend(frameon=False)
    acc_ax.plot(*curves["val/acc"], "o-", color="C2", label="val acc")
    acc_ax.set(xlabel="optimizer step", ylabel="val accuracy", ylim=(0, 1))
    lr_ax = acc_ax.twinx()
    lr_ax.plot(*curves["train/lr"], color="C7", linewidth=1, label="lr (onecycle)")
    lr_ax.set_ylabel("learning rate")
    acc_ax.legend(handles=[*acc_ax.get_lines(), *lr_ax.get_lines()], frameon=False, loc="lower center")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="runs/figures", help="where the two commands write their run")
    out_dir = ROOT / parser.parse_args(argv).out_dir  # an earlier run's logs there are moved aside
    run("lr_find.py", "--out-dir", str(out_dir))
    run("train.py", "--lr", "auto", "--out-dir", str(out_dir))
    DOCS.mkdir(exist_ok=True)
    shutil.copyfile(out_dir / "lr_find.png", DOCS / "lr_find.png")
    shutil.copyfile(out_dir / "confusion.png", DOCS / "confusion.png")
    draw_training(scalars(out_dir), DOCS / "training.png")
    for name in ("lr_find.png", "training.png", "confusion.png"):
        print(f"wrote {DOCS / name} ({(DOCS / name).stat().st_size / 1000:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
