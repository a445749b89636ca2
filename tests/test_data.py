"""The device-resident loader: same images as a DataLoader, exact epochs, reproducible order."""

import pytest
import torch
import torch.nn.functional as F
from conftest import build_loaders

from configs import parse_config
from machinery.batches import DeviceBatches, ImageSteps, Serving, augment, epoch_plan
from machinery.served import Batches

CPU = torch.device("cpu")


def make_batches(source, labels, *, served: bool = False, **overrides):
    """Batches of uint8 images with these overrides, of Serving's options or of ImageSteps': a tensor's
    (DeviceBatches, the plain path's; `served`: machinery/served.py's Batches), or a Dataset's (workers)."""
    image = {"mean": torch.tensor([0.5]), "std": torch.tensor([0.25]), "pad": 2, "flip": True, "resize": 0}
    options = {"batch_size": 8, "seed": 3, "device": CPU}
    train = overrides.pop("train", True)
    for key, value in overrides.items():
        (image if key in image else options)[key] = value
    kind = DeviceBatches if isinstance(source, torch.Tensor) and not served else Batches
    return kind(source, labels, Serving(**options), train=train, image=ImageSteps(**image))


def indexed_images(n: int = 44, size: int = 6):
    images = torch.randint(0, 256, (n, 1, size, size), generator=torch.Generator().manual_seed(1),
                           dtype=torch.uint8)
    return images, torch.arange(n)


def test_device_path_equals_dataloader_path_without_augmentation():
    cfg = parse_config(["--dataset", "digits", "--no-augment", "--batch-size", "100"])
    on_device, _, _, info = build_loaders(cfg, CPU)
    cfg.loader, cfg.num_workers = "dataloader", 2
    workers, _, _, info_workers = build_loaders(cfg, CPU)
    assert "device" in info.loader and "DataLoader" in info_workers.loader
    for epoch in (0, 1):
        pairs = list(zip(on_device.epoch(epoch), workers.epoch(epoch), strict=True))
        assert len(pairs) == len(on_device) == 1293 // 100
        for (xa, ya), (xb, yb) in pairs:
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_dataloader_path_augments_identically():
    images, labels = indexed_images()
    device_batches = make_batches(images, labels)
    worker_batches = make_batches(torch.utils.data.TensorDataset(images, labels), None,
                                  num_workers=1)
    for (xa, ya), (xb, yb) in zip(device_batches.epoch(2), worker_batches.epoch(2), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("shard", [(0, 1), (1, 3)])
def test_the_plain_path_serves_what_the_general_path_serves_bit_for_bit(shard):
    """DeviceBatches (one tensor on the device: the default run's) and served.Batches on the same tensors:
    the same training epochs (order, crops, flips, a start mid-epoch), validation batches, first examples
    and pixels back, for one process and for a rank of three."""
    images, labels = indexed_images(50)
    options = {"rank": shard[0], "world_size": shard[1], "resize": 9}
    for train in (True, False):
        plain, general = (make_batches(images, labels, served=served, train=train, **options)
                          for served in (False, True))
        assert len(plain) == len(general)
        for epoch, start in ((0, 0), (3, 1)):
            pairs = list(zip(plain.epoch(epoch, start), general.epoch(epoch, start), strict=True))
            assert pairs
            for (xa, ya), (xb, yb) in pairs:
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert all(torch.equal(a, b) for a, b in zip(plain.first(5), general.first(5), strict=True))
        x = plain.first(5)[0]
        assert torch.equal(plain.to_pixels(x), general.to_pixels(x))


def test_augmented_images_are_padded_crops_or_flips_of_their_source():
    images, labels = indexed_images()
    pad = 2
    batches = make_batches(images, labels, pad=pad, mean=torch.tensor([0.0]),
                           std=torch.tensor([1 / 255]))
    flipped_seen = 0
    for x, y in batches.epoch(0):
        for image, index in zip(x.round().to(torch.uint8), y.tolist(), strict=True):
            padded = F.pad(images[index], (pad,) * 4)
            candidates = [padded[:, r:r + 6, c:c + 6] for r in range(5) for c in range(5)]
            if any(torch.equal(image, c) for c in candidates):
                continue
            assert any(torch.equal(image, c.flip(-1)) for c in candidates), index
            flipped_seen += 1
    assert flipped_seen > 0


def test_each_epoch_visits_every_example_once_and_ranks_split_it():
    images, labels = indexed_images(n=48)
    seen = torch.cat([y for _, y in make_batches(images, labels).epoch(5)])
    assert sorted(seen.tolist()) == list(range(48))
    shards = [torch.cat([y for _, y in make_batches(images, labels, rank=r, world_size=2,
                                                    batch_size=4).epoch(5)]) for r in (0, 1)]
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())
    assert sorted(torch.cat(shards).tolist()) == list(range(48))


def test_training_drops_the_partial_batch_but_evaluation_never_does():
    images, labels = indexed_images(n=44)
    train = make_batches(images, labels)
    val = make_batches(images, labels, train=False)
    assert len(train) == 5 and all(len(y) == 8 for _, y in train.epoch(0))
    seen = torch.cat([y for _, y in val.epoch(0)])
    assert len(val) == 6 and seen.tolist() == list(range(44))
    shards = [make_batches(images, labels, train=False, rank=r, world_size=3) for r in range(3)]
    assert sorted(torch.cat([y for s in shards for _, y in s.epoch(0)]).tolist()) == list(range(44))


@pytest.mark.parametrize("size, flags, rank_world, said", [
    (240, [], (0, 1), "training: 1 optimizer step an epoch (1 batch of 128); 112 of the 240 training "
     "examples sit out of each epoch, others each time (the last, partial batch is dropped); --batch-size "
     "120 leaves none out, in 2 batches"),
    (241, ["--batch-size", "64", "--accum-steps", "2"], (1, 2), "training: 2 optimizer steps an epoch (3 "
     "batches of 64, 2 a step); 49 of the 241 training examples sit out of each epoch, others each time (the "
     "last, partial batch is dropped and what does not divide over 2 processes); --batch-size 60 leaves 1 "
     "out, in 4 batches"),
    (256, [], (0, 1), None),
], ids=["a small folder", "torchrun and accumulation", "every example trains"])
def test_start_up_says_what_an_epoch_trains_where_examples_sit_out(size, flags, rank_world, said):
    """Issue 49, 14: 240 examples at the default --batch-size made one step an epoch, 112 sitting out of
    every one, in silence."""
    cfg = parse_config(["--dataset", "synthetic", "--synthetic-size", str(size), "--image-size", "4", *flags])
    train, _, _, info = build_loaders(cfg, CPU, *rank_world)
    assert [note for note in info.notes if note.startswith("training: ")] == ([said] if said else [])
    assert len(train) == info.batches == (size // rank_world[1]) // (cfg.batch_size // rank_world[1])


def test_order_is_reproducible_from_seed_and_epoch_and_resumable_mid_epoch():
    images, labels = indexed_images()
    a, b = make_batches(images, labels), make_batches(images, labels)
    epoch3 = [(x, y) for x, y in a.epoch(3)]
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(epoch3, b.epoch(3), strict=True))
    assert not torch.equal(torch.cat([y for _, y in epoch3]), torch.cat([y for _, y in a.epoch(4)]))
    other_seed = make_batches(images, labels, seed=4)
    assert not torch.equal(epoch3[0][1], next(iter(other_seed.epoch(3)))[1])
    tail = list(a.epoch(3, start=2))
    assert len(tail) == len(epoch3) - 2
    assert all(torch.equal(x, ex) and torch.equal(y, ey)
               for (x, y), (ex, ey) in zip(tail, epoch3[2:], strict=True))


def test_epoch_plan_ignores_global_rng():
    torch.manual_seed(0)
    first = epoch_plan(30, 1, 2, pad=2, flip=True)
    torch.manual_seed(99)
    second = epoch_plan(30, 1, 2, pad=2, flip=True)
    assert all(torch.equal(p, q) for p, q in zip(first, second, strict=True))


def test_augment_without_padding_or_flips_is_identity():
    images, _ = indexed_images(n=4)
    out = augment(images, torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, dtype=torch.bool), 0)
    assert torch.equal(out, images)


@pytest.mark.parametrize("argv, shape, sizes, classes", [
    # sklearn's 8x8 digits: our 360 test images, and a tenth of each class of the other 1437 for val
    (["--dataset", "digits"], (1, 8, 8), (1293, 144, 360), 10),
    (["--dataset", "synthetic", "--image-size", "12", "--channels", "2", "--num-classes", "7",
      "--synthetic-size", "100"], (2, 12, 12), (100, 25, 25), 7),
    (["--dataset", "synthetic", "--synthetic-size", "64", "--synthetic-val-size", "300"], (3, 16, 16),
     (64, 300, 300), 10),
], ids=["digits", "synthetic", "synthetic-val-size"])
def test_loaders_report_shapes(argv, shape, sizes, classes):
    """Expected from the arguments (or the dataset's known size), never from `info` itself."""
    cfg = parse_config([*argv, "--batch-size", "16"])
    train, val, test, info = build_loaders(cfg, CPU)
    x, y = next(iter(train))
    assert x.dtype == torch.float32 and y.dtype == torch.long
    assert x.shape == (16, *shape) and y.shape == (16,)
    assert info.input_shape == shape and info.images
    assert (info.train_size, info.val_size, info.test_size) == sizes
    assert (train.num_examples, val.num_examples, test.num_examples) == sizes
    assert len(info.names) == classes and int(y.max()) < classes
    assert len(train) == sizes[0] // 16 and len(val) == -(-sizes[1] // 16) and len(test) == -(-sizes[2] // 16)
    assert [sum(len(t) for _, t in held.epoch(0)) for held in (val, test)] == list(sizes[1:])


def test_a_larger_synthetic_val_set_leaves_the_training_data_alone():
    """The bench's low-noise val set (bench/lr_find_rules.py) must not change what a run trains on."""
    from data import synthetic

    base = parse_config(["--dataset", "synthetic", "--synthetic-size", "64"])
    more = parse_config(["--dataset", "synthetic", "--synthetic-size", "64", "--synthetic-val-size", "300"])
    (x, y), (_, vy) = synthetic(base).train, synthetic(base).val
    (x2, y2), (_, vy2) = synthetic(more).train, synthetic(more).val
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert len(vy) == 16 and len(vy2) == 300 and torch.equal(vy2[:16], vy)


def test_batches_with_workers_go_as_soon_as_they_are_dropped():
    """No reference cycle holds a Batches: dropped mid-epoch, it and its DataLoader's workers go at once.
    (Left to the cycle collector, each worker took 5 s to stop; the suite lost minutes to it.)"""
    import gc
    import weakref

    cfg = parse_config(["--dataset", "synthetic", "--synthetic-size", "256", "--image-size", "8",
                        "--loader", "dataloader", "--num-workers", "2", "--batch-size", "16"])
    train_batches, val_batches, _, _ = build_loaders(cfg, torch.device("cpu"))
    stream = train_batches.epoch(0)
    next(stream)
    workers, gone = list(train_batches._loader._iterator._workers), weakref.ref(train_batches)
    gc.disable()
    try:
        del stream, train_batches, val_batches
        assert gone() is None
    finally:
        gc.enable()
    for worker in workers:
        worker.join(timeout=2)
        assert not worker.is_alive()


def test_a_failed_run_stops_its_workers_at_once(tmp_path, monkeypatch):
    """train() that raises (here mid-epoch, in a notebook say) stops its DataLoader workers on the way
    out: the traceback keeps its frames, so left to them the workers went only with the collector,
    5 s each."""
    import gc
    import multiprocessing

    from conftest import crash_at_step

    import train

    argv = ["--dataset", "synthetic", "--synthetic-size", "256", "--image-size", "8", "--loader",
            "dataloader", "--num-workers", "2", "--batch-size", "16", "--out-dir", str(tmp_path)]
    gc.disable()
    try:
        with crash_at_step(monkeypatch, 3):
            train.train(parse_config(argv))
        assert multiprocessing.active_children() == []
    finally:
        gc.enable()


def test_digits_are_load_digits_read_without_importing_scikit_learn(monkeypatch):
    """data.bundled_digits reads scikit-learn's own file (a second of start-up saved: sklearn is not
    imported); where that file is not found, load_digits gives the same rows."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    import data

    bunch = load_digits()
    rows = data.bundled_digits()
    assert (rows[:, :64] == bunch.data).all() and (rows[:, 64] == bunch.target).all()
    monkeypatch.setattr(sys, "path", [])  # the file is not found
    assert (data.bundled_digits() == rows).all()
    check = "import sys, data; data.bundled_digits(); print(sorted(m for m in sys.modules if 'sklearn' in m))"
    found = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                           cwd=data.Path(data.__file__).parent)
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stderr[-2000:]
