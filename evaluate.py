"""Use a saved model: `python evaluate.py [--checkpoint runs/x/best.pt] [--split test]` runs a split once
through it and writes eval.json beside it; `--predict PATH` predicts images with it instead, into
predictions.csv; `--export model.onnx` (or model.pt2) writes it as one file other runtimes load. Each
builds the model and reads the data as its run did (its checkpoint keeps how), and trains nothing. In
your own code, `load_trained(path)` gives the model a checkpoint holds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

import task as default_task
from configs import Config, UserError, parse_given, validate
from configs.resolve import EVALUATE_SETTINGS, evaluated_config
from machinery import checkpoints, logs, processes, reports, stops, workers
from machinery.batches import ImageSteps, Serving
from machinery.contract import check_model
from machinery.export import export_model, staged
from machinery.image_files import IMAGE_SUFFIXES, ImageFiles, UnreadableImage, csv_rows
from machinery.image_files import printable as named
from machinery.processes import amp_setup, autocast
from machinery.served import Batches
from machinery.weights import load_weights
from models import build_model
from train import CHOICES, evaluate, setup


def evaluate_checkpoint(cfg: Config, given: dict, task=default_task) -> None:
    """The --split (val or test) once through the model in --checkpoint (a train.py checkpoint, or a plain
    state_dict with the model and data given as flags). Writes eval.json and the task's pictures next to
    the checkpoint (or into an --out-dir `given` here)."""
    cfg, ckpt, path, ours = opened(cfg, given, task)
    process = processes.start(cfg.device, cfg.dist_timeout, cfg.deterministic)
    splits, info, model = setup(cfg, task, process.device, shard=process.shard, fresh=False, trains=False)
    with splits:
        batches = chosen_split(splits, cfg)
        checkpoints.check_classes(ckpt, path, info.names, "evaluate it on the data it was trained on")
        # A split that shares training files: a CSV's rows said at training's start-up, and here again; any
        # split's images counted against the run's training images by their pixels
        shared = [note for note in info.notes if note.startswith(f"csv: {cfg.split}.csv lists")]
        counted = ours and training_images_in(cfg.split, ckpt["data"], info, own="data_dir" not in given)
        shared += [counted] if counted and not (shared and counted.startswith("the run's own")) else []
        load_weights(model, ckpt, len(info.names), f"--checkpoint {path}", new_head=False)
        check_model(model, batches, task, cfg, info)
        result = evaluate(model, batches, task, cfg, info, amp_setup(process.device, cfg.amp)[0], process)
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    report = {"checkpoint": str(path), "step": ckpt.get("step"), "dataset": cfg.dataset, "split": cfg.split,
              f"{cfg.split}_size": batches.num_examples,
              **{f"{cfg.split}_{name}": result.metrics[name] for name in task.METRICS}, **result.details,
              **({"note": "; ".join(shared)} if shared else {})}
    if process.rank == 0:
        print(*shared, sep="\n")
        reports.report_evaluation(task, result, report, task.pictures(result, info.names, None), out_dir)


def average(cfg: Config, given: dict, task=default_task) -> None:
    """--average: the weights of the checkpoints --keep-best kept beside --checkpoint (a best.pt), averaged in
    float64, their BatchNorm statistics recomputed on the training split, measured on --split (val, or
    test) beside --checkpoint's own figure; --average FILE also writes the averaged checkpoint there. One
    process: under torchrun every rank would measure the whole split, print and write FILE."""
    from machinery.averaging import averaged_weights, check_one_run, recompute_batchnorm
    from machinery.kept_best import read_ranking

    if processes.world_size() > 1:
        raise UserError("--average runs in one process: run evaluate.py without torchrun")
    cfg, ckpt, path, ours = opened(cfg, given, task)
    if not ours:
        raise UserError(f"--average: {path} is not a train.py checkpoint; give the best.pt of a --keep-best "
                        "run")
    kept, note = read_ranking(path.parent, check=lambda found: check_one_run(found, ckpt, path))
    process = processes.start(cfg.device, cfg.dist_timeout, cfg.deterministic)
    splits, info, model = setup(cfg, task, process.device, fresh=False, trains=False)
    amp_dtype = amp_setup(process.device, cfg.amp)[0]
    with splits:
        checkpoints.check_classes(ckpt, path, info.names, "average it on the data it was trained on")
        batches = chosen_split(splits, cfg)
        load_weights(model, ckpt, len(info.names), f"--checkpoint {path}", new_head=False)
        best = evaluate(model, batches, task, cfg, info, amp_dtype, process).metrics[task.MAIN_METRIC]
        load_weights(model, {"model": averaged_weights([e["state"] for e in kept])}, len(info.names),
                     "the averaged weights", new_head=False)
        recompute_batchnorm(model, splits.train)
        result = evaluate(model, batches, task, cfg, info, amp_dtype, process).metrics[task.MAIN_METRIC]
    steps = ", ".join(str(e["step"]) for e in kept)
    print(*([note] if note else []), f"the average of the {len(kept)} kept checkpoints (steps {steps}): "
          f"{cfg.split} {task.MAIN_METRIC} {result:.4g}, beside {path.name}'s {best:.4g}", sep="\n")
    if cfg.average != "measure":  # --average FILE: the averaged model, as a checkpoint evaluate.py takes
        drop = ("optimizer", "scheduler", "scaler", "rng", "run", "unlogged", "trackers", "kept", "ema")
        keep = {k: v for k, v in ckpt.items() if k not in drop}
        checkpoints.write_checkpoint({**keep, "model": model.state_dict(), "averaged": {
            "files": [e["file"] for e in kept], "steps": [e["step"] for e in kept]}}, cfg.average)
        print(f"wrote {cfg.average}")


def opened(cfg: Config, given: dict, task) -> tuple[Config, dict, Path, bool]:
    """--checkpoint loaded (checked against task.py where it is train.py's), and the config its model and
    data are built with: its run's, or for a plain state_dict the flags'; its path, whether it is ours."""
    path = Path(cfg.checkpoint)
    if not path.is_file():
        raise UserError(f"--checkpoint {path}: no such file (a best.pt, last.pt or state_dict); train first "
                        "or pass --checkpoint PATH")
    ckpt = checkpoints.load_checkpoint(path)
    ours = isinstance(ckpt.get("config"), dict)  # else a plain state_dict: no task to check, cfg as given
    if ours and (edited := checkpoints.check_task(ckpt, path, task, "evaluate it with its own task.py")):
        print(edited)
    cfg = evaluated_config(cfg, given, ckpt["config"], CHOICES) if ours else validate(cfg, CHOICES)
    return cfg, ckpt, path, ours


def training_images_in(split: str, saved: dict, info, *, own: bool) -> str | None:
    """How many of `split`'s images are among the training images of the run whose data record is `saved`
    (by the digests of their pixels, whatever their files' names), said where any are, or where the split
    is not the run's own (`own`: its --data-dir, and the same files); where it cannot be told, why."""
    trained, mine = saved.get("train_digests"), (info.digests or {}).get(split)
    own = own and split not in checkpoints.changed_files(saved, info.data_record())
    size = info.sizes()[f"{split}_size"]
    if trained is None or mine is None:
        read = "the run read its files" if trained is None else "these files are read"
        return None if own or not info.files else (
            f"--split {split}: {size} images other than the run's own {split} files; whether any is one of "
            f"its training images cannot be told ({read} every epoch by DataLoader workers: no digests kept)")
    shared = int(torch.isin(mine, trained).sum())
    whose = f"the run's own {split} files" if own else f"--split {split}"
    if shared:
        return (f"{whose}: {shared} of its {size} images are among the run's {len(trained)} training images "
                "(the same pixels, whatever their names): its score counts images the model trained on")
    return None if own else (f"--split {split}: {size} images, none of them among the run's {len(trained)} "
                             "training images (compared by their pixels)")


def chosen_split(splits, cfg: Config):
    if cfg.split == "test" and splits.test is None:
        raise UserError(f"--split test: {cfg.dataset} here has no test split (imagefolder: a test/ "
                        "folder beside train/ and val/; csv: a test.csv); use --split val")
    return splits.test if cfg.split == "test" else splits.val


@torch.no_grad()
def predict(cfg: Config, given: dict, task=default_task) -> None:
    """--predict PATH: each image through a saved model, read as its run read its own (the checkpoint
    keeps how), one row each from the task, in predictions.csv next to the checkpoint (or in an
    --out-dir `given` here). The outputs stay on the device until the last batch: one read in all."""
    path = Path(cfg.checkpoint)
    ckpt = checkpoints.load_predictor(path, task)
    cfg = evaluated_config(cfg, given, ckpt["config"])  # built as it was trained
    device, names = processes.pick_device(cfg.device, cfg.deterministic), ckpt["data"]["names"]
    reading = ckpt["inputs"]["reading"]  # how the run read its images
    size, unflipped = (reading["size"],) * 2, getattr(task, "unflipped_outputs", None)  # optional
    back = unflipped and (lambda mirrored: unflipped(mirrored, size))  # --tta flip: a mirror's outputs back
    moves = hasattr(task, "augmented_targets") or bool(getattr(task, "TARGETS_MOVE_WITH_IMAGES", False))
    batches, files, skipped = prediction_batches(cfg, Path(cfg.predict), reading, device)
    model = build_model(cfg, reading["channels"], len(names), device, fresh=False).eval()
    load_weights(model, ckpt, len(names), f"--checkpoint {path}", new_head=False)
    amp_dtype, outputs = amp_setup(device, cfg.amp)[0], []
    try:
        with logs.progress_bar(len(batches), 0, "predict") as bar:
            for images, _ in batches.epoch(0):
                with autocast(device, amp_dtype):
                    outputs.append(predicted(model, images, cfg.tta, back, moves=moves))
                bar.update()
    except UnreadableImage as err:
        line = re.sub(r" \(class folder '.*?'\)", "", str(err))  # these files are of no class
        raise UnreadableImage(f"--predict: {line}; move it away, or list the others in a CSV") from None
    finally:
        batches.close()  # its workers stop now, not when the traceback's frames go
    header, rows = task.predictions(torch.cat(outputs).cpu(), names, cfg.top_k)
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    reports.write_predictions(out_dir / "predictions.csv", header, rows, files, skipped, cfg.tta)


def export(cfg: Config, given: dict, task=default_task) -> None:
    """--export FILE (.onnx or .pt2): the model in --checkpoint as one file another runtime loads, the
    steps its inputs got inside (it takes uint8 images as --predict reads them), made and checked on the
    CPU against the PyTorch model on --split's first examples; kept only if they agree."""
    target = Path(cfg.export)
    with staged(target) as path:  # the suffix, the packages and the folder checked first
        cfg, ckpt, checkpoint, _ = opened(cfg, given, task)
        splits, info, model = setup(cfg, task, torch.device("cpu"), fresh=False, trains=False)
        with splits:
            batches = chosen_split(splits, cfg)
            checkpoints.check_classes(ckpt, checkpoint, info.names, "export it with the data it was trained "
                                      "on")
            load_weights(model, ckpt, len(info.names), f"--checkpoint {checkpoint}", new_head=False)
            metadata = {"names": info.names, "task": task.NAME, "checkpoint": str(checkpoint),
                        "step": ckpt.get("step"), **({"images": info.reading} if info.reading else {})}
            said = export_model(model.eval(), batches, path, metadata, classes=task.TARGETS == "classes")
    print(f"{target}: {said}")


def predicted(model: torch.nn.Module, images: torch.Tensor, tta: str, unflipped=None, *,
              moves: bool = False) -> torch.Tensor:
    """A batch's outputs; --tta flip averages in the mirror images', mapped back by `unflipped` (the task's
    unflipped_outputs) or, per-pixel outputs, flipped back, so that each pixel's output meets its own. Other
    outputs are averaged as they are, unless the task `moves` its targets with flips: then it is refused."""
    outputs = model(images).float()
    if tta != "flip":
        return outputs
    mirrored = model(images.flip(-1)).float()
    if unflipped is not None:
        mirrored = unflipped(mirrored).float()
    elif mirrored.ndim > 2 and mirrored.shape[-1] == images.shape[-1]:  # a map over the image's columns
        mirrored = mirrored.flip(-1)
    elif moves:  # points, boxes: a mirror image's are elsewhere, and its left is the image's right
        raise UserError("--tta flip averages each image's outputs with its mirror image's, and task.py moves "
                        "its targets with flips (augmented_targets, or TARGETS_MOVE_WITH_IMAGES = True) but "
                        "does not say how a mirror image's outputs map back: define "
                        "unflipped_outputs(outputs, size) in task.py (docs/your_data.md), or leave --tta off")
    return (outputs + mirrored) / 2


def prediction_batches(cfg: Config, path: Path, reading: dict, device: torch.device) -> tuple:
    """Images a model never saw (a file, a folder's searched recursively, or a CSV's first column), read
    as its run read its own (`reading`: its DataInfo.reading, which its checkpoint keeps); files; skipped."""
    if not path.exists():
        raise UserError(f"--predict {named(path)}: no such file or folder (an image, a folder, a CSV)")
    listed, notes = path.suffix.lower() == ".csv", []  # a CSV's rows name the images: taken as they are
    if listed:
        found, broken = [file for file, _ in csv_rows(path.parent, path.name, notes, labels=False)], []
    else:
        found, broken = files_under(path) if path.is_dir() else ([path], [])
    files = [p for p in found if listed or p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        what = "is not an image file" if path.is_file() else "holds no image files"
        raise UserError(f"--predict {named(path)}: {what} ({', '.join(IMAGE_SUFFIXES)})")
    said = [f"{len(what)} skipped ({why}: {', '.join(named(p.relative_to(path)) for p in what[:3])}"
            f"{', ...' if len(what) > 3 else ''})" for why, what in (
                ("not image files", [p for p in found if p not in files]), ("broken links", broken)) if what]
    skipped = "; ".join(said + [note.removeprefix("csv: ") for note in notes])
    steps = ImageSteps(torch.tensor(reading["mean"]), torch.tensor(reading["std"]),
                       channels_last=cfg.channels_last, resize=reading["resize"])
    source = ImageFiles([(f, 0) for f in files], reading["size"], reading["channels"], path)
    serving = Serving(cfg.batch_size, device, cfg.seed, num_workers=workers.count(cfg.num_workers, device))
    return Batches(source, None, serving, train=False, image=steps), files, skipped


def files_under(folder: Path) -> tuple[list[Path], list[Path]]:
    """The files in `folder` and below, sorted, links followed as training's reader follows them (each real
    folder once, so a link loop ends); and the broken links."""
    found, broken, seen = [], [], set()
    for top, folders, names in os.walk(folder, followlinks=True):
        if (real := os.path.realpath(top)) in seen:
            folders.clear()
            continue
        seen.add(real)
        for name in names:
            (found if os.path.isfile(os.path.join(top, name)) else broken).append(Path(top, name))
    return sorted(found), sorted(broken)


def load_trained(path: str | Path, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The model in a train.py checkpoint, for your own code: built as it was trained, its weights
    loaded, in eval mode on `device`; and the checkpoint, whose "data" names the outputs ("names") and
    whose "inputs" says what the model takes ("shape", "dtype", and for images how they were read)."""
    ckpt = checkpoints.load_checkpoint(path)
    if not (isinstance(ckpt.get("config"), dict) and isinstance(ckpt.get("inputs"), dict)):
        raise UserError(f"{path} is not a checkpoint of this train.py (it records no config or inputs)")
    cfg = Config(**{k: v for k, v in ckpt["config"].items() if k in Config.__dataclass_fields__})
    names = ckpt["data"]["names"]
    model = build_model(cfg, ckpt["inputs"]["shape"][0], len(names), device, fresh=False)
    load_weights(model, ckpt, len(names), str(path), new_head=False)
    return model.eval(), ckpt


DESCRIPTION = ("Use a saved model: a split once through it (eval.json), --predict files with it, or --export "
               "it. A train.py checkpoint brings its model and data settings; --dataset to --width are for a "
               "plain state_dict.")


def main() -> None:
    with stops.one_line("; nothing was written: run the command again", program=__name__ == "__main__"):
        given = parse_given(description=DESCRIPTION, choices=CHOICES, offered=EVALUATE_SETTINGS,
                            elsewhere="evaluate.py trains nothing, and builds a checkpoint's model and data "
                            "as its run did (--help lists what it takes)")
        cfg = Config(**given)
        if cfg.predict and cfg.export:
            raise UserError("--predict and --export are two commands: give one of them")
        if cfg.average and (cfg.predict or cfg.export):
            raise UserError("--average is a command of its own: give it without --predict and --export")
        (export if cfg.export else predict if cfg.predict else average if cfg.average else
         evaluate_checkpoint)(cfg, given)


if __name__ == "__main__":
    main()
