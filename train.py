"""Train an image classifier: `python train.py [--config configs/X.toml] [--field value ...]`.

Read top to bottom: config -> data -> model and optimizer -> schedule -> (resume) -> loop ->
evaluate each epoch -> checkpoint -> summary. Multi-GPU: `torchrun --nproc_per_node=N train.py`.
`python train.py --evaluate runs/x/best.pt` measures a checkpoint on the validation split instead.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from contextlib import closing, contextmanager, nullcontext, suppress
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import runtime
from configs import (
    Config,
    UserError,
    check_resumable,
    exit_with_error,
    parse_given,
    resolve_lr,
    resumed_config,
    validate,
)
from data import UnreadableImage, build_loaders
from lr_find import capture_rng_state, restore_rng_state
from models import build_model, build_optimizer, load_weights, weights_of
from schedules import build_scheduler, epochs_to_steps, optimizer_step, safe_pct_start, steps_per_epoch

# What --evaluate takes from its command line; the model and data settings come from the checkpoint.
EVALUATE_FROM_FLAGS = ("data_dir", "device", "batch_size", "num_workers", "loader", "amp", "out_dir")
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "epoch", "batch", "step", "rng", "config")
SECONDS_COVER = ("seconds: this process's training loop, evaluation and checkpoints included, start-up "
                 "not; total_seconds: the same over every part of the run")
RESUMED_COVER = ("this run was resumed: total_seconds adds each earlier part's time up to the checkpoint "
                 "the next part resumed from (time after a part's last save was lost)")
# A logged training loss above this multiple of the run's first batch loss is not coming back
# (lr_find.py stops its sweep at the same factor over its best loss).
DIVERGENCE_FACTOR = 4.0


def find_lr(cfg: Config, model: torch.nn.Module, batches, amp_dtype, scaler, device: torch.device,
            is_main: bool, world_size: int, say) -> float:
    """--lr find: lr_find.py's range test on this model and data, which it restores bit for bit.

    Under torchrun rank 0 sweeps alone while the others wait for the rate: it accumulates
    world_size of its batches per step, so each step sees the global batch as DDP will. All ranks
    sweeping together would need the stop rule agreed at every step; one rank keeps lr_find as it is.
    """
    found = problem = None
    if is_main:
        import lr_find  # only here: train.py needs lr_find.py for --lr find alone

        optimizer = build_optimizer(model, cfg, cfg.find_start_lr)  # the sweep's; training builds its own
        stream = (batch for epoch in itertools.count() for batch in batches.epoch(epoch))
        loss_fn = functools.partial(F.cross_entropy, label_smoothing=cfg.label_smoothing)
        try:
            with closing(stream), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = lr_find.lr_find(
                    model, optimizer, loss_fn, stream, start_lr=cfg.find_start_lr, end_lr=cfg.find_end_lr,
                    num_iter=cfg.find_iters, accum_steps=cfg.accum_steps * world_size,
                    autocast_dtype=amp_dtype, scaler=scaler, device=device, schedule=cfg.schedule,
                    method=None if cfg.find_method == "auto" else cfg.find_method)
            with runtime.reporting_write_errors(cfg.out_dir):
                wrote = lr_find.save_sweep(result, cfg.to_dict(), cfg.out_dir)
            found = result.suggestion
            if found is None:
                why = "; ".join(str(w.message) for w in caught) or "no usable points"
                problem = (f"the range test suggested no learning rate ({why}); look at {wrote[-1]}, "
                           "widen --find-start-lr/--find-end-lr or raise --find-iters, or pass --lr N")
        except ValueError as err:  # lr_find's checks of its arguments; UserError included
            problem = f"--lr find: {err}"
        if found is not None:
            alone = f"; rank 0 alone, {world_size}x its batches per step" if world_size > 1 else ""
            say(f"lr find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
                f"{result.stop_reason}{alone}; suggested lr {found:.4g} ({result.method}); wrote "
                f"{', '.join(str(path) for path in wrote)}")
    found, problem = runtime.from_rank0((found, problem))
    if problem:
        raise UserError(problem)
    return found


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, batches: int):
    """The schedule in optimizer steps, from a config written in epochs."""
    total = steps_per_epoch(batches, cfg.accum_steps) * cfg.epochs
    options = {}
    if cfg.schedule == "onecycle":
        options = dict(pct_start=safe_pct_start(cfg.pct_start, total), div_factor=cfg.div_factor,
                       final_div_factor=cfg.final_div_factor)
    elif cfg.schedule == "step":
        every = cfg.step_size or max(cfg.epochs / 3, 1)
        options = dict(step_size=max(epochs_to_steps(every, batches, cfg.accum_steps), 1),
                       gamma=cfg.gamma)
    elif cfg.schedule == "cosine":
        options = dict(min_lr_ratio=cfg.min_lr_ratio)
    warmup = epochs_to_steps(cfg.warmup_epochs, batches, cfg.accum_steps)
    if warmup >= total:
        raise UserError(f"warmup_epochs {cfg.warmup_epochs} covers the whole run of "
                        f"{cfg.epochs} epochs; lower it")
    if cfg.schedule != "onecycle":
        options["warmup_steps"] = warmup
    try:
        return build_scheduler(optimizer, cfg.schedule, total, **options), total
    except ValueError as err:  # schedules.py checks its inputs; here that is a config problem
        raise UserError(f"the {cfg.schedule} schedule does not fit this run of {total} optimizer "
                        f"steps: {err}; change its options or --epochs") from None


def check_checkpoint(ckpt: dict, path: Path) -> None:
    """Refuse, in one line, a file that is not a train.py checkpoint or holds nan/inf weights."""
    missing = [key for key in CHECKPOINT_KEYS if key not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} lacks {', '.join(missing)}: not a train.py checkpoint")
    if not (isinstance(ckpt["model"], dict) and isinstance(ckpt["config"], dict)):
        raise UserError(f"checkpoint {path} is not a train.py checkpoint (model or config is not a dict)")
    tensors = [t for t in ckpt["model"].values() if isinstance(t, torch.Tensor)]
    if not runtime.all_finite(tensors):
        raise UserError(f"checkpoint {path} holds nan or inf weights (a diverged run); start a new "
                        "run with a lower --lr")


def position(epoch: int, batch: int, epochs: int, batches: int) -> str:
    """Where a checkpoint continues, counted from 1 as the progress lines count."""
    if epoch >= epochs:
        return "the run was already complete"
    if batch >= batches:
        return f"epoch {epoch + 1}/{epochs} trained, its evaluation next"
    return f"epoch {epoch + 1}/{epochs} at batch {batch + 1}/{batches}"


def divergence(train_loss: float, start_loss: float) -> str | None:
    """What says this logged training loss diverged, or None."""
    if not math.isfinite(train_loss):
        return f"train loss {train_loss}"
    if start_loss > 0 and train_loss > DIVERGENCE_FACTOR * start_loss:
        return f"train loss {train_loss:.4g}, over {DIVERGENCE_FACTOR:g}x the first batch's {start_loss:.4g}"
    return None


def checkpoint_bytes(model: torch.nn.Module, cfg: Config) -> int:
    """About the size of last.pt: the weights plus the optimizer's copies (momentum; AdamW's two)."""
    weights = sum(t.nbytes for t in model.state_dict().values())
    return weights * (1 + (2 if cfg.optimizer == "adamw" else int(cfg.momentum > 0)))


def problem_of(check, *args) -> str | None:
    """A check's UserError as text (None if it passed), for rank 0 to decide and all ranks to follow."""
    try:
        check(*args)
    except UserError as err:
        return str(err)
    return None


def unfinished_run(path: Path) -> str | None:
    """Why a fresh run must not replace this checkpoint (an unfinished run's), or None."""
    if not path.is_file():
        return None
    try:
        saved = runtime.load_checkpoint(path)
    except UserError:
        return None  # unreadable, so there is nothing to continue
    if saved.get("step", 0) < saved.get("total_steps", 0):
        return (f"{path} holds an unfinished run (step {saved['step']} of {saved['total_steps']}); "
                "continue it with --resume, or pick another --out-dir, or delete the file to start over")
    return None


@torch.no_grad()
def evaluate(model, batches, device, amp_dtype, num_classes: int) -> runtime.Evaluation:
    """One pass over the validation split: loss, confusion matrix and the most confidently wrong
    images, kept on the device and read once at the end."""
    model.eval()
    tally = runtime.Tally(num_classes, device)
    for inputs, targets in batches.epoch(0):
        with runtime.autocast(device, amp_dtype):
            logits = model(inputs)
        tally.add(logits, targets, inputs)
    model.train()
    return tally.result()


def evaluate_checkpoint(cfg: Config, given: dict | None = None) -> dict:
    """--evaluate PATH: the validation split once through a saved model. Trains nothing; writes
    eval.json and eval_confusion.png next to the checkpoint (or into an --out-dir given here).
    `given`: the settings the command line gave (None: all of cfg's)."""
    given = cfg.to_dict() if given is None else given
    path = Path(cfg.evaluate)
    if not path.is_file():
        raise UserError(f"--evaluate {path}: no such file (a best.pt, last.pt or state_dict)")
    ckpt = runtime.load_checkpoint(path)
    if isinstance(ckpt.get("config"), dict):  # ours: built as it was trained, run where asked
        saved = {k: v for k, v in ckpt["config"].items() if k in Config.__dataclass_fields__}
        here = {k: given[k] for k in EVALUATE_FROM_FLAGS if k in given}
        cfg = Config(**{**saved, **here, "resume": "", "init_from": "", "evaluate": str(path)})
    validate(cfg)
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    rank, world_size, device = runtime.setup_distributed(cfg.device)
    _, val_batches, info = build_loaders(cfg, device, rank, world_size)
    model = build_model(cfg, info.channels, info.num_classes, device)
    load_weights(model, weights_of(ckpt), info.num_classes, f"--evaluate {path}", new_head=False)
    result = evaluate(model, val_batches, device, runtime.amp_dtype(device, cfg.amp), info.num_classes)
    names = info.class_names
    report = {"checkpoint": str(path), "step": ckpt.get("step"), "dataset": cfg.dataset,
              "val_size": info.val_size, "val_acc": result.acc, "val_loss": result.loss,
              "per_class_acc": dict(zip(names, result.per_class_acc, strict=True)),
              "confusion": result.confusion}
    if rank == 0:
        print(f"{path} on the {info.val_size} {cfg.dataset} validation images: val acc {result.acc:.2%}  "
              f"val loss {result.loss:.4f}")
        for name, acc in report["per_class_acc"].items():
            print(f"  {name:>12}  {'no images' if acc is None else f'{acc:.2%}'}")
        runtime.write_json_atomic(out_dir / "eval.json", report)
        runtime.write_png_atomic(out_dir / "eval_confusion.png",
                                 runtime.confusion_picture(result.confusion, names))
        print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval_confusion.png'}")
    return report


class StopFlag:
    """SIGINT/SIGTERM only set a flag; the loop saves a checkpoint at the next optimizer step."""

    def __init__(self):
        self.signal = 0
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._set)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _set(self, signum, frame):
        if self.signal:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.signal = signum

    def agreed(self, device: torch.device) -> bool:
        """Under torchrun every rank must stop at the same step, so the flag is all-reduced."""
        if not runtime.is_distributed():
            return bool(self.signal)
        return runtime.all_reduce_sum(torch.tensor([float(self.signal)], device=device)).item() > 0


def main() -> None:
    try:
        given = parse_given(description=__doc__.splitlines()[0])
        cfg = Config(**given)
        if cfg.evaluate:
            evaluate_checkpoint(cfg, given)
            return
        if not cfg.resume:  # a resume checks its config once the checkpoint's fills the gaps
            validate(cfg)
        train(cfg, given)
    except UserError as err:
        # Under torchrun, one line from one process; a file only one rank read, from that rank.
        if os.environ.get("RANK", "0") == "0" or isinstance(err, UnreadableImage):
            exit_with_error(str(err))
        raise SystemExit(2) from None
    finally:
        runtime.cleanup_distributed()


def train(cfg: Config, given: dict | None = None) -> dict:
    """One training run. Resuming, the checkpoint's config is used with `given` (the settings the
    command line gave) on top; given None means every field of cfg counts as given."""
    ckpt = None
    if cfg.resume:
        path = Path(cfg.out_dir) / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
        ckpt = runtime.load_checkpoint(path)
        check_checkpoint(ckpt, path)
        cfg = resumed_config(ckpt["config"], cfg.to_dict() if given is None else given, path)
        check_resumable(ckpt["config"], cfg)
    rank, world_size, device = runtime.setup_distributed(cfg.device)
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(cfg.out_dir)
    lr = resolve_lr(cfg, say)
    problem = runtime.from_rank0(problem_of(runtime.check_writable_dir, out_dir) if is_main else None)
    if problem:  # found before any data is loaded or any step is trained
        raise UserError(problem)
    problem = None if ckpt else runtime.from_rank0(unfinished_run(out_dir / "last.pt") if is_main else None)
    if problem:
        raise UserError(problem)
    torch.manual_seed(cfg.seed)

    train_batches, val_batches, info = build_loaders(cfg, device, rank, world_size)
    batches = len(train_batches)
    model = build_model(cfg, info.channels, info.num_classes, device)
    amp_dtype, scaler = runtime.amp_setup(device, cfg.amp)
    if lr is None:
        lr = find_lr(cfg, model, train_batches, amp_dtype, scaler, device, is_main, world_size, say)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, batches)
    needed = checkpoint_bytes(model, cfg)
    problem = runtime.from_rank0(
        problem_of(runtime.check_free_space, out_dir, needed, "a checkpoint") if is_main else None)
    if problem:
        raise UserError(problem)

    start_epoch, start_batch, step, best_acc = 0, 0, 0, 0.0
    start_loss = None  # the run's first batch loss, the yardstick for divergence
    first_loss = None  # the same, kept on the device until the first log point reads it
    seconds_before, part = 0.0, 1  # training time of earlier parts of this run, up to their last save
    if ckpt:
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            if scaler is not None and ckpt.get("scaler"):
                scaler.load_state_dict(ckpt["scaler"])
            restore_rng_state(ckpt["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            raise UserError(f"checkpoint {path} does not fit this model and optimizer ({first}); "
                            "resume it with the settings it was written with, or start a new run") from None
        start_epoch, start_batch, step = ckpt["epoch"], ckpt["batch"], ckpt["step"]
        best_acc = ckpt.get("best_val_acc", 0.0)
        start_loss = ckpt.get("start_loss") or math.inf  # older checkpoints: only nan/inf count
        seconds_before, part = ckpt.get("seconds", 0.0), ckpt.get("part", 1) + 1
        say(f"resumed from {path} at step {step} "
            f"({position(start_epoch, start_batch, cfg.epochs, batches)})")

    fast = torch.compile(model) if cfg.compile else model
    net = fast
    if world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            fast, device_ids=[device.index] if device.type == "cuda" else None)

    # Where last.pt would continue from right now (after the last optimizer step), and what it holds.
    done = saved_at = (start_epoch, start_batch)
    saved_step = step if ckpt else None
    to_continue = shlex.join(["python", "train.py", "--resume", "--out-dir", str(out_dir)]) + (
        " (under torchrun, with those flags)" if world_size > 1 else "")

    def checkpoint(epoch: int, batch: int, name: str = "last.pt") -> None:
        nonlocal saved_at, saved_step, start_loss
        if not runtime.all_finite(runtime.unwrap(model).state_dict().values()):
            raise diverged("the weights hold nan or inf", optimizer.param_groups[0]["lr"])
        if start_loss is None and first_loss is not None:  # saving syncs anyway
            start_loss = first_loss.item()
        if is_main:
            runtime.save_checkpoint({
                "model": runtime.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "epoch": epoch, "batch": batch, "step": step, "total_steps": total_steps,
                "best_val_acc": best_acc, "start_loss": start_loss,
                "seconds": seconds_before + time.perf_counter() - started, "part": part,
                "rng": capture_rng_state(), "config": {**cfg.to_dict(), "lr": lr},
            }, out_dir / name)
        if name == "last.pt":
            saved_at, saved_step = (epoch, batch), step

    def diverged(what: str, at_lr: float) -> UserError:
        kept = (f"{out_dir / 'last.pt'} still holds step {saved_step}" if saved_step is not None
                else "this run wrote no checkpoint")
        return UserError(f"training diverged at step {step} ({what}; lr {at_lr:.3g}): try a lower "
                         f"--lr than {lr:.3g}, e.g. --lr {lr / 10:.2g}, or `python lr_find.py` with the "
                         f"same options to find one; {kept}")

    @contextmanager
    def saved_if_a_file_is_unreadable():
        """An image that cannot be decoded stops the run as SIGTERM does: save last.pt, then say which."""
        try:
            yield
        except UnreadableImage as err:
            if done != saved_at:
                checkpoint(*done)
            then = ("nothing was trained yet; replace or delete it and run again" if saved_step is None
                    else f"{out_dir / 'last.pt'} holds step {saved_step}; replace or delete it, then "
                    f"continue with `{to_continue}`")
            raise UnreadableImage(f"{err}; {then}") from None

    def tensorboard():
        return runtime.reporting_write_errors(out_dir, f"TensorBoard logs in {out_dir}")

    @contextmanager
    def writer_closed_on_error():
        """Flush what TensorBoard has (the loss curve of a diverged run, say) however the run ends."""
        try:
            yield
        except BaseException:
            if writer:
                with suppress(OSError):
                    writer.close()
            raise

    writer = moved = None
    if is_main:
        runtime.write_json_atomic(out_dir / "config.json", {**cfg.to_dict(), "lr": lr})
        runtime.quiet_tensorboard_thread()
        with tensorboard():
            writer, moved = runtime.summary_writer(out_dir, step if cfg.resume else None)
    names = info.class_names
    params = sum(p.numel() for p in model.parameters())
    say(f"{cfg.dataset}: {info.train_size} train / {info.val_size} val, {info.channels}x"
        f"{info.image_size}x{info.image_size}, {info.num_classes} classes, via {info.loader}")
    for note in info.notes:
        say(note)
    if moved:
        say(f"TensorBoard logs of the earlier run in {out_dir} moved to {moved}")
    say(f"{cfg.model} ({params / 1e6:.2f}M params) on {device}"
        f"{f' x{world_size} processes' if world_size > 1 else ''}, amp {amp_dtype or 'off'}, "
        f"{cfg.schedule} schedule, lr {lr:.4g}, {total_steps} optimizer steps")

    val_loss = val_acc = float("nan")
    val = None
    epoch_rates, started = [], time.perf_counter()
    with StopFlag() as stop, writer_closed_on_error(), saved_if_a_file_is_unreadable():
        for epoch in range(start_epoch, cfg.epochs):
            net.train()
            bar = tqdm(total=batches, initial=start_batch, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       disable=not (is_main and sys.stdout.isatty()), leave=False)
            loss_sum = torch.zeros((), device=device)
            loss_count, stopping = 0, False
            epoch_start = time.perf_counter()
            images_this_epoch = 0
            for i, (inputs, targets) in enumerate(train_batches.epoch(epoch, start_batch), start_batch):
                group_start = i - i % cfg.accum_steps
                group_size = min(cfg.accum_steps, batches - group_start)
                steps_now = i + 1 == group_start + group_size
                sync = nullcontext() if steps_now or world_size == 1 else net.no_sync()
                with sync:
                    with runtime.autocast(device, amp_dtype):
                        loss = F.cross_entropy(net(inputs), targets, label_smoothing=cfg.label_smoothing)
                    scaled = loss / group_size if group_size > 1 else loss
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                loss_sum += loss.detach()
                loss_count += 1
                if first_loss is None:
                    first_loss = loss.detach()
                    if writer and step == 0:  # once: the first batch as the model received it
                        with tensorboard():
                            shown = slice(runtime.INPUTS_SHOWN)
                            runtime.log_inputs(writer, train_batches.denormalize(inputs[shown]),
                                               targets[shown], names, step)
                images_this_epoch += len(targets) * world_size
                if not steps_now:
                    continue
                step_lr = optimizer.param_groups[0]["lr"]
                optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad or None)
                optimizer.zero_grad(set_to_none=True)
                step += 1
                done = (epoch, i + 1)
                if writer:  # the lr is a host-side number: logging it every step costs no device sync
                    with tensorboard():
                        writer.add_scalar("train/lr", step_lr, step)
                if step % cfg.log_every == 0 or i + 1 == batches:
                    if start_loss is None:  # read together with the first logged loss: one transfer
                        train_loss, start_loss = torch.stack([loss_sum / loss_count, first_loss]).tolist()
                    else:
                        train_loss = (loss_sum / loss_count).item()
                    loss_sum.zero_()
                    loss_count = 0
                    if writer:
                        with tensorboard():
                            writer.add_scalar("train/loss", train_loss, step)
                    why = divergence(train_loss, start_loss)
                    if runtime.any_rank(why is not None, device):
                        raise diverged(why or "the loss diverged on another process", step_lr)
                    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{step_lr:.3g}", refresh=False)
                    bar.update(i + 1 - bar.n)
                    stopping = world_size > 1 and stop.agreed(device)
                stopping = stopping or (world_size == 1 and bool(stop.signal))
                if stopping or (cfg.save_every and step % cfg.save_every == 0):
                    checkpoint(epoch, i + 1)
                if stopping:
                    say(f"interrupted at step {step}; saved {out_dir / 'last.pt'}; continue with "
                        f"`{to_continue}`")
                    raise SystemExit(128 + (stop.signal or signal.SIGTERM))
            bar.close()
            runtime.sync_buffers(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - epoch_start
            if images_this_epoch:  # a run resumed at an epoch's very end trained nothing here
                epoch_rates.append(images_this_epoch / max(seconds, 1e-9))
            start_batch = 0
            done = (epoch, batches)
            val = evaluate(fast, val_batches, device, amp_dtype, info.num_classes)
            val_loss, val_acc = val.loss, val.acc
            improved = val_acc > best_acc
            best_acc = max(best_acc, val_acc)
            if writer:
                with tensorboard():
                    writer.add_scalar("val/loss", val_loss, step)
                    writer.add_scalar("val/acc", val_acc, step)
                    runtime.log_evaluation(writer, val, names, val_batches.denormalize, step)
            rate = f"  ({epoch_rates[-1]:,.0f} img/s)" if images_this_epoch else ""
            say(f"epoch {epoch + 1}/{cfg.epochs}  step {step}  val loss {val_loss:.4f}  "
                f"val acc {val_acc:.2%}{rate}")
            if not math.isfinite(val_loss):
                raise diverged(f"val loss {val_loss} after epoch {epoch + 1}",
                               optimizer.param_groups[0]["lr"])
            checkpoint(epoch + 1, 0)
            done = (epoch + 1, 0)
            if improved:
                checkpoint(epoch + 1, 0, "best.pt")

    steady = epoch_rates[1:] or epoch_rates  # the first epoch pays for warm-up and compilation
    seconds = time.perf_counter() - started
    summary = {"val_acc": val_acc, "val_loss": val_loss, "best_val_acc": best_acc,
               "epochs": cfg.epochs, "steps": step, "seconds": seconds,
               "total_seconds": seconds_before + seconds, "parts": part,
               "seconds_cover": SECONDS_COVER if part == 1 else f"{SECONDS_COVER}; {RESUMED_COVER}",
               "images_per_second": sum(steady) / len(steady) if steady else math.nan,
               "lr": lr, "world_size": world_size, "device": str(device),
               "ranks_in_sync": runtime.ranks_agree(model),
               "per_class_acc": dict(zip(names, val.per_class_acc, strict=True)) if val else None}
    if writer:
        hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)}
        with tensorboard():
            runtime.log_hparams(writer, {**hparams, "lr": lr}, ("val/acc", "val/loss"))
            writer.flush()  # raises what the writer thread met; close() would drop it
            writer.close()
        if val:
            picture = runtime.confusion_picture(val.confusion, names)
            runtime.write_png_atomic(out_dir / "confusion.png", picture)
        runtime.write_json_atomic(out_dir / "summary.json", summary)
        total = f" ({seconds_before + seconds:.1f}s over {part} parts)" if part > 1 else ""
        say(f"done: val acc {val_acc:.2%} (best {best_acc:.2%}) in {seconds:.1f}s{total}; "
            f"logs and checkpoints in {out_dir}")
    return summary


if __name__ == "__main__":
    main()
