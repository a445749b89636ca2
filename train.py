"""Train an image classifier: `python train.py [--config configs/X.toml] [--field value ...]`.

Read top to bottom: config -> data -> model and optimizer -> schedule -> (resume) -> loop ->
evaluate each epoch -> checkpoint -> summary. Multi-GPU: `torchrun --nproc_per_node=N train.py`.
`python train.py --evaluate runs/x/best.pt` measures a checkpoint on the validation split instead.
What surrounds the loop (checkpoint files, torchrun agreement, TensorBoard) is in runtime.py.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import runtime
from configs import Config, UserError, evaluated_config, exit_with_error, parse_given, resolve_lr, validate
from data import UnreadableImage, build_loaders
from models import build_model, build_optimizer, load_weights, weights_of
from schedules import build_scheduler, epochs_to_steps, optimizer_step, safe_pct_start, steps_per_epoch


def train(cfg: Config, given: dict | None = None) -> dict:
    """One training run. Resuming, the checkpoint's config is used with `given` (the settings the
    command line gave) on top; given None means every field of cfg counts as given."""
    # Setup. A resume continues with the checkpoint's config, checked against what was given now.
    ckpt = None
    if cfg.resume:
        ckpt, path, cfg = runtime.load_resume(cfg, given)
    rank, world_size, device = runtime.setup_distributed(cfg.device)
    is_main = rank == 0  # rank 0 alone prints, logs and saves
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(cfg.out_dir)
    lr = resolve_lr(cfg, say)  # a number (--lr auto: lr_find.json's); None: --lr find, below
    # An unwritable --out-dir, or one holding an unfinished run, is refused before any data is loaded.
    runtime.on_rank0(runtime.check_writable_dir, out_dir)
    if not ckpt:
        runtime.on_rank0(runtime.refuse_unfinished_run, out_dir / "last.pt")
    torch.manual_seed(cfg.seed)

    # Data, model, optimizer and schedule, built as lr_find.py builds them.
    train_batches, val_batches, info = build_loaders(cfg, device, rank, world_size)
    batches, names = len(train_batches), info.class_names
    model = build_model(cfg, info.channels, info.num_classes, device)
    amp_dtype, scaler = runtime.amp_setup(device, cfg.amp)
    if lr is None:  # --lr find: the range test on this model and data, which it leaves as it found them
        sweep_optimizer = build_optimizer(model, cfg, cfg.find_start_lr)
        lr = runtime.find_lr(cfg, model, sweep_optimizer, train_batches, amp_dtype, scaler, device)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, batches)
    runtime.on_rank0(runtime.check_free_space, out_dir, runtime.checkpoint_bytes(model, cfg), "a checkpoint")

    # Resume: every state as it was saved (the RNGs' too), and where the run stood.
    start_epoch, start_batch, step, best_acc = 0, 0, 0, 0.0
    start_loss = None  # the run's first batch loss, the yardstick for divergence
    seconds_before, part = 0.0, 1  # training time of this run's earlier parts, up to their last save
    if ckpt:
        runtime.restore_training_state(ckpt, path, model, optimizer, scheduler, scaler)
        start_epoch, start_batch, step = ckpt["epoch"], ckpt["batch"], ckpt["step"]
        best_acc = ckpt.get("best_val_acc", 0.0)
        start_loss = ckpt.get("start_loss") or math.inf  # older checkpoints: only nan/inf count
        seconds_before, part = ckpt.get("seconds", 0.0), ckpt.get("part", 1) + 1
        say(f"resumed from {path} at step {step} "
            f"({runtime.position(start_epoch, start_batch, cfg.epochs, batches)})")

    # The model three ways: `model`, the plain module, is what is saved; `compiled` is what runs
    # (torch.compile'd under --compile, else model itself), in evaluation too; `ddp_model` trains
    # (under torchrun wrapped in DDP, which all-reduces the gradients; else compiled itself).
    compiled = torch.compile(model) if cfg.compile else model
    ddp_model = compiled
    if world_size > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            compiled, device_ids=[device.index] if device.type == "cuda" else None)

    # Outputs: the resolved config and TensorBoard (rank 0), and what this run is, said once.
    if is_main:
        runtime.write_json_atomic(out_dir / "config.json", {**cfg.to_dict(), "lr": lr})
    tensorboard = runtime.TensorBoard(out_dir, step if cfg.resume else None, active=is_main)
    say(f"{cfg.dataset}: {info.train_size} train / {info.val_size} val, {info.channels}x"
        f"{info.image_size}x{info.image_size}, {info.num_classes} classes, via {info.loader}")
    for note in info.notes:
        say(note)
    if tensorboard.moved:
        say(f"TensorBoard logs of the earlier run in {out_dir} moved to {tensorboard.moved}")
    say(f"{cfg.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) on {device}"
        f"{f' x{world_size} processes' if world_size > 1 else ''}, amp {amp_dtype or 'off'}, "
        f"{cfg.schedule} schedule, lr {lr:.4g}, {total_steps} optimizer steps")

    # Checkpoints. `done` is where last.pt would continue from now (after the last optimizer step),
    # `saved_at` where the last.pt on disk continues from.
    done = saved_at = (start_epoch, start_batch)
    saved_step = step if ckpt else None
    first_loss = None  # the run's first batch loss, on the device until a log point or a save reads it
    to_continue = shlex.join(["python", "train.py", "--resume", "--out-dir", str(out_dir)]) + (
        " (under torchrun, with those flags)" if world_size > 1 else "")

    def diverged(what: str, at_lr: float) -> UserError:
        return runtime.diverged(what, step, at_lr, lr, out_dir / "last.pt", saved_step)

    def save(epoch: int, batch: int, name: str = "last.pt") -> None:
        """A checkpoint that continues at (epoch, batch); never one of nan or inf weights."""
        nonlocal saved_at, saved_step, start_loss
        if not runtime.all_finite(model.state_dict().values()):
            raise diverged("the weights hold nan or inf", optimizer.param_groups[0]["lr"])
        if start_loss is None and first_loss is not None:  # saving reads the device anyway
            start_loss = first_loss.item()
        if is_main:
            runtime.save_checkpoint(runtime.training_state(
                model, optimizer, scheduler, scaler, epoch=epoch, batch=batch, step=step,
                total_steps=total_steps, best_val_acc=best_acc, start_loss=start_loss, part=part,
                seconds=seconds_before + time.perf_counter() - started,
                config={**cfg.to_dict(), "lr": lr}), out_dir / name)
        if name == "last.pt":
            saved_at, saved_step = (epoch, batch), step

    @contextmanager
    def saved_if_an_image_is_unreadable():
        """An image the data cannot decode stops the run as Ctrl-C does: save, then say which."""
        try:
            yield
        except UnreadableImage as err:
            if done != saved_at:
                save(*done)
            then = ("nothing was trained yet; replace or delete it and run again" if saved_step is None
                    else f"{out_dir / 'last.pt'} holds step {saved_step}; replace or delete it, then "
                    f"continue with `{to_continue}`")
            raise UnreadableImage(f"{err}; {then}") from None

    # Training: the optimizer steps through each epoch's batches; at its end, evaluate and save.
    val, epoch_rates, started = None, [], time.perf_counter()
    with tensorboard, runtime.StopFlag() as stop, saved_if_an_image_is_unreadable():
        for epoch in range(start_epoch, cfg.epochs):
            ddp_model.train()
            bar = tqdm(total=batches, initial=start_batch, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       disable=not (is_main and sys.stdout.isatty()), leave=False)
            loss_sum, loss_count = torch.zeros((), device=device), 0  # on the device until a log point
            epoch_start, images = time.perf_counter(), 0
            for i, (inputs, targets) in enumerate(train_batches.epoch(epoch, start_batch), start_batch):
                # Accumulation: batches go in groups of accum_steps (an epoch's last one may be
                # shorter), each loss divided by its group's size. The optimizer steps after a
                # group's last batch, and only that backward all-reduces under DDP (no_sync).
                group_start = i - i % cfg.accum_steps
                group_size = min(cfg.accum_steps, batches - group_start)
                last_in_group = i + 1 == group_start + group_size
                with nullcontext() if last_in_group or world_size == 1 else ddp_model.no_sync():
                    with runtime.autocast(device, amp_dtype):
                        logits = ddp_model(inputs)
                        loss = F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing)
                    scaled = loss / group_size
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                loss_sum += loss.detach()
                loss_count += 1
                images += len(targets) * world_size
                if first_loss is None:  # the divergence yardstick, and the inputs as the model sees them
                    first_loss = loss.detach()
                    if step == 0:
                        tensorboard.inputs(inputs, targets, train_batches.denormalize, names, step)
                if not last_in_group:
                    continue

                # The optimizer step, and the scheduler's with it (both skipped where GradScaler
                # finds inf gradients). train/lr is a number the host has: logging it costs no sync.
                step_lr = optimizer.param_groups[0]["lr"]
                optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad or None)
                optimizer.zero_grad(set_to_none=True)
                step += 1
                done = (epoch, i + 1)
                tensorboard.scalar("train/lr", step_lr, step)

                # Log points (every log_every steps, and the epoch's last) are the only place the
                # loop reads the device: the mean loss, and the divergence check on it.
                log_point = step % cfg.log_every == 0 or i + 1 == batches
                if log_point:
                    train_loss, first = torch.stack([loss_sum / loss_count, first_loss]).tolist()
                    start_loss = first if start_loss is None else start_loss
                    loss_sum.zero_()
                    loss_count = 0
                    tensorboard.scalar("train/loss", train_loss, step)
                    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{step_lr:.3g}", refresh=False)
                    bar.update(i + 1 - bar.n)
                    why = runtime.divergence(train_loss, start_loss)
                    if runtime.any_rank(why is not None, device):  # every rank stops at the same step
                        raise diverged(why or "the loss diverged on another process", step_lr)

                # Ctrl-C or SIGTERM: save, then stop (StopFlag.now says when, under torchrun too).
                stopping = stop.now(log_point, device)
                if stopping or (cfg.save_every and step % cfg.save_every == 0):
                    save(epoch, i + 1)
                if stopping:
                    say(f"interrupted at step {step}; saved {out_dir / 'last.pt'}; continue with "
                        f"`{to_continue}`")
                    raise SystemExit(stop.exit_code)
            bar.close()

            # Epoch end: rank 0's BatchNorm statistics on every rank, then evaluate, log and save.
            runtime.sync_buffers(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the epoch's time includes the work still queued
            if images:  # a run resumed at an epoch's very end trained nothing here
                epoch_rates.append(images / max(time.perf_counter() - epoch_start, 1e-9))
            start_batch, done = 0, (epoch, batches)
            val = evaluate(compiled, val_batches, device, amp_dtype, info.num_classes)
            tensorboard.evaluation(val, names, val_batches.denormalize, step)
            rate = f"  ({epoch_rates[-1]:,.0f} img/s)" if images else ""
            say(f"epoch {epoch + 1}/{cfg.epochs}  step {step}  val loss {val.loss:.4f}  "
                f"val acc {val.acc:.2%}{rate}")
            if not math.isfinite(val.loss):
                raise diverged(f"val loss {val.loss} after epoch {epoch + 1}",
                               optimizer.param_groups[0]["lr"])
            improved, best_acc = val.acc > best_acc, max(best_acc, val.acc)
            save(epoch + 1, 0)
            done = (epoch + 1, 0)
            if improved:
                save(epoch + 1, 0, "best.pt")

    # Summary. Every rank takes part in its ranks_in_sync check; rank 0 then writes the files while
    # the others wait for it, so that all ranks finish their collectives before they leave.
    summary = runtime.run_summary(cfg, lr, model, device, val, names, best_acc, step, epoch_rates,
                                  time.perf_counter() - started, seconds_before, part)
    runtime.on_rank0(runtime.write_summary, summary, cfg, val, names, tensorboard)
    return summary


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
    """--evaluate PATH: the validation split once through a saved model; trains nothing. Writes
    eval.json and eval_confusion.png next to the checkpoint (or into an --out-dir given here).
    `given`: the settings the command line gave (None: all of cfg's)."""
    given = cfg.to_dict() if given is None else given
    path = Path(cfg.evaluate)
    if not path.is_file():
        raise UserError(f"--evaluate {path}: no such file (a best.pt, last.pt or state_dict)")
    ckpt = runtime.load_checkpoint(path)
    cfg = evaluated_config(cfg, given, ckpt.get("config"))  # ours: built as it was trained
    rank, world_size, device = runtime.setup_distributed(cfg.device)
    _, val_batches, info = build_loaders(cfg, device, rank, world_size)
    model = build_model(cfg, info.channels, info.num_classes, device)
    load_weights(model, weights_of(ckpt), info.num_classes, f"--evaluate {path}", new_head=False)
    val = evaluate(model, val_batches, device, runtime.amp_dtype(device, cfg.amp), info.num_classes)
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    return runtime.report_evaluation(val, info.class_names, info.val_size, path, ckpt.get("step"),
                                     cfg.dataset, out_dir, rank == 0)


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


if __name__ == "__main__":
    main()
