"""Nothing lost, round four (issue 41, 1-6): a run's result after its last save. A run whose last.pt holds
every step but whose summary.json was never written finishes on --resume (and --resume auto): the test pass
through best.pt and summary.json, with the numbers an uninterrupted run gives. A run resumed into another
folder reads its own best.pt there; a folder holding another run, or an emptied last.pt, is refused."""

import json
import os
import signal

import pytest
from conftest import fingerprint, run_main
from test_work_kept import TINY, one_line, unfinished

import train
from configs import parse_config

RESULT = ("val_loss", "val_acc", "test_loss", "test_acc", "best_val_acc", "steps", "epochs_run", "stopped")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """summary.json of a 2-epoch run that nothing stopped: what a finished resume must give."""
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    return train.train(parse_config([*TINY, "--epochs", "2", "--out-dir", str(out_dir)]))


def stop_in_evaluation(monkeypatch, call: int, stop) -> None:
    """train.evaluate's `call`-th pass (1, 2: the epochs' val passes; 3: the test pass) stopped by `stop`."""
    real, calls = train.evaluate, [0]

    def evaluate(*args):
        calls[0] += 1
        if calls[0] == call:
            stop()
        return real(*args)

    monkeypatch.setattr(train, "evaluate", evaluate)


def the_result(summary: dict) -> dict:
    return {key: summary[key] for key in RESULT}


def test_a_signal_in_the_last_val_pass_then_resume_finishes_the_run(uninterrupted, signals_end_the_run,
                                                                     tmp_path, monkeypatch, capsys):
    stop_in_evaluation(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--out-dir", tmp_path)
    assert code == 128 + signal.SIGTERM and "saved" in out and not (tmp_path / "summary.json").exists()
    monkeypatch.undo()
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    assert code == 0 and err == "" and "the test pass and summary.json next" in out, (code, out, err)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert the_result(summary) == the_result(uninterrupted)
    kept = fingerprint(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    assert code == 0 and "holds a complete run (2 epochs, step 8): nothing to do" in out
    assert fingerprint(tmp_path) == kept


def test_ctrl_c_in_the_test_pass_then_resume_auto_finishes_the_run(uninterrupted, tmp_path, monkeypatch,
                                                                   capsys):
    def ctrl_c():
        raise KeyboardInterrupt

    stop_in_evaluation(monkeypatch, 3, ctrl_c)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--out-dir", tmp_path)
    assert "continue with --resume" in one_line(code, err, 128 + signal.SIGINT)
    monkeypatch.undo()
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "2", "--resume", "auto", "--out-dir",
                              tmp_path)  # torchrun's restart command: the same line every time
    assert code == 0 and err == "", (code, out, err)
    assert the_result(json.loads((tmp_path / "summary.json").read_text())) == the_result(uninterrupted)


def test_a_resume_into_another_folder_tests_its_own_best_weights(tmp_path, monkeypatch, capsys):
    unfinished(tmp_path / "a", monkeypatch, 6)  # epoch 1 evaluated: a/best.pt
    real = train.Progress.evaluated
    monkeypatch.setattr(train.Progress, "evaluated", lambda *args: real(*args) and False)  # no better one
    code, out, err = run_main(monkeypatch, capsys, "--resume", tmp_path / "a" / "last.pt", "--out-dir",
                              tmp_path / "b")
    assert code == 0 and err == "", (code, out, err)
    assert (tmp_path / "b" / "best.pt").read_bytes() == (tmp_path / "a" / "best.pt").read_bytes()
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["steps"] == 12 and "test_acc" in summary


def test_a_resume_into_a_folder_holding_another_run_is_refused(tmp_path, monkeypatch, capsys):
    unfinished(tmp_path / "a", monkeypatch, 6)
    train.train(parse_config([*TINY, "--epochs", "1", "--out-dir", str(tmp_path / "b")]))
    kept = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir() if p.is_file()}
    code, out, err = run_main(monkeypatch, capsys, "--resume", tmp_path / "a" / "last.pt", "--out-dir",
                              tmp_path / "b")
    line = one_line(code, err)
    assert f"{tmp_path / 'b'} holds another run (last.pt, best.pt, summary.json)" in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir() if p.is_file()} == kept


def test_an_emptied_last_pt_is_not_overwritten_by_a_new_run(tmp_path, monkeypatch, capsys):
    unfinished(tmp_path, monkeypatch, 6)
    (tmp_path / "last.pt").write_bytes(b"")
    kept = fingerprint(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, *TINY, "--epochs", "3", "--out-dir", tmp_path)
    line = one_line(code, err)
    assert "last.pt cannot be read" in line and f"continue it (--resume {tmp_path / 'best.pt'})" in line
    assert fingerprint(tmp_path) == kept
    code, out, err = run_main(monkeypatch, capsys, "--resume", tmp_path / "best.pt", "--out-dir", tmp_path)
    assert code == 0 and json.loads((tmp_path / "summary.json").read_text())["steps"] == 12, (code, err)


def test_an_early_stopped_run_without_its_summary_finishes_without_training(tmp_path, monkeypatch, capsys):
    argv = [*TINY, "--epochs", "4", "--early-stop", "1", "--min-delta", "1", "--out-dir", str(tmp_path)]
    ended = train.train(parse_config(argv))  # no gain over 1: stopped after its second epoch
    assert ended["stopped"] and ended["steps"] == 8
    (tmp_path / "summary.json").unlink()  # as if the test pass was cut short
    code, out, err = run_main(monkeypatch, capsys, "--resume", "--out-dir", tmp_path)
    assert code == 0 and err == "" and "epoch 3/4" not in out, (code, out, err)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert the_result(summary) == the_result(ended) and summary["examples_per_second"] is None


def test_the_folder_is_held_and_the_loaders_open_until_summary_json_is_written(tmp_path, monkeypatch):
    """Issue 54, 11: the run folder's lock stays until summary.json is written (another run could claim the
    folder in between), and the val and test splits are served before their batches close: a split read by
    DataLoader workers started persistent workers that nothing stopped."""
    import multiprocessing

    from machinery import logs

    held, real = [], logs.write_summary

    def write_summary(summary, cfg, *args):
        held.append((tmp_path / ".lock").is_file())
        return real(summary, cfg, *args)

    monkeypatch.setattr(logs, "write_summary", write_summary)
    argv = [*TINY, "--loader", "dataloader", "--num-workers", "1", "--epochs", "1", "--out-dir",
            str(tmp_path)]
    summary = train.train(parse_config(argv))
    assert held == [True] and summary["test_acc"] is not None
    assert not (tmp_path / ".lock").exists() and multiprocessing.active_children() == []
