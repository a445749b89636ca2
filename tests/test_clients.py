"""lr_find.py and schedules.py dropped into other people's loops (issue 23), with the stand-ins of
tests/clients.py: Hugging Face-style models and batches, (x, y, extra) batches, accelerate's wrapped
optimizer, DataLoaders with persistent workers or their own generator, param groups at a 10x ratio,
a GradScaler that skips every step, and a loop that steps its schedule twice. Each client needs at
most one line of glue (the `batch_loss=` or `max_lr=` argument), and what a sweep touched comes
back bit for bit, the next epochs' batches included."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from clients import (
    AcceleratedOptimizer,
    BatchEncoding,
    NoisyImages,
    TokenClassifier,
    TwoInputNet,
    token_batches,
    triple_batches,
)
from test_lr_find import assert_restored, snapshot
from torch import nn

import lr_find as lf
from schedules import build_scheduler, optimizer_step

F = nn.functional


def hf_loss(model, batch):
    return model(**batch).loss


# --- any batch, one line of glue ------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [dict, BatchEncoding])
def test_a_model_taking_its_batch_as_keywords_needs_one_line(encoding):
    torch.manual_seed(0)
    model = TokenClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = token_batches(encoding=encoding)
    with torch.no_grad():
        first = float(model(**batches[0]).loss)
    before = snapshot(model, optimizer)
    found = lf.lr_find(model, optimizer, None, batches, batch_loss=lambda model, batch: model(**batch).loss,
                       device="cpu", num_iter=20, start_lr=1e-4)
    assert found.losses[0] == first and found.suggestion is not None
    assert found.optimizer_kind == "adaptive"
    if encoding is BatchEncoding:  # moved by its own .to, each time it was drawn
        assert all(b.moved_to and set(b.moved_to) == {torch.device("cpu")} for b in batches)
    assert_restored(before, model, optimizer)


def test_a_batch_encoding_moves_itself_and_other_batches_move_whole():
    batch = BatchEncoding({"input_ids": torch.ones(2, 3), "note": "keep"})
    moved = lf._to_device(batch, torch.device("meta"))
    assert moved is batch and batch.moved_to == [torch.device("meta")]
    assert batch["input_ids"].is_meta and batch["note"] == "keep"
    from collections import OrderedDict, defaultdict, namedtuple

    Pair = namedtuple("Pair", "inputs targets")
    batch = OrderedDict(a=Pair(torch.ones(1), [torch.ones(1)]), b=defaultdict(int, c=torch.ones(1)))
    nested = lf._to_device(batch, torch.device("meta"))
    assert type(nested) is dict and type(nested["a"]) is Pair and nested["a"].inputs.is_meta
    assert nested["a"].targets[0].is_meta and list(nested["b"]) == ["c"] and nested["b"]["c"].is_meta


def test_batches_with_an_extra_input_need_one_line():
    torch.manual_seed(0)
    model, batches = TwoInputNet(), triple_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        x, y, extra = batches[0]
        first = float(F.cross_entropy(model(x, extra), y))
    before = snapshot(model, optimizer)
    found = lf.lr_find(model, optimizer, None, batches, num_iter=20, start_lr=1e-3,
                       batch_loss=lambda model, b: F.cross_entropy(model(b[0], b[2]), b[1]))
    assert found.losses[0] == first and found.suggestion is not None and found.optimizer_kind == "sgd"
    assert_restored(before, model, optimizer)


@pytest.mark.parametrize(("batches", "what"), [
    (token_batches(1), "dict with keys ['input_ids', 'attention_mask', 'labels']"),
    (triple_batches(1), "tuple of 3"),
    ([torch.ones(2, 6)], "Tensor"),
])
def test_a_batch_the_default_cannot_unpack_is_an_error_that_names_the_hook(batches, what):
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError) as info:
        lf.lr_find(model, optimizer, F.cross_entropy, batches)
    assert str(info.value) == (
        f"lr_find: loss_fn(model(inputs), targets) needs (inputs, targets) batches, got a {what}; pass "
        "loss_fn=None and batch_loss=, a function (model, batch) -> loss, such as lambda model, batch: "
        "model(**batch).loss")
    assert_restored(before, model, optimizer)


@pytest.mark.parametrize("both", [False, True])
def test_one_of_loss_fn_and_batch_loss(both):
    model = nn.Linear(6, 3)
    with pytest.raises(ValueError, match="^pass loss_fn.outputs, targets. or batch_loss.model, b.$"):
        lf.lr_find(model, torch.optim.SGD(model.parameters()), F.cross_entropy if both else None,
                   triple_batches(1), batch_loss=hf_loss if both else None)


# --- the DataLoader comes back as it was ----------------------------------------------------------


def small_convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))


def train_epochs(loader_kwargs: dict, sweep: bool, epochs_before: int = 0, keep_loader=None) -> tuple:
    """Build model and loader from seed 0, train `epochs_before` epochs, sweep (or not), train 2 more:
    the inputs of each of those 2 epochs in the order served, and the final weights."""
    torch.manual_seed(0)
    model = small_convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(NoisyImages(), batch_size=8, **loader_kwargs)
    seen = []
    for epoch in range(epochs_before + 2):
        if epoch == epochs_before and sweep:
            lf.lr_find(model, optimizer, F.cross_entropy, loader, num_iter=12, end_lr=1.0)
        inputs = []
        for x, y in loader:
            inputs.append(x)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        seen.append(torch.cat(inputs))
    return seen[epochs_before:], model.state_dict()


def assert_same_run(a: tuple, b: tuple) -> None:
    (seen_a, weights_a), (seen_b, weights_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(seen_a, seen_b, strict=True)), "the batches differ"
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_b)


PERSISTENT = {"shuffle": True, "num_workers": 1, "persistent_workers": True}


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
@pytest.mark.parametrize("epochs_before", [0, 1], ids=["before-training", "between-epochs"])
def test_persistent_workers_serve_the_next_epochs_as_without_a_sweep(epochs_before):
    """mnist/main.py's loader on an accelerator: one persistent worker, shuffled, augmenting."""
    swept, plain = (train_epochs(PERSISTENT, sweep, epochs_before) for sweep in (True, False))
    assert_same_run(swept, plain)


def test_a_failed_sweep_leaves_the_loaders_own_workers_running():
    """Mid-training, the loader already has its workers: the sweep (here with the same loader for
    validation) runs its own, stops them, and puts the loader's back, even when it fails."""
    model = small_convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(NoisyImages(), batch_size=8, **PERSISTENT)
    for _ in loader:
        pass
    own, calls = loader._iterator, []

    def loss_fn(out, y):
        calls.append(1)
        if len(calls) == 8:
            raise RuntimeError("a fault in the sweep")
        return F.cross_entropy(out, y)

    with pytest.raises(RuntimeError, match="a fault in the sweep"):
        lf.lr_find(model, optimizer, loss_fn, loader, val_loader=loader, num_iter=10)
    assert loader._iterator is own and all(w.is_alive() for w in own._workers)
    assert len(torch.cat([x for x, _ in loader])) == 40


@pytest.mark.filterwarnings("ignore:lr_find. no suggestion")
def test_a_loader_with_its_own_generator_serves_the_next_epochs_as_without_a_sweep(monkeypatch):
    def kwargs():
        return {"shuffle": True, "generator": torch.Generator().manual_seed(5)}

    assert_same_run(train_epochs(kwargs(), True), train_epochs(kwargs(), False))
    monkeypatch.setattr(lf, "_keep_loader", lambda loader, undo: loader)  # the check can fail:
    seen, _ = train_epochs(kwargs(), True)
    assert not torch.equal(seen[0], train_epochs(kwargs(), False)[0][0]), "without the restore, another order"


def test_a_loader_whose_dataset_is_an_iterator_is_one_warning():
    class Stream(torch.utils.data.IterableDataset):
        def __init__(self):
            self.left = iter([(torch.ones(2, 1), torch.zeros(2, 1))] * 40)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.left)

    model = nn.Linear(1, 1)
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    with pytest.warns(UserWarning) as caught:
        lf.lr_find(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, loader, num_iter=10,
                   end_lr=1e-2)
    assert [str(w.message) for w in caught if "DataLoader" in str(w.message)] == [
        "lr_find: the DataLoader's dataset is an iterator (Stream): the sweep used up what it drew; give "
        "lr_find a loader of its own, or the dataset an __iter__ that starts afresh"]


# --- the optimizer's kind, through wrappers -------------------------------------------------------


def test_a_wrapped_adamw_is_read_as_adamw():
    """accelerate's AcceleratedOptimizer around AdamW: the same rules, so the same suggestions."""
    def sweep(wrap: bool) -> lf.LRFindResult:
        torch.manual_seed(0)
        model = TokenClassifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer = AcceleratedOptimizer(optimizer) if wrap else optimizer
        before = snapshot(model, optimizer)
        found = lf.lr_find(model, optimizer, None, token_batches(), batch_loss=hf_loss, num_iter=20,
                           start_lr=1e-4)
        assert_restored(before, model, optimizer)
        return found

    wrapped, bare = sweep(True), sweep(False)
    assert wrapped.optimizer_kind == bare.optimizer_kind == "adaptive"
    assert wrapped.optimizer_kind_from == "AdamW in AcceleratedOptimizer: betas, eps"
    assert bare.optimizer_kind_from == "AdamW: betas, eps"
    assert wrapped.suggestions == bare.suggestions and wrapped.suggestion is not None


def micro_batch_loop(optimizer, scheduler, micro_batches: int, accum: int, clip=None) -> list[bool]:
    """accelerate's accumulation: optimizer_step after every micro-batch, syncing on every accum-th."""
    model_params = optimizer.param_groups[0]["params"]
    results = []
    for i in range(micro_batches):
        optimizer.gradient_state.sync_gradients = (i + 1) % accum == 0
        sum(p.sum() for p in model_params).mul(100).backward()
        results.append(optimizer_step(optimizer, scheduler, clip_grad=clip))
        optimizer.zero_grad(set_to_none=True)
    return results


@pytest.mark.parametrize("name", ["onecycle", "cosine"])
def test_optimizer_step_counts_only_the_steps_a_wrapper_takes(name):
    """Between syncs the wrapper's step() does nothing: the schedule must wait too (onecycle would
    raise past its end, cosine would run 4x fast)."""
    model = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = AcceleratedOptimizer(inner)
    scheduler = build_scheduler(optimizer, name, 3)
    steps = []
    inner.register_step_post_hook(lambda *_: steps.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor torch's "scheduler.step() before optimizer.step()"
        stepped = micro_batch_loop(optimizer, scheduler, 12, accum=4, clip=1.0)
    assert stepped == [False, False, False, True] * 3
    assert len(steps) == scheduler.last_epoch == 3


def test_gradients_between_syncs_are_not_clipped():
    model = nn.Linear(2, 2)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.gradient_state.sync_gradients = False
    model.weight.grad = torch.full((2, 2), 50.0)
    assert optimizer_step(optimizer, clip_grad=1.0) is False
    assert torch.equal(model.weight.grad, torch.full((2, 2), 50.0))
    optimizer.gradient_state.sync_gradients = True
    assert optimizer_step(optimizer, clip_grad=1.0) is True
    assert float(torch.linalg.vector_norm(model.weight.grad)) == pytest.approx(1.0, rel=1e-5)


def test_a_step_the_wrapper_reports_skipped_does_not_advance_the_schedule():
    """A fused optimizer under the wrapper's own scaler runs and skips on the device: its step hook
    fires all the same, and only step_was_skipped tells."""
    model = nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=3e38)
    optimizer = AcceleratedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1, fused=True), scaler)
    scheduler = build_scheduler(optimizer, "cosine", 5)
    weight = model.weight.detach().clone()
    scaler.scale(model(torch.ones(1, 2)).sum() * 1e3).backward()  # inf gradients: the scaler skips
    assert optimizer_step(optimizer, scheduler) is False and optimizer.step_was_skipped
    assert scheduler.last_epoch == 0 and torch.equal(model.weight, weight)
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum() * 1e-3).backward()  # finite gradients
    assert optimizer_step(optimizer, scheduler) is True and scheduler.last_epoch == 1


# --- param groups, a scaler that skips everything, a schedule stepped twice -----------------------


def test_param_groups_at_a_10x_ratio_get_onecycle_peaks_at_that_ratio():
    """Discriminative fine-tuning: the head learns at 10x the body's rate."""
    torch.manual_seed(0)
    model = small_convnet()
    body, head = list(model[0].parameters()), list(model[-1].parameters())
    optimizer = torch.optim.SGD([{"params": body, "lr": 0.01}, {"params": head, "lr": 0.1}], momentum=0.9)
    loader = torch.utils.data.DataLoader(NoisyImages(), batch_size=8)
    found = lf.lr_find(model, optimizer, F.cross_entropy, loader, num_iter=20, start_lr=1e-4)
    assert all(head_lr == pytest.approx(10 * body_lr, rel=1e-12) for body_lr, head_lr in found.group_lrs)
    peaks = found.for_groups()
    assert peaks[0] == found.suggestion and peaks[1] == pytest.approx(10 * found.suggestion, rel=1e-12)
    for max_lr in (found.suggestion, peaks):  # the README's one line, or the list
        scheduler = build_scheduler(optimizer, "onecycle", 10, max_lr=max_lr)
        assert [g["max_lr"] for g in optimizer.param_groups] == pytest.approx(peaks, rel=1e-12)
        scheduler.load_state_dict(scheduler.state_dict())


@pytest.mark.parametrize("fused", [False, True])
def test_a_scaler_that_skips_every_step_gives_no_suggestion(fused, tmp_path):
    """fp16 with a GradScaler whose scale never backs off below what fp16 gradients can hold: a plain
    optimizer is never called, a fused one is called and skips on the device; either way the weights
    never move, and the sweep says so."""
    torch.manual_seed(0)
    model = TwoInputNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=0.99999)
    before = snapshot(model, optimizer, scaler)
    with pytest.warns(UserWarning) as caught:
        found = lf.lr_find(model, optimizer, None, triple_batches(), scaler=scaler, num_iter=20,
                           autocast_dtype=torch.float16,
                           batch_loss=lambda model, b: F.cross_entropy(model(b[0], b[2]), b[1]))
    why = ("the weights never changed in 20 steps (zero gradients, or steps skipped on the device)" if fused
           else "every step was skipped (by a GradScaler, or an optimizer wrapper)")
    assert [str(w.message) for w in caught] == [f"lr_find: no suggestion, {why}"]
    assert found.why_none == why and found.suggestion is None and found.for_groups() is None
    assert found.suggestions == {"peak": (None, "minimum"), "base": (None, "min/3")}
    with pytest.warns(UserWarning, match="no suggestion"):
        assert found.suggest("min/10") is None
    lf.save_sweep(found, {}, tmp_path)
    assert json.loads((tmp_path / "lr_find.json").read_text())["why_none"] == why
    assert_restored(before, model, optimizer, scaler)


def test_a_second_scheduler_step_per_epoch_is_one_warning_naming_it():
    """imagenet/main.py's per-epoch scheduler.step() left beside optimizer_step's."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    epochs, batches = 3, 4
    scheduler = build_scheduler(optimizer, "onecycle", epochs * batches)
    with pytest.warns(UserWarning) as caught:
        for _ in range(epochs):
            for _ in range(batches):
                model(torch.ones(1, 2)).sum().backward()
                optimizer_step(optimizer, scheduler)
                optimizer.zero_grad()
            scheduler.step()  # the leftover
    assert len(caught) == 1 and "second scheduler.step() per epoch" in str(caught[0].message)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 25 / 1e4)  # onecycle's end, held
