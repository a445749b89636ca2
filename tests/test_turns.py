"""Issue 54, item 9: two networks trained in turn (a GAN). A model whose turns() names its networks gets,
on each batch, one optimizer step per network in that order, each with its own optimizer and schedule,
its gradients from nothing; the checkpoint keeps every optimizer and schedule, and a resume continues bit
for bit. lr_find.py, torchrun and turns that miss or share parameters are refused in one line. The fork is
tests/forks/gan.py and gan_model.py; docs/own_code.md shows its model."""

import sys

import pytest
from conftest import ROOT, add_entries, crash_at_step, run_main
from forks import gan
from test_faults import assert_one_line_failure
from test_resume import assert_same_state, final_state

import lr_find
import models
import train
from configs import UserError, parse_config
from machinery import checkpoints
from machinery.turns import networks

RUN = ["--model", "gan", "--optimizer", "adamw", "--lr", "0.002", "--epochs", "2", "--device", "cpu",
       "--batch-size", "256", "--save-every", "3"]  # digits: 5 batches an epoch


@pytest.fixture
def gan_fork(monkeypatch):
    add_entries(monkeypatch, "gan_model")
    monkeypatch.setattr(train.train, "__defaults__", (None, gan))


def test_each_network_steps_in_turn_with_its_own_optimizer_and_schedule(tmp_path, gan_fork, monkeypatch):
    seen, real_forward = [], models.MODELS["gan"].forward

    def forward(self, images, turn=None):  # which turn, and whether its network starts without gradients
        if self.training:
            trained = self.discriminator if turn == "discriminator" else self.generator
            seen.append((turn, all(p.grad is None for p in trained.parameters())))
        return real_forward(self, images, turn)

    monkeypatch.setattr(models.MODELS["gan"], "forward", forward)
    summary = train.train(parse_config([*RUN, "--schedule", "cosine", "--out-dir", str(tmp_path)]), None, gan)
    assert summary["steps"] == 10
    assert seen == [("discriminator", True), ("generator", True)] * 10  # D then G on each batch, from nothing
    saved = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert saved["scheduler"] is None and list(saved["optimizer"]) == ["discriminator", "generator"]
    for name in ("discriminator", "generator"):
        state = saved["optimizer"][name]
        assert state["scheduler"]["last_epoch"] == 10  # its schedule stepped once a batch, after its step
        assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {10}
    assert saved["optimizer"]["generator"]["optimizer"]["state"].keys() == set(range(4))  # G's 4 tensors


def test_a_crash_then_resume_continues_both_networks_bit_for_bit(tmp_path, gan_fork, monkeypatch, capsys):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    train.train(parse_config([*RUN, "--out-dir", str(straight)]), None, gan)
    with crash_at_step(monkeypatch, 15):  # the 8th batch's discriminator step: saved at the 6th batch
        train.train(parse_config([*RUN, "--out-dir", str(broken)]), None, gan)
    assert checkpoints.load_checkpoint(broken / "last.pt")["step"] == 6
    code, out, err = run_main(monkeypatch, capsys, *RUN, "--out-dir", broken, "--resume")
    assert code == 0, err
    assert "resumed from" in out and "at step 6" in out
    assert_same_state(final_state(straight / "last.pt"), final_state(broken / "last.pt"))


def test_lr_find_refuses_networks_in_turn_in_one_line(tmp_path, gan_fork, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "task", gan)  # lr_find.py's main() imports task.py
    with pytest.raises(SystemExit) as stopped:
        lr_find.main([*RUN, "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    line = assert_one_line_failure(stopped.value.code, out, err)
    assert "gan trains networks in turn" in line and "docs/own_code.md" in line
    assert not (tmp_path / "lr_find.json").exists()


def test_turns_that_miss_or_share_parameters_or_run_under_torchrun_are_refused(gan_fork):
    model, cfg = models.MODELS["gan"](1, 10), parse_config([])
    assert list(networks(model, cfg, 1)) == ["discriminator", "generator"]
    with pytest.raises(UserError, match="runs in one process here: train it without torchrun"):
        networks(model, cfg, 2)
    with pytest.raises(UserError, match="which --compile default does not take: train it without --compile"):
        networks(model, parse_config(["--compile"]), 1)
    with pytest.raises(UserError, match="which --throughput does not take"):
        networks(model, parse_config(["--throughput"]), 1)
    model.turns = lambda: {"discriminator": model.discriminator}
    with pytest.raises(UserError, match=r"[\d,]+ trainable parameters are in none of them"):
        networks(model, cfg, 1)
    model.turns = lambda: {"d": model.discriminator, "both": model}
    with pytest.raises(UserError, match="d and both share parameters"):
        networks(model, cfg, 1)
    model.generator.requires_grad_(False)  # frozen: it need not take a turn
    model.turns = lambda: {"discriminator": model.discriminator}
    assert list(networks(model, cfg, 1)) == ["discriminator"]


def test_the_docs_show_the_forks_model():
    """docs/own_code.md's model block is tests/forks/gan_model.py's class, which the tests above train."""
    page = (ROOT / "docs" / "own_code.md").read_text()
    block = page.split("```python\nclass GAN(nn.Module):", 1)[1].split("```", 1)[0]
    fork = (ROOT / "tests" / "forks" / "gan_model.py").read_text()
    assert "def turns(self)" in block and "class GAN(nn.Module):" + block in fork
