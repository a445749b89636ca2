"""--keep-best K: the checkpoints of the K best evaluations (best-step<N>.pt), ranked by the task's main
metric on val in best-k.json and in every checkpoint, kept through resumes and kills. train.py chooses it
once at setup (KeepingBest in place of Stops); a default run never imports this module.

One epoch end's save, by rank 0 alone, in this order: last.pt carrying the new ranking, best.pt, a copy of
last.pt as the evaluation's own file (where it ranks), the manifest, then the files that left the ranking.
A kill before last.pt: the resume evaluates again and saves the same. After it: the resume copies its
last.pt to the ranked file it lacks, deletes what last.pt says had left, and writes the manifest again.
Either way the run ends with the files and ranking of an uninterrupted run; a resume into another folder
copies the ranked files from its checkpoint's folder first. A resume never deletes the file it resumed
from, nor a file this run did not write.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

from configs import UserError
from machinery.checkpoints import load_checkpoint
from machinery.files import free_bytes, shown_size, write_atomic, write_json_atomic
from machinery.processes import say
from machinery.stops import SIGNALS, Stops
from machinery.turns import first_group

MANIFEST = "best-k.json"
PATTERN = "best-step*.pt"  # the kept files; best.pt is not one of them


def file_name(step: int) -> str:
    return f"best-step{step}.pt"


def ranked(entries: list[dict], keep: int, higher_is_better: bool) -> list[dict]:
    """The `keep` best of `entries` ({"step", "score", ...}), best first. A non-finite score never ranks; on a
    tie the earlier step comes first, so a later equal score never pushes an earlier checkpoint out."""
    finite = [entry for entry in entries if math.isfinite(entry["score"])]
    return sorted(finite, key=lambda e: (-e["score"] if higher_is_better else e["score"], e["step"]))[:keep]


class KeepingBest(Stops):
    """The loop's saves and stops (machinery/stops.py), whose epoch-end saves also keep the K best
    evaluations' checkpoints; every checkpoint carries the ranking ("kept")."""

    def __init__(self, out_dir: Path, progress, checkpoint, logs, process, *, keep: int, task, resumed):
        super().__init__(out_dir, progress, lambda: {**checkpoint(), "kept": self.kept.state_dict()}, logs,
                         process)
        self.kept = KeptBest(out_dir, keep, task, resumed)

    def __enter__(self) -> KeepingBest:
        """Rank 0 starts the ranking, before the signals are ours (nothing here needs a save); a refusal there
        stops every rank, so none goes on into the first collective alone."""
        self.process.on_rank0(lambda: self.kept.start(self.checkpoint()))
        return super().__enter__()

    def save(self, *, best: bool = False, val: dict | None = None) -> None:
        """Stops.save; an evaluation's `val` metrics are ranked first, so that last.pt carries the ranking."""
        entered = self.kept.evaluated(self.progress.step, val) if val else False
        super().save(best=best)
        if val and self.process.rank == 0:
            with SIGNALS.in_mode("hold"):
                self.kept.settle(self.progress.step, entered, self.progress.run_id)


class KeptBest:
    """The ranking, in the folder `out_dir`: every rank ranks, rank 0 alone writes and deletes."""

    def __init__(self, out_dir: Path, keep: int, task, resumed=None):
        self.out_dir, self.keep, self.resumed = out_dir, keep, resumed
        self.metric, self.higher = task.MAIN_METRIC, task.HIGHER_IS_BETTER
        saved = (resumed.state.get("kept") if resumed else None) or {}
        self.ranking: list[dict] = list(saved.get("ranking", []))  # {"file", "step", "score"}, best first
        self.left: list[str] = list(saved.get("left", []))  # pushed out by the last evaluation
        self.last: dict | None = saved.get("last")  # the last evaluation {"step", "score"}: its file's record

    def start(self, state: dict) -> None:
        """Rank 0, before the first save: a new run refuses another run's kept files and a disk without room
        for K + 1 more checkpoints; a resume finishes what its last.pt's save left undone, and one into
        another --out-dir brings the ranked files from its checkpoint's folder."""
        if self.resumed is None:
            refuse_others(self.out_dir)
            check_space(self.out_dir, state, self.keep)
            return
        at, run_id = self.resumed.state["step"], self.resumed.state.get("run", {}).get("run_id")
        there = self.resumed.path.parent
        for entry in [e for e in self.ranking if not (self.out_dir / e["file"]).is_file()]:
            source = there / entry["file"]
            if entry["step"] == at:  # killed between last.pt and its copy: last.pt is that checkpoint
                copy(self.resumed.path, self.out_dir / entry["file"])
            elif source.is_file() and written_by(source, run_id):  # resumed into another folder
                copy(source, self.out_dir / entry["file"])
            else:
                also = "" if there.resolve() == self.out_dir.resolve() else f" nor in {there}"
                say(f"--keep-best: {entry['file']} is no longer in {self.out_dir}{also}: dropped from the "
                    "ranking")
                self.ranking.remove(entry)
        self.remove_left()
        write_json_atomic(self.out_dir / MANIFEST, self.manifest(at))

    def evaluated(self, step: int, metrics: dict) -> bool:
        """An evaluation at `step`, ranked before the save builds its state; whether it entered the K best."""
        score = float(metrics[self.metric])
        self.last = {"step": step, "score": score}
        entry = {"file": file_name(step), **self.last}
        before = [e for e in self.ranking if e["step"] != step]  # a replayed evaluation replaces its own
        self.ranking = ranked([*before, entry], self.keep, self.higher)
        self.left = [e["file"] for e in before if e not in self.ranking]
        return entry in self.ranking

    def settle(self, step: int, entered: bool, run_id: str) -> None:
        """Rank 0, after last.pt is written: its copy as the evaluation's own file where it `entered`, the
        manifest, then the files that left the ranking; a file of this step from an attempt a kill cut short
        goes too where this evaluation did not enter."""
        own = self.out_dir / file_name(step)
        if entered:
            copy(self.out_dir / "last.pt", own)
        elif own.is_file() and written_by(own, run_id):
            self.left.append(own.name)
        write_json_atomic(self.out_dir / MANIFEST, self.manifest(step))
        self.remove_left()

    def remove_left(self) -> None:
        """The files that left the ranking, but the one the run resumed from."""
        for name in self.left:
            path = self.out_dir / name
            if self.resumed is not None and path.resolve() == self.resumed.path.resolve():
                say(f"--keep-best: {path} left the {self.keep} best and stays: the run resumed from it")
                continue
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def manifest(self, step: int) -> dict:
        """What best-k.json holds: the kept files, best first, each with its step and score."""
        return {"metric": self.metric, "higher_is_better": self.higher, "keep": self.keep, "step": step,
                "ranked": self.ranking}

    def state_dict(self) -> dict:
        return {"ranking": self.ranking, "left": self.left, "last": self.last, "metric": self.metric,
                "higher_is_better": self.higher, "keep": self.keep}


def copy(source: Path, target: Path) -> None:
    """`source`'s bytes into `target`, written whole or not at all."""
    with open(source, "rb") as read:
        write_atomic(target, lambda file: shutil.copyfileobj(read, file), lambda: source.stat().st_size)


def refuse_others(out_dir: Path) -> None:
    """A new run in a folder holding kept files: they are another run's, and never overwritten."""
    if found := sorted(path.name for path in out_dir.glob(PATTERN)):
        raise UserError(f"{out_dir} holds kept checkpoints of another run ({', '.join(found[:3])}): a new "
                        "--keep-best run would overwrite them; move them away or pick another --out-dir")


def check_space(out_dir: Path, state: dict, keep: int) -> None:
    """K + 1 checkpoints beside last.pt and best.pt (checkpoints.check_free_space counted those): the K kept
    and the one that enters before the one it pushes out goes. The optimizer's copies of the weights are
    counted as there, as check_free_space counts them, since SGD makes its momentum at the first step."""
    weights = sum(t.nbytes for t in state["model"].values())
    group = first_group(state["optimizer"])
    copies = 2 if "betas" in group else int(bool(group.get("momentum", 0)))
    size = weights * (1 + copies + (state.get("ema") is not None))
    needed, free = (keep + 1) * size, free_bytes(out_dir)
    if free is not None and free < needed:
        raise UserError(f"{out_dir} has {shown_size(free)} free and --keep-best {keep} needs "
                        f"{shown_size(needed)} more: {keep + 1} checkpoints of about {shown_size(size)} (the "
                        f"{keep} kept, and one entering); free some space, lower --keep-best or pick another "
                        "--out-dir")


def written_by(path: Path, run_id: str) -> bool:
    """Whether the checkpoint at `path` is the run `run_id`'s (unreadable: no, it is left alone)."""
    try:
        return load_checkpoint(path).get("run", {}).get("run_id") == run_id
    except UserError:
        return False


# ---------------------------------------------------------------- reading the kept files back (evaluate.py)


def read_ranking(folder: Path, check=None) -> tuple[list[dict], str | None]:
    """The kept files of `folder`, best first, each {"file", "step", "score", "state"} (its checkpoint;
    `check` sees every kept file first); and a note where best-k.json was missing or stale (a file it lists
    is gone or records another evaluation, or a kept file is newer than it): then the ranking is rebuilt
    from each file's own recorded metric and step."""
    states = {path.name: load_checkpoint(path) for path in sorted(folder.glob(PATTERN))}
    if not states:
        raise UserError(f"{folder} holds no kept checkpoints ({PATTERN}): train with --keep-best K first")
    own = {name: own_record(name, state) for name, state in states.items()}
    if check is not None:  # every kept file, ranked or not: one run's (averaging.check_one_run)
        check([{"file": name, "state": state} for name, state in states.items()])
    manifest = read_manifest(folder / MANIFEST)
    if manifest is not None and all(own.get(e.get("file")) == {k: e.get(k) for k in ("file", "step", "score")}
                                    for e in manifest["ranked"]) and all(
            e["step"] <= manifest["step"] for e in own.values()):
        return [{**e, "state": states[e["file"]]} for e in manifest["ranked"]], None
    kept = next(iter(states.values()))["kept"]
    rebuilt = ranked(list(own.values()), kept["keep"], kept["higher_is_better"])
    note = (f"{folder / MANIFEST} was {'stale' if manifest else 'missing'}: the ranking is rebuilt from each "
            "kept file's own recorded metric and step")
    return [{**e, "state": states[e["file"]]} for e in rebuilt], note


def own_record(name: str, state: dict) -> dict:
    """A kept file's own record of its evaluation, {"file", "step", "score"}, or one line."""
    last = (state.get("kept") or {}).get("last") if isinstance(state.get("kept"), dict) else None
    if not (isinstance(last, dict) and last.get("step") == state.get("step")):
        raise UserError(f"{name} records no evaluation of its own: not a --keep-best checkpoint of train.py; "
                        "move it away")
    return {"file": name, "step": last["step"], "score": last["score"]}


def read_manifest(path: Path) -> dict | None:
    """best-k.json as written, or None where it is missing or damaged."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    good = isinstance(manifest, dict) and isinstance(manifest.get("ranked"), list) and all(
        isinstance(e, dict) for e in manifest["ranked"]) and isinstance(manifest.get("step"), int)
    return manifest if good else None
