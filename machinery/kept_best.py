"""--keep-best K: the checkpoints of the K best evaluations (best-step<N>.pt), ranked by the task's main
metric on val in best-k.json and in every checkpoint, kept through resumes and kills. train.py chooses it
once at setup; a default run never imports this module.

One epoch end's save, written by rank 0 alone in this order: the evaluation's own file (where it ranks),
last.pt carrying the new ranking, best.pt, the manifest, then the files that left the ranking. A kill before
last.pt leaves the old last.pt: the resume evaluates again and writes the same file. A kill after it: the
resume deletes what last.pt says had left, and writes the manifest again. Either way the run ends with the
files and ranking an uninterrupted run ends with. A resume never deletes the file it resumed from, nor a file
this run did not write.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from configs import UserError
from machinery.checkpoints import load_checkpoint
from machinery.files import write_json_atomic
from machinery.processes import say

MANIFEST = "best-k.json"
PATTERN = "best-step*.pt"  # the kept files; best.pt is not one of them


def file_name(step: int) -> str:
    return f"best-step{step}.pt"


def ranked(entries: list[dict], keep: int, higher_is_better: bool) -> list[dict]:
    """The `keep` best of `entries` ({"step", "score", ...}), best first. A non-finite score never ranks; on a
    tie the earlier step comes first, so a later equal score never pushes an earlier checkpoint out."""
    finite = [entry for entry in entries if math.isfinite(entry["score"])]
    return sorted(finite, key=lambda e: (-e["score"] if higher_is_better else e["score"], e["step"]))[:keep]


class KeptBest:
    """The ranking a run keeps: carried in each checkpoint (state_dict) and restored on resume like the
    optimizer's state. Every rank ranks; rank 0 alone (`process`) writes and deletes files."""

    def __init__(self, out_dir: Path, keep: int, task, process, resumed=None):
        self.out_dir, self.keep, self.process = out_dir, keep, process
        self.metric, self.higher = task.MAIN_METRIC, task.HIGHER_IS_BETTER
        self.ranking: list[dict] = []  # {"file", "step", "score"}, best first
        self.left: list[str] = []  # the files the last evaluation pushed out: deleted once last.pt says so
        self.last: dict | None = None  # the last evaluation {"step", "score"}: a kept file's own record
        self.resumed_from = resumed.path.resolve() if resumed else None  # never deleted
        if resumed is None:
            process.on_rank0(refuse_others, out_dir)

    def evaluated(self, step: int, metrics: dict) -> tuple[str, ...]:
        """An evaluation at `step`: ranked before the save builds its state (so last.pt carries the ranking);
        the files to write with it: its own where it ranks, else none."""
        score = float(metrics[self.metric])
        self.last = {"step": step, "score": score}
        entry = {"file": file_name(step), **self.last}
        before = [e for e in self.ranking if e["step"] != step]  # a replayed evaluation replaces its own
        self.ranking = ranked([*before, entry], self.keep, self.higher)
        self.left = [e["file"] for e in before if e not in self.ranking]
        return (entry["file"],) if entry in self.ranking else ()

    def settle(self, state: dict) -> None:
        """Rank 0, after last.pt is written: the manifest, then the files that left the ranking; a file of
        this step from an attempt a kill cut short goes too where this evaluation did not rank."""
        write_json_atomic(self.out_dir / MANIFEST, self.manifest(state["step"]))
        own = self.out_dir / file_name(state["step"])
        if own.is_file() and all(e["step"] != state["step"] for e in self.ranking) and written_by(
                own, state["run"]["run_id"]):
            self.left.append(own.name)
        self.remove_left()

    def remove_left(self) -> None:
        for name in self.left:
            path = self.out_dir / name
            if self.resumed_from is not None and path.resolve() == self.resumed_from:
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

    def load_state_dict(self, state: dict) -> None:
        """A resume: the ranking last.pt carries, less any file gone since; rank 0 deletes what had left and
        writes the manifest again (a failed write is said: the next save writes it)."""
        self.last, self.left = state["last"], list(state["left"])
        gone = [e for e in state["ranking"] if not (self.out_dir / e["file"]).is_file()]
        self.ranking = [e for e in state["ranking"] if e not in gone]
        if self.process.rank != 0:
            return
        if gone:
            say(f"--keep-best: {', '.join(e['file'] for e in gone)} no longer in {self.out_dir}: dropped")
        self.remove_left()
        try:
            write_json_atomic(self.out_dir / MANIFEST, self.manifest(self.last["step"] if self.last else 0))
        except UserError as err:
            say(f"--keep-best: {err}; the next save writes {MANIFEST}")


def refuse_others(out_dir: Path) -> None:
    """A new run in a folder holding kept files: they are another run's, and never overwritten."""
    if found := sorted(path.name for path in out_dir.glob(PATTERN)):
        raise UserError(f"{out_dir} holds kept checkpoints of another run ({', '.join(found[:3])}): a new "
                        "--keep-best run would overwrite them; move them away or pick another --out-dir")


def written_by(path: Path, run_id: str) -> bool:
    """Whether the checkpoint at `path` is the run `run_id`'s (unreadable: no, it is left alone)."""
    try:
        return load_checkpoint(path).get("run", {}).get("run_id") == run_id
    except UserError:
        return False


# ---------------------------------------------------------------- reading the kept files back (evaluate.py)


def read_ranking(folder: Path) -> tuple[list[dict], str | None]:
    """The kept files of `folder`, best first, each {"file", "step", "score", "state"} (its checkpoint); and a
    note where best-k.json was missing or stale (a file it lists is gone or records another evaluation, or a
    kept file is newer than it): then the ranking is rebuilt from each file's own recorded metric and step."""
    states = {path.name: load_checkpoint(path) for path in sorted(folder.glob(PATTERN))}
    if not states:
        raise UserError(f"{folder} holds no kept checkpoints ({PATTERN}): train with --keep-best K first")
    own = {name: own_record(name, state) for name, state in states.items()}
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
