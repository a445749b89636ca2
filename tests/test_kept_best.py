"""--keep-best K and evaluate.py --average: the K best checkpoints kept through resumes and kills, and their
average (machinery/kept_best.py, machinery/averaging.py)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import crash_at_step, run_evaluate

import train
from configs import UserError, parse_config
from machinery import averaging, kept_best
from machinery.checkpoints import load_checkpoint, weights_of

TINY = ["--dataset", "synthetic", "--synthetic-size", "64", "--num-classes", "2", "--image-size", "8",
        "--width", "4", "--batch-size", "16", "--device", "cpu", "--num-workers", "0", "--lr", "0.05",
        "--epochs", "4", "--keep-best", "2"]  # 4 steps an epoch, evaluations at steps 4, 8, 12, 16


def run(out_dir: Path, *argv: str) -> dict:
    return train.train(parse_config([*TINY, *argv, "--out-dir", str(out_dir)]))


def kept(out_dir: Path) -> tuple[list[str], list]:
    """The kept files on disk, and best-k.json's ranking."""
    ranking = json.loads((out_dir / "best-k.json").read_text())["ranked"]
    return sorted(p.name for p in out_dir.glob("best-step*.pt")), ranking


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """One uninterrupted run, the yardstick."""
    out = tmp_path_factory.mktemp("whole")
    run(out)
    return out


def test_the_ranking_never_takes_a_nan_and_keeps_the_earlier_on_a_tie():
    entries = [{"step": 4, "score": 0.5}, {"step": 8, "score": math.nan}, {"step": 12, "score": 0.9},
               {"step": 16, "score": 0.9}, {"step": 20, "score": math.inf}]
    assert [e["step"] for e in kept_best.ranked(entries, 2, True)] == [12, 16]
    assert [e["step"] for e in kept_best.ranked(entries, 3, False)] == [4, 12, 16]  # a loss: lower is better
    assert [e["step"] for e in kept_best.ranked(entries, 5, True)] == [12, 16, 4]  # short list: still no nan


def test_a_run_keeps_its_k_best_and_a_nan_evaluation_never_ranks(whole, tmp_path, monkeypatch):
    files, ranking = kept(whole)
    assert len(files) == 2 and sorted(e["file"] for e in ranking) == files
    scores = [e["score"] for e in ranking]
    assert scores == sorted(scores, reverse=True)
    for entry in ranking:  # each file records its own evaluation
        state = load_checkpoint(whole / entry["file"])
        assert state["step"] == entry["step"] and state["kept"]["last"]["score"] == entry["score"]
    real = train.evaluate

    def nan_at_first(*args, **kwargs):  # the first evaluation's main metric is nan; the loss is fine
        result = real(*args, **kwargs)
        if not (tmp_path / "nan" / "last.pt").exists():
            result.metrics["acc"] = math.nan
        return result

    monkeypatch.setattr(train, "evaluate", nan_at_first)
    run(tmp_path / "nan", "--epochs", "2", "--keep-best", "3")
    files, ranking = kept(tmp_path / "nan")
    assert [e["step"] for e in ranking] == [8] and files == ["best-step8.pt"]


def test_a_kill_at_any_save_then_a_resume_ends_as_an_uninterrupted_run(whole, tmp_path, monkeypatch):
    """Killed after each point of an epoch end's save (last.pt written, its copy, the manifest, the
    deletions), and mid-epoch: the resume ends with the same files and ranking as the run never killed."""
    files, ranking = kept(whole)
    real = kept_best.KeptBest.settle
    for where in ("before the copy", "before the deletions", "mid-epoch"):
        out = tmp_path / where.replace(" ", "-")
        if where == "mid-epoch":
            with crash_at_step(monkeypatch, 14):
                run(out, "--save-every", "2")
        else:
            def killed(self, step, entered, run_id, where=where):
                if step == 12 and where == "before the copy":
                    raise RuntimeError("the machine went away")
                if step == 12:
                    self.remove_left = lambda: (_ for _ in ()).throw(RuntimeError("the machine went away"))
                real(self, step, entered, run_id)

            monkeypatch.setattr(kept_best.KeptBest, "settle", killed)
            with pytest.raises(RuntimeError, match="went away"):
                run(out)
            monkeypatch.setattr(kept_best.KeptBest, "settle", real)
        run(out, "--resume")
        assert kept(out) == (files, ranking), where


def test_a_kill_9_of_the_process_then_a_resume_ends_as_an_uninterrupted_run(whole, tmp_path):
    """A real kill -9 (no `finally` runs: a .tmp file and the dead run's lock may stay), as soon as the
    second evaluation's kept file appears: during its save's manifest, its deletions or the steps after."""
    from conftest import LAUNCH
    from test_resume import kill_after_first_save

    out = tmp_path / "killed"
    kill_after_first_save([*LAUNCH, "train.py", *TINY, "--out-dir", str(out)], out / "best-step8.pt")
    run(out, "--resume")
    assert kept(out) == kept(whole)


def test_the_manifest_is_rebuilt_when_deleted_or_stale(whole, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    ranking = [{k: e[k] for k in ("file", "step", "score")} for e in kept_best.read_ranking(out)[0]]
    assert kept_best.read_ranking(out)[1] is None and ranking == kept(whole)[1]
    (out / "best-k.json").unlink()
    rebuilt, note = kept_best.read_ranking(out)
    assert "missing" in note and [{k: e[k] for k in ("file", "step", "score")} for e in rebuilt] == ranking
    stale = json.loads((whole / "best-k.json").read_text())
    stale["ranked"][0]["score"] = -1.0  # not the file's own record
    (out / "best-k.json").write_text(json.dumps(stale))
    rebuilt, note = kept_best.read_ranking(out)
    assert "stale" in note and [{k: e[k] for k in ("file", "step", "score")} for e in rebuilt] == ranking


def test_a_resume_never_deletes_the_file_it_resumed_from_nor_anothers(whole, tmp_path, capsys):
    """Resumed from the worst kept file, in a folder with another run's file: the better evaluations after
    it push it out of the ranking, and it stays on disk; the foreign file is never touched."""
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    for name in ("last.pt", "summary.json"):
        (out / name).unlink()
    worst = kept(whole)[1][-1]["file"]
    (out / "foreign.pt").write_bytes(b"another run's")
    run(out, "--resume", str(out / worst))
    assert (out / worst).is_file() and (out / "foreign.pt").read_bytes() == b"another run's"


def test_a_new_run_refuses_a_folder_with_another_runs_kept_files(whole, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(whole / kept(whole)[0][0], out)
    with pytest.raises(UserError, match="holds kept checkpoints of another run"):
        run(out)


def test_rank_other_than_0_writes_and_deletes_nothing(tmp_path, monkeypatch):
    """Under torchrun every rank ranks (the same scores), and rank 0 alone writes and deletes."""
    import task
    from machinery.stops import Stops

    class Rank1:
        rank = 1

    monkeypatch.setattr(Stops, "save", lambda self, best=False, val=None: None)  # last.pt: not this test's
    (tmp_path / "best-step4.pt").write_bytes(b"x")
    resumed = type("Resumed", (), {"path": tmp_path / "last.pt", "state": {"step": 4, "kept": {
        "ranking": [{"file": "best-step4.pt", "step": 4, "score": 0.1}], "left": [], "last": None}}})()
    progress = type("Progress", (), {"step": 8, "run_id": "r", "part": 1})()
    stops = kept_best.KeepingBest(tmp_path, progress, dict, None, Rank1(), keep=1, task=task, resumed=resumed)
    stops.save(best=True, val={"acc": 0.9})  # ranks first, pushing step 4 out
    assert [e["step"] for e in stops.kept.ranking] == [8] and stops.kept.left == ["best-step4.pt"]
    assert (tmp_path / "best-step4.pt").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "best-step4.pt"]


def test_the_average_is_a_float64_mean_with_batchnorm_recomputed(whole, tmp_path, monkeypatch, capsys):
    states = [load_checkpoint(whole / name) for name in kept(whole)[0]]
    mean = averaging.averaged_weights(states)
    for key, value in weights_of(states[0]).items():
        if value.is_floating_point():
            by_hand = sum(weights_of(s)[key].double() for s in states) / len(states)
            assert torch.equal(mean[key], by_hand.to(value.dtype)), key
    saved = tmp_path / "average.pt"
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", whole / "best.pt", "--average", saved)
    assert code == 0 and "the average of the 2 kept checkpoints" in out and "beside best.pt's" in out, err
    written = load_checkpoint(saved)["model"]
    stats = [k for k in written if k.endswith("running_mean")]
    assert stats and all(not torch.equal(written[k], mean[k]) for k in stats)  # measured again
    weights = [k for k in written if written[k].is_floating_point() and "running_" not in k]
    assert weights and all(torch.equal(written[k], mean[k]) for k in weights)  # the mean, as it was
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", saved)
    assert code == 0, err


def test_checkpoints_of_another_run_are_refused_in_one_line(whole, tmp_path, monkeypatch, capsys):
    other = tmp_path / "other"
    run(other, "--seed", "1", "--epochs", "1")
    out = tmp_path / "mixed"
    shutil.copytree(whole, out)
    (out / "best-k.json").unlink()
    shutil.copy(other / kept(other)[0][0], out / "best-step99.pt")
    code, _, err = run_evaluate(monkeypatch, capsys, "--checkpoint", out / "best.pt", "--average")
    assert code == 2 and err.count("\n") == 1 and "is of another run" in err, err


def test_the_start_goes_through_on_rank0_so_a_refusal_stops_every_rank(tmp_path):
    """Under torchrun rank 0's refusal (another run's kept files here) stops rank 1 too, before any
    collective: the start goes through process.on_rank0, which shares rank 0's failure."""
    import task

    class Rank1:
        rank, works = 1, []

        def on_rank0(self, work, *args):
            self.works.append(work)
            work(*args)  # rank 0's work, whose failure on_rank0 raises on every rank

    (tmp_path / "best-step4.pt").write_bytes(b"another run's")
    progress = type("Progress", (), {"step": 0, "run_id": "r", "part": 1})()
    stops = kept_best.KeepingBest(tmp_path, progress, dict, None, Rank1(), keep=1, task=task, resumed=None)
    with pytest.raises(UserError, match="holds kept checkpoints of another run"):
        stops.__enter__()
    assert Rank1.works


def test_a_resume_into_another_folder_ends_as_an_uninterrupted_run(whole, tmp_path, monkeypatch):
    """The ranked files come from the resumed checkpoint's folder; a folder with a stray kept file (another
    run's) is refused, never adopted then deleted."""
    first = tmp_path / "first"
    with crash_at_step(monkeypatch, 14):
        run(first, "--save-every", "2")
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "best-step99.pt").write_bytes(b"another run's")
    with pytest.raises(UserError, match=r"holds another run \(best-step99.pt\)"):
        run(stray, "--resume", str(first / "last.pt"))
    assert (stray / "best-step99.pt").read_bytes() == b"another run's"
    run(tmp_path / "second", "--resume", str(first / "last.pt"))
    assert kept(tmp_path / "second") == kept(whole)


def test_average_refuses_torchrun_and_measures_the_split_asked_for(whole, monkeypatch, capsys):
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", whole / "best.pt", "--average",
                                  "--split", "test")
    assert code == 0 and "kept checkpoints (steps" in out and "): test acc" in out, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = run_evaluate(monkeypatch, capsys, "--checkpoint", whole / "best.pt", "--average")
    assert code == 2 and err.count("\n") == 1 and "--average runs in one process" in err, err
