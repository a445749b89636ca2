"""Image folders read right (issue 24): each link followed once and never across classes, 16-bit,
float and GIF files brought to 8 bits as they were meant, what was skipped said at start-up, and
every message that names a file or class on one line."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_loaders, run_script
from PIL import Image

from configs import UserError, parse_config
from machinery.image_files import IMAGE_SUFFIXES, UnreadableImage, read_image

CPU = torch.device("cpu")
FLAGS = ["--image-size", "8", "--no-augment", "--batch-size", "2", "--num-workers", "0", "--loader",
         "dataloader"]  # the files as each split lists them: read, not decoded into a cache


def skipped(info) -> list[str]:
    """The start-up notes that say which files were skipped (the others say what the run does)."""
    return [note for note in info.notes if note.startswith("imagefolder: skipped")]

def png(path: Path, value: int = 100) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)
    return path


def image_folder(root: Path, counts: dict[str, int]) -> Path:
    """root/{train,val}/<class>/<k>.png: `count` images per class, each class its own gray."""
    for split in ("train", "val"):
        for i, (name, count) in enumerate(counts.items()):
            for k in range(count):
                png(root / split / name / f"{k}.png", 40 + 100 * i)
    return root


def load(root: Path, *extra: str):
    cfg = parse_config(["--dataset", "imagefolder", "--data-dir", str(root), *FLAGS, *extra])
    train, val, _, info = build_loaders(cfg, CPU)
    return train, val, info


def listed(batches, root: Path) -> list[tuple[str, int]]:
    """The (file relative to its split's folder, class index) pairs a split reads, in order."""
    split = root / ("train" if batches.train else "val")
    return [(str(path.relative_to(split)), label) for path, label in batches.source.items]


def skipped_note(info, split: str) -> str:
    notes = [note for note in skipped(info) if f" {split}/ " in note]
    assert len(notes) <= 1, info.notes
    return notes[0] if notes else ""


# ---------------------------------------------------------------- links

def test_a_link_loop_is_read_once(tmp_path):
    """The issue's loop read a class 40 levels deep; each folder is read once, whatever links to it."""
    root = image_folder(tmp_path / "images", {"a": 3, "b": 2})
    (root / "train" / "a" / "loop").symlink_to(".")
    png(root / "train" / "a" / "sub" / "x.png")
    (root / "train" / "a" / "sub" / "up").symlink_to("..")
    (root / "train" / "a" / "alias").symlink_to("sub")  # sorted before sub/: its images keep their path
    train, val, info = load(root)
    assert listed(train, root) == [("a/0.png", 0), ("a/1.png", 0), ("a/2.png", 0), ("a/sub/x.png", 0),
                                   ("b/0.png", 1), ("b/1.png", 1)]
    assert info.train_size == 6 and info.val_size == 5
    assert skipped_note(info, "train") == ("imagefolder: skipped 3 in train/ - reached twice: 3 "
                                           "(a/alias, a/loop, a/sub/up)")
    assert skipped_note(info, "val") == ""


def test_a_link_into_another_class_is_skipped(tmp_path):
    """Its images are that class's: labelling them as this one was the issue's second fault."""
    root = image_folder(tmp_path / "images", {"a": 2, "b": 2})
    png(root / "train" / "b" / "sub" / "deep.png", 140)
    a = root / "train" / "a"
    (a / "dogs").symlink_to("../b")
    (a / "b0.png").symlink_to("../b/0.png")
    (a / "deep").symlink_to("../b/sub")  # inside another class's folder
    (a / "everything").symlink_to("..")  # the split: its class a is this one, read already
    (root / "val" / "b" / "from_train.png").symlink_to("../../train/a/0.png")  # another class, other split
    train, val, info = load(root)
    assert listed(train, root) == [("a/0.png", 0), ("a/1.png", 0), ("b/0.png", 1), ("b/1.png", 1),
                                   ("b/sub/deep.png", 1)]
    assert skipped_note(info, "train") == (
        "imagefolder: skipped 5 in train/ - links into another class: 4 (a/b0.png, a/deep, "
        "a/dogs); reached twice: 1 (a/everything/a)")
    assert "links into another class: 1 (b/from_train.png)" in skipped_note(info, "val")
    pixels = torch.stack([train.source[i][0] for i in range(len(train.source))])
    assert pixels[:2].eq(40).all() and pixels[2:].eq(140).all()  # every label matches its image


def test_links_out_of_the_folder_are_followed_once(tmp_path):
    """Class folders kept elsewhere, or linking into a shared store, read as if copied in, once."""
    store = tmp_path / "store"
    for k in range(3):
        png(store / "shared" / f"{k}.png", 200)
        png(store / "c_train" / f"{k}.png", 60)
        png(store / "c_val" / f"{k}.png", 60)
    root = image_folder(tmp_path / "images", {"a": 1, "b": 1})
    (root / "train" / "c").symlink_to(store / "c_train")
    (root / "val" / "c").symlink_to(store / "c_val")
    (root / "train" / "a" / "ext").symlink_to(store / "shared")
    (root / "train" / "a" / "ext_again").symlink_to(store / "shared")
    (root / "train" / "a" / "single.png").symlink_to(store / "shared" / "1.png")
    (root / "train" / "b" / "ext").symlink_to(store / "shared")  # a class that comes later
    train, val, info = load(root)
    assert info.names == ["a", "b", "c"]
    assert listed(train, root) == [("a/0.png", 0), ("a/ext/0.png", 0), ("a/ext/1.png", 0), ("a/ext/2.png", 0),
                                   ("b/0.png", 1), ("c/0.png", 2), ("c/1.png", 2), ("c/2.png", 2)]
    assert info.val_size == 5
    assert skipped_note(info, "train") == ("imagefolder: skipped 3 in train/ - reached twice: 3 "
                                           "(a/ext_again, a/single.png, b/ext)")


def test_what_is_not_an_image_is_counted_by_reason(tmp_path):
    root = image_folder(tmp_path / "images", {"a": 2, "b": 2})
    for name in ("notes.txt", "meta.json", ".DS_Store", "more.TXT"):
        (root / "train" / "a" / name).write_text("x")
    (root / "train" / "b" / "gone.png").symlink_to("nowhere.png")
    (root / "train" / "b" / "jpeg.JPG").write_bytes((root / "train" / "b" / "0.png").read_bytes())
    (root / "val" / "a" / "odd\nname.txt").write_text("x")
    train, val, info = load(root)
    assert [path.name for path, _ in train.source.items] == ["0.png", "1.png", "0.png", "1.png", "jpeg.JPG"]
    assert skipped_note(info, "train") == (
        "imagefolder: skipped 5 in train/ - not images: 4 (a/.DS_Store, a/meta.json, a/more.TXT); "
        "broken links: 1 (b/gone.png)")
    assert skipped_note(info, "val") == ("imagefolder: skipped 1 in val/ - not images: 1 "
                                         "('a/odd\\nname.txt')")


def test_a_folder_that_cannot_be_read_is_counted(tmp_path, monkeypatch):
    """(Permissions do not stop root, who runs some CI: the folder's listing fails instead.)"""
    import data

    root = image_folder(tmp_path / "images", {"a": 2, "b": 1})
    png(root / "train" / "a" / "locked" / "x.png")
    scandir = data.os.scandir

    def refusing(path):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(data.os, "scandir", refusing)
    train, _, info = load(root)
    assert info.train_size == 3
    assert skipped_note(info, "train") == ("imagefolder: skipped 1 in train/ - unreadable folders: 1 "
                                           "(a/locked)")


def test_the_order_is_unchanged_without_links(tmp_path):
    """Classes sorted, then each class's files as sorted paths (the order before issue 24, which
    tests/test_faults.py relies on), nested folders included."""
    root = image_folder(tmp_path / "images", {"b": 1, "a": 1})
    for name in ("z.png", "sub/y.png", "sub-x/w.png", "sub/deeper/v.png", "A.jpg", "sub2/u.bmp", "t.gif"):
        path = root / "train" / "a" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(path)
    train, _, info = load(root)
    before = [(path, i) for i, name in enumerate(info.names)
              for path in sorted((root / "train" / name).rglob("*")) if path.suffix.lower() in IMAGE_SUFFIXES]
    assert train.source.items == before and len(before) == 9 and not skipped(info)


# ---------------------------------------------------------------- 16-bit, float and GIF files

def saved(path: Path, image: Image.Image, **options) -> str:
    image.save(path, **options)
    return str(path)


def test_16_bit_images_scale_to_8_bits(tmp_path):
    """PIL's convert clips 16-bit values at 255: all but the darkest pixels came out white."""
    values = np.array([[0, 257 * 100, 65535, 1000]], np.uint16)  # 1000 / 257: 3.9
    for path in (saved(tmp_path / "a.png", Image.fromarray(values)),
                 saved(tmp_path / "b.tif", Image.fromarray(values.astype(">u2"))),  # "I;16B"
                 saved(tmp_path / "c.tif", Image.fromarray(values.astype(np.int32)))):  # mode "I"
        assert Image.open(path).mode in ("I;16", "I;16B", "I")
        assert np.asarray(read_image(path, "L")).tolist() == [[0, 100, 255, 4]]
        assert np.asarray(read_image(path, "RGB"))[0, 1].tolist() == [100, 100, 100]
    wide = saved(tmp_path / "wide.tif", Image.fromarray(np.array([[-65535, 0, 65535, 131070]], np.int32)))
    assert np.asarray(read_image(wide, "L")).tolist() == [[0, 85, 170, 255]]  # its own range


def test_float_images_scale_from_0_1_or_their_own_range(tmp_path):
    """PIL's convert cut floats in 0..1 to 0 or 1: black."""
    unit = saved(tmp_path / "unit.tif", Image.fromarray(np.array([[0, 0.2, 1, 0.5]], np.float32)))
    assert Image.open(unit).mode == "F"
    assert np.asarray(read_image(unit, "L")).tolist() == [[0, 51, 255, 128]]
    wide = saved(tmp_path / "wide.tif", Image.fromarray(np.array([[-1, 0, 1, 3]], np.float32)))
    assert np.asarray(read_image(wide, "L")).tolist() == [[0, 64, 128, 255]]
    odd = saved(tmp_path / "odd.tif", Image.fromarray(np.array([[np.nan, np.inf, -np.inf, 0.6]], np.float32)))
    assert np.asarray(read_image(odd, "RGB"))[0, :, 0].tolist() == [0, 0, 0, 153]  # not finite: 0


def test_gif_files_are_read_as_their_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), (v, v, v)).quantize(4) for v in (30, 220)]
    animated = saved(tmp_path / "a.gif", frames[0], save_all=True, append_images=frames[1:])
    assert np.asarray(read_image(animated, "L")).max() == 30
    gray = saved(tmp_path / "g.gif", Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)))
    assert np.asarray(read_image(gray, "L")).tolist() == np.arange(64).reshape(8, 8).tolist()


def test_an_image_folder_of_16_bit_float_and_gif_files_reads_right(tmp_path):
    """Through build_loaders, each class one kind of file, each file one mid gray."""
    root = tmp_path / "images"
    for split in ("train", "val"):
        for k in range(2):
            (root / split / "deep").mkdir(parents=True, exist_ok=True)
            (root / split / "float").mkdir(parents=True, exist_ok=True)
            (root / split / "gif").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8), 257 * 120, np.uint16)).save(root / split / "deep" / f"{k}.png")
            Image.fromarray(np.full((8, 8), 0.4, np.float32)).save(root / split / "float" / f"{k}.tif")
            Image.new("L", (8, 8), 90).save(root / split / "gif" / f"{k}.gif")
    for channels in ("1", "3"):
        train, val, info = load(root, "--channels", channels)
        assert (info.train_size, info.val_size) == (6, 6) and not skipped(info)
        pixels = [train.source[i][0] for i in range(6)]
        assert [int(p.float().mean()) for p in pixels] == [120, 120, 102, 102, 90, 90]
        assert all(p.shape == (int(channels), 8, 8) and p.min() == p.max() for p in pixels)


# ---------------------------------------------------------------- one line, whatever the names hold

def test_a_newline_in_a_class_name_keeps_each_message_on_one_line(tmp_path):
    root = image_folder(tmp_path / "images", {"bad\nname": 2, "good": 2})
    broken = root / "train" / "bad\nname" / "1.png"  # not the first: build_loaders reads that one
    broken.write_bytes(b"not a png")
    train, _, _ = load(root)
    with pytest.raises(UnreadableImage) as err:
        train.source[1]
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"cannot read image {str(broken)!r} (class folder 'bad\\nname'): ")
    (root / "val" / "bad\nname" / "odd\rfile.txt").write_text("x")
    (root / "val" / "bad\nname" / "up").symlink_to("../good")
    assert all("\n" not in note and "\r" not in note for note in load(root)[2].notes)
    (root / "val" / "other\x1bclass").mkdir()
    with pytest.raises(UserError) as err:
        load(root)
    assert "\n" not in str(err.value) and "'other\\x1bclass'" in str(err.value)
    with pytest.raises(UserError) as err:
        load(tmp_path / "no\nsuch")
    assert "\n" not in str(err.value) and "no\\nsuch" in str(err.value)


# ---------------------------------------------------------------- csv files, read by the same reader

def test_csv_reads_its_rows_with_a_val_csv_or_a_held_out_fraction(tmp_path):
    """16-bit and GIF files through csv rows too; without val.csv, a fixed --val-fraction of each class is
    held out."""
    rows = ["file,label"]
    for k in range(6):
        Image.fromarray(np.full((8, 8), 257 * (20 + k), np.uint16)).save(tmp_path / f"{k}.png")
        Image.new("L", (8, 8), 200).save(tmp_path / f"{k}.gif")
        rows += [f"{k}.png,dark", f" {k}.gif , light "]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    flags = ["--dataset", "csv", "--data-dir", str(tmp_path), *FLAGS, "--channels", "1"]
    train, val, _, info = build_loaders(parse_config([*flags, "--val-fraction", "0.25"]), CPU)
    assert info.names == ["dark", "light"] and (info.train_size, info.val_size) == (9, 3)
    assert sorted(label for _, label in val.source.items) == [0, 0, 1]  # by class: 1.5 of each, rounded
    every = [(tmp_path / f"{k}.{kind}", label) for k in range(6) for label, kind in enumerate(("png", "gif"))]
    assert sorted(map(str, train.source.items + val.source.items)) == sorted(map(str, every))
    assert {int(train.source[i][0].float().mean()) for i in range(9)} <= {20, 21, 22, 23, 24, 25, 200}
    again = build_loaders(parse_config([*flags, "--val-fraction", "0.25", "--seed", "3"]), CPU)[1]
    assert again.source.items == val.source.items  # the split's own seed
    (tmp_path / "val.csv").write_text("file,label\n0.png,dark\n0.gif,light\n")
    train, val, _, info = build_loaders(parse_config(flags), CPU)
    assert (info.train_size, info.val_size) == (12, 2)
    assert [int(val.source[i][0].float().mean()) for i in range(2)] == [20, 200]


def test_a_newline_in_a_csv_file_name_keeps_the_message_on_one_line(tmp_path):
    png(tmp_path / "a.png")
    (tmp_path / "train.csv").write_text('file,label\na.png,x\n"b\nc.png",y\n')
    with pytest.raises(UserError) as err:
        build_loaders(parse_config(["--dataset", "csv", "--data-dir", str(tmp_path), *FLAGS]), CPU)
    assert "\n" not in str(err.value) and "b\\nc.png" in str(err.value)


def test_command_line_reads_a_mixed_folder_and_fails_in_one_line_on_a_bad_file(tmp_path):
    """As a user runs it: a folder of 16-bit, float and GIF files, a link loop and a stray file
    trains, saying once what it skipped; a broken file in a class with a newline is one line."""
    root = tmp_path / "images"
    for split, count in (("train", 4), ("val", 2)):
        for k in range(count):
            (root / split / "dark").mkdir(parents=True, exist_ok=True)
            (root / split / "light\nside").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8), 257 * 40, np.uint16)).save(root / split / "dark" / f"{k}.png")
            Image.fromarray(np.full((8, 8), 0.8, np.float32)).save(root / split / "light\nside" / f"{k}.tif")
        Image.new("L", (8, 8), 50).save(root / split / "dark" / "extra.gif")
    (root / "train" / "dark" / "loop").symlink_to(".")
    (root / "train" / "dark" / "README.txt").write_text("x")
    flags = ["--dataset", "imagefolder", "--data-dir", str(root), "--epochs", "1", "--device", "cpu",
             "--image-size", "8", "--width", "4", "--batch-size", "4", "--log-every", "1000"]
    ok = run_script("train.py", *flags, "--num-workers", "0", "--out-dir", str(tmp_path / "a"))
    assert ok.returncode == 0, ok.stderr
    note = ("imagefolder: skipped 2 in train/ - not images: 1 (dark/README.txt); "
            "reached twice: 1 (dark/loop)")
    assert ok.stdout.count(note) == 1 and "9 train / 5 val" in ok.stdout, ok.stdout
    (root / "train" / "light\nside" / "2.tif").write_bytes(b"not a tiff")
    bad = run_script("train.py", *flags, "--num-workers", "1", "--out-dir", str(tmp_path / "b"))
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1, bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr
    assert "2.tif' (class folder 'light\\nside')" in bad.stderr
