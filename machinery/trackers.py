"""The optional experiment trackers of --log-to: W&B and MLflow, fed by logs.Logs the points,
pictures and summary TensorBoard gets, on rank 0. Each is imported only when named; its run id is kept in the
checkpoint, so a resume, `--resume auto` and a torchrun restart continue the same run, and points at or
below the step it last logged are not logged again (a resumed run logs its steps past the checkpoint anew).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from configs import UserError, first_line

PACKAGES = {"wandb": "wandb", "mlflow": "mlflow-skinny"}  # --log-to's trackers, and what pip installs
PROJECT = "torch-template"  # W&B's project, MLflow's experiment, unless WANDB_PROJECT says otherwise


@dataclass
class Tracker:
    """An opened tracker: what logs.Logs calls at its log points, its pictures and its end."""

    run_id: str
    scalars: Callable[[list[tuple[str, int, float]]], None]  # (tag, step, value) rows
    images: Callable[[dict, int], None]  # {tag: (H, W, 3) uint8 array}, step
    finish: Callable[[dict, list[Path]], None]  # the summary, files to keep with the run
    stop: Callable[[], None]  # the run stopped before its end (a signal, an error): a resume continues it


def check_installed(names: list[str]) -> None:
    """Each tracker named in --log-to can be imported: else one line, before the run writes anything."""
    for name in names:
        try:
            if name == "wandb":
                import wandb  # noqa: F401
            else:
                from mlflow.tracking import MlflowClient  # noqa: F401
        except ImportError:
            raise UserError(f"--log-to {name}: the {name} package is not installed; pip install "
                            f"{PACKAGES[name]}, or leave {name} out of --log-to") from None


def open_wandb(out_dir: Path, config: dict, run_id: str | None, log_model: bool) -> Tracker:
    """A W&B run named after the run folder, its files under it; WANDB_MODE=offline works (then `wandb
    sync`). Its banner and messages stay off stderr: the scripts' one line is theirs alone."""
    import wandb

    with contextlib.redirect_stderr(io.StringIO()):
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=out_dir.name,
                         dir=str(out_dir), id=run_id, resume="allow", config=config,
                         settings=wandb.Settings(silent=True, console="off"))
    last = [run.step - 1 if run_id else -1]  # W&B's steps only go up: a replayed one would be dropped

    def scalars(rows):
        for step in sorted({step for _, step, _ in rows if step > last[0]}):
            run.log({tag: value for tag, at, value in rows if at == step}, step=step)
            last[0] = step

    def images(pictures, step):
        if step >= last[0]:
            run.log({tag: wandb.Image(picture) for tag, picture in pictures.items()}, step=step)
            last[0] = step

    def finish(summary, files):
        run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str | bool)})
        if log_model and (best := out_dir / "best.pt").is_file():
            artifact = wandb.Artifact(f"{out_dir.name}-best", type="model")
            artifact.add_file(str(best))
            run.log_artifact(artifact)
        stop(0)

    def stop(code: int = 1):
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            run.finish(exit_code=code)

    return Tracker(run.id, scalars, images, finish, stop)


def open_mlflow(out_dir: Path, config: dict, run_id: str | None, log_model: bool) -> Tracker:
    """An MLflow run named after the run folder, in MLFLOW_TRACKING_URI or else a SQLite store beside the
    run folders (runs/x: runs/mlflow.db), so that `mlflow ui` compares them all. Tags become metric names
    MLflow takes: any character but letters, digits, _ - . / and space becomes _."""
    for name in ("mlflow", "alembic", "sqlalchemy"):  # "Creating initial MLflow database tables..."
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    beside = out_dir.absolute().parent  # the store and its artifacts beside the run folders, not in the cwd
    uri, store = os.environ.get("MLFLOW_TRACKING_URI"), (beside / "mlruns").as_uri()
    with one_at_a_time(beside):  # runs started at once: one creates the store's tables, the others wait
        client = MlflowClient(uri or f"sqlite:///{beside / 'mlflow.db'}")
        if run_id is None:
            experiment = client.get_experiment_by_name(PROJECT)
            found = experiment.experiment_id if experiment else client.create_experiment(
                PROJECT, artifact_location=None if uri else store)
            run_id = client.create_run(found, run_name=out_dir.name).info.run_id
            client.log_batch(run_id, params=[Param(k, str(v)[:500]) for k, v in config.items()])
        else:
            client.update_run(run_id, status="RUNNING")
    logged = client.get_run(run_id).data.metrics  # the tags it has, to find each one's last step
    last = {tag: max(m.step for m in client.get_metric_history(run_id, tag)) for tag in logged}

    def scalars(rows):
        now, metrics = int(time.time() * 1000), []
        for tag, step, value in rows:
            key = re.sub(r"[^\w\-./ ]", "_", tag)
            if step > last.get(key, -1):
                metrics.append(Metric(key, float(value), now, step))
                last[key] = step
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            client.log_batch(run_id, metrics=metrics[start:start + 1000])

    def images(pictures, step):
        for tag, picture in pictures.items():
            client.log_image(run_id, picture, key=re.sub(r"[^\w\-./ ]", "_", tag), step=step)

    def finish(summary, files):
        for path in files:
            client.log_artifact(run_id, str(path))
        if log_model and (best := out_dir / "best.pt").is_file():
            client.log_artifact(run_id, str(best))
        client.set_terminated(run_id)

    return Tracker(run_id, scalars, images, finish, lambda: client.set_terminated(run_id, "KILLED"))


def open_all(names: list[str], out_dir: Path, config: dict, resumed, log_model: bool) -> dict:
    """The trackers among `names`, each installed, and continuing its run in the checkpoint `resumed` or
    starting one. One that cannot start is one line, and the ones opened before it are stopped."""
    named = [name for name in names if name in OPENERS]
    check_installed(named)
    run_ids, opened = (resumed and resumed.state.get("trackers")) or {}, {}
    for name in named:
        try:
            opened[name] = OPENERS[name](out_dir, config, run_ids.get(name), log_model)
        except Exception as err:  # whatever the package raises: its message, in the line
            for tracker in opened.values():
                with contextlib.suppress(Exception):
                    tracker.stop()
            raise UserError(f"--log-to {name}: its run could not start ({first_line(err, 160)}); run the "
                            f"command again, or leave {name} out of --log-to") from None
    return opened


@contextlib.contextmanager
def one_at_a_time(folder: Path):
    """The block with an exclusive lock on `folder` itself (flock: no lock file, let go when the process
    ends however it ends). MLflow creates a new store's tables by migrations that two processes run at once
    break (alembic's "expected to match one row", "table ... already exists"). Where the system or the
    disk has no such lock (Windows, some network disks), the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # Windows
        fcntl = None
    if fcntl is None:
        yield
        return
    handle = os.open(folder, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # a disk without such locks
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # lets go of the lock


OPENERS = {"wandb": open_wandb, "mlflow": open_mlflow}  # --log-to's trackers beside tensorboard and csv
