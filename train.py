"""Train a model: `python train.py [--config configs/X.toml] [--field value ...]`.

train() reads top to bottom: setup, then for each optimizer step its micro-batches, and at each epoch's
end an evaluation and a checkpoint. The loss, the metrics and the pictures are task.py's; checkpoints.py,
distributed.py and logs.py hold what surrounds the loop. Multi-GPU: `torchrun --nproc_per_node=N train.py`.
`--evaluate runs/x/best.pt` measures a checkpoint on a split instead; `--predict PATH [--checkpoint
runs/x/best.pt]` predicts images with it.
"""

from __future__ import annotations

import math
import re
import sys
import time
from contextlib import closing, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

import checkpoints
import distributed
import logs
import lr_find
import models
import task as default_task
from configs import Config, UserError, exit_with_error, first_line, parse_given, resolve, validate
from contract import check_model
from data import UnreadableImage, build_loaders, prediction_batches
from models import amp_setup, autocast, build_model, build_optimizer, check_graphs, load_weights, runnable
from schedules import build_scheduler, epochs_to_steps, optimizer_step, safe_pct_start


@dataclass
class Progress:
    """Where a run stands: saved whole in each checkpoint ("run") and read back by name on resume."""

    epoch: int = 0  # the run continues at this epoch's batch `batch`
    batch: int = 0
    step: int = 0  # optimizer steps taken
    best: float | None = None  # the best val value of the task's main metric so far
    start_loss: float | None = None  # the run's first batch loss, the yardstick for divergence
    seconds_before: float = 0.0  # training time of the run's earlier parts, up to their last save
    part: int = 1  # 2 and up: resumed
    stale: int = 0  # evaluations since the main metric last improved by more than --min-delta
    averaged: int = 0  # --ema: the optimizer steps (taken, not skipped) averaged so far
    stopped: str | None = None  # why the run stopped before its last epoch (--early-stop)


def train(cfg: Config, given: dict | None = None, task=default_task) -> dict:
    """One run. A resume takes the checkpoint's config, `given` (the flags given; None: all of cfg) on top."""
    # Setup. A resume continues with the checkpoint's config, checked against what was given now;
    # an --out-dir that cannot be written, or holds an unfinished run, is refused before any data loads.
    # --resume auto with no last.pt yet is a first start: one command starts a run and continues it.
    first_start = cfg.resume == "auto" and not (Path(cfg.out_dir) / "last.pt").is_file()
    if first_start:
        cfg = validate(replace(cfg, resume=""))
    ckpt, path, cfg = checkpoints.load_resume(cfg, given, task) if cfg.resume else (None, None, cfg)
    rank, world_size, device = distributed.setup(cfg.device)
    say = print if rank == 0 else (lambda *a, **k: None)  # rank 0 alone prints, logs and saves
    if first_start:
        say(f"--resume auto: no {Path(cfg.out_dir) / 'last.pt'} yet, so a new run")
    out_dir = Path(cfg.out_dir)
    lr = resolve.resolve_lr(cfg, task, say)  # a number (--lr auto: lr_find.json's); None: --lr find
    distributed.on_rank0(checkpoints.claim_out_dir, out_dir, path)
    torch.manual_seed(cfg.seed)

    # Data, model, optimizer and schedule, built as lr_find.py builds them; the loss is the task's. The
    # data is checked against the task as it loads, and two examples go through the model (contract.py).
    # val chooses best.pt (and --early-stop); test, where the data has one, is run once at the end.
    train_batches, val_batches, test_batches, info = build_loaders(cfg, device, rank, world_size,
                                                                   targets=task.TARGETS)
    batches_per_epoch = len(train_batches)  # an optimizer step takes accum_steps of them
    data = {"train_size": info.train_size, "val_size": info.val_size, "test_size": info.test_size,
            "batches": batches_per_epoch, "names": info.names}  # what a resume checks
    model = build_model(cfg, info.input_shape[0], len(info.names), device)
    info.notes.append(check_model(model, train_batches, task, cfg, info))
    amp_dtype, scaler = amp_setup(device, cfg.amp)
    if lr is None:  # --lr find: the range test on this model and data, which it leaves as it found them
        lr = find_lr(cfg, task, model, train_batches, info, amp_dtype)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, batches_per_epoch)
    ema = models.Ema(model, cfg.ema) if cfg.ema else None  # evaluated and kept for use, never trained
    distributed.on_rank0(checkpoints.check_free_space, out_dir, model, optimizer)

    # Resume: every state as it was saved (the RNGs' too), on data that gives the same epochs.
    progress, saved = Progress(), None  # saved: where the last.pt on disk stands
    if ckpt:
        checkpoints.check_same_data(ckpt, path, data)
        checkpoints.restore_training_state(ckpt, path, model, optimizer, scheduler, scaler)
        if ema:
            ema.average.load_state_dict(ckpt["ema"])
        progress = Progress(**{**ckpt["run"], "part": ckpt["run"]["part"] + 1})
        saved = replace(progress)
        where = checkpoints.position(progress.epoch, progress.batch, cfg.epochs, batches_per_epoch)
        say(f"resumed from {path} at step {progress.step} ({where})")

    # The model three ways: `model`, the plain module, is what is saved; `runner` runs it, in evaluation too
    # (torch.compile'd, or under --cuda-graphs captured after the restore, else model itself); `ddp_model`
    # trains (under torchrun in DDP, which all-reduces the gradients; else runner itself).
    runner = runnable(model, cfg, device, amp_dtype, world_size, train_batches)
    ddp_model = runner if world_size == 1 else torch.nn.parallel.DistributedDataParallel(
        runner, device_ids=[device.index] if device.type == "cuda" else None)
    evaluated = ema.average if ema else runner  # --ema: the average is the model a run gives

    # Outputs: the resolved config and TensorBoard (rank 0), and what this run is, said once.
    distributed.on_rank0(checkpoints.write_json_atomic, out_dir / "config.json", {**cfg.to_dict(), "lr": lr})
    tensorboard = logs.TensorBoard(out_dir, progress.step if ckpt else None, active=rank == 0)
    logs.announce(cfg, task, info, tensorboard.moved, say)
    say(f"{cfg.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) on {device}"
        f"{f' x{world_size} processes' if world_size > 1 else ''}, amp {amp_dtype or 'off'}, "
        f"{cfg.schedule} schedule, lr {lr:.4g}, {total_steps} optimizer steps")

    def save(name: str) -> Progress:
        """A checkpoint of every state the run continues from bit for bit (the RNGs' too), where `progress`
        stands; never of nan or inf weights. TensorBoard writes first: its log holds every step saved."""
        if not checkpoints.all_finite(model.state_dict().values()):
            raise diverged("the weights hold nan or inf")
        tensorboard.write()
        if rank == 0:  # the other ranks hold the same states
            with distributed.SIGNALS.in_mode("hold"):  # a signal now waits for the file to be whole
                checkpoints.write_checkpoint({
                    "model": model.state_dict(),
                    "ema": ema.average.state_dict() if ema else None,  # what --evaluate and --predict use
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "rng": checkpoints.capture_rng_state(),
                    "run": {**asdict(progress),
                            "seconds_before": progress.seconds_before + time.perf_counter() - started},
                    "config": {**cfg.to_dict(), "lr": lr},
                    "task": task.NAME, "task_source": resolve.task_identity(task)["source"],
                    "data": data,  # what fixes the schedule: a resume on other data is refused
                    "inputs": info.inputs_record(),  # what the model takes; how --predict reads images
                    "step": progress.step, "total_steps": total_steps,  # what --evaluate and run checks read
                }, out_dir / name)
        return replace(progress)

    def diverged(what: str) -> UserError:
        """The line a diverged run stops with: where, at what rate, what to try, and what last.pt holds. A
        first loss that is not finite came before any step: the data or the model, not the rate."""
        at_lr = optimizer.param_groups[0]["lr"]
        kept = ("this run wrote no checkpoint" if saved is None
                else f"{out_dir / 'last.pt'} still holds step {saved.step}")
        if progress.start_loss is not None and not math.isfinite(progress.start_loss):
            return UserError(f"the first batch's loss is {progress.start_loss}, before any optimizer step: "
                             "not the learning rate but the data or the model (nan or inf in the inputs or "
                             "targets, or a layer that makes them); check them, e.g. the dataset's files; "
                             f"{kept}")
        return UserError(f"training diverged at step {progress.step} ({what}; lr {at_lr:.3g}): try a lower "
                         f"--lr than {lr:.3g}, e.g. --lr {lr / 10:.2g}, or `python lr_find.py` with the same "
                         f"options to find one; {kept}")

    # Training: for each optimizer step, its micro-batches; at each epoch's end, evaluate and save.
    epoch_rates, seeds, started = [], {}, time.perf_counter()
    bar_shown = rank == 0 and sys.stdout.isatty()  # a progress bar in a terminal, not in a log file
    losses, counts = [], []  # since the last log point, on the device: summed losses, their normalizers
    mid_step = False  # from a step's first forward to its optimizer step: its state is the step's, half done
    with (tensorboard, distributed.holding(out_dir), closing(train_batches), closing(val_batches),
          nullcontext() if test_batches is None else closing(test_batches), distributed.SIGNALS.installed(),
          distributed.SIGNALS.in_mode("defer") as signals):
        try:
            for epoch in range(progress.epoch, cfg.epochs):
                progress.epoch = epoch  # (evaluate() puts the model back in train mode)
                bar = tqdm(total=batches_per_epoch, initial=progress.batch, leave=False,
                           disable=not bar_shown, desc=f"epoch {epoch + 1}/{cfg.epochs}")
                epoch_start, first_batch = time.perf_counter(), progress.batch
                stream = train_batches.epoch(epoch, progress.batch)
                while progress.batch < batches_per_epoch:
                    # Accumulation: accum_steps micro-batches a step (the epoch's last step may get fewer),
                    # drawn first: each summed loss is weighted by the step's normalizer over all of them
                    # and every process, so that a step is one batch k x N times as large, for weighted
                    # and masked means too. Only the last backward all-reduces.
                    size = min(cfg.accum_steps, batches_per_epoch - progress.batch)
                    window, mid_step = [next(stream) for _ in range(size)], True
                    normalizers = [task.normalizer(targets, cfg, info) for _, targets in window]
                    weight = step_weight(normalizers, world_size, device, seeds)
                    for micro_step, (inputs, targets) in enumerate(window):
                        last = micro_step == len(window) - 1
                        with nullcontext() if last or world_size == 1 else ddp_model.no_sync():
                            with autocast(device, amp_dtype):
                                loss = task.loss(ddp_model(inputs), targets, cfg, info)
                            # backward from `weight` rather than 1: loss x weight's gradients, no multiply
                            (scaler.scale(loss) if scaler is not None else loss).backward(weight)
                        losses.append(loss.detach())
                        if progress.start_loss is None:  # a fresh run's first batch: the divergence
                            progress.start_loss = (losses[0] / normalizers[0]).item()  # yardstick, read once
                            tensorboard.images({"inputs": task.input_picture(inputs, targets, info.names,
                                                                             train_batches.to_pixels)}, 0)
                    counts += normalizers

                    # The optimizer step, and the scheduler's with it (both skipped where GradScaler
                    # finds inf gradients). The rate is a number the host has: keeping it costs no sync.
                    tensorboard.point("train/lr", progress.step + 1, optimizer.param_groups[0]["lr"])
                    stepped = optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad or None)
                    if ema and stepped:
                        progress.averaged += 1
                        ema.update(progress.averaged)
                    optimizer.zero_grad(set_to_none=True)
                    progress.step, progress.batch = progress.step + 1, progress.batch + len(window)
                    mid_step = False

                    # Log points (every log_every steps, and the epoch's last) are the only place the
                    # loop reads the device: the loss since the last one, and the divergence check on it.
                    log_point = progress.step % cfg.log_every == 0 or progress.batch == batches_per_epoch
                    if log_point:
                        train_loss = (torch.stack(losses).sum() / sum(counts)).item()
                        losses, counts = [], []
                        tensorboard.point("train/loss", progress.step, train_loss)
                        tensorboard.write()
                        bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.3g}",
                                        refresh=False)
                        bar.update(progress.batch - bar.n)
                        why = divergence(train_loss, progress.start_loss)
                        if distributed.any_rank(why is not None, device):  # all ranks stop at one step
                            raise diverged(why or "diverged on another process")

                    # Ctrl-C, SIGTERM or SIGHUP: save, then stop (Signals.now says when, under torchrun too).
                    periodic = bool(cfg.save_every) and progress.step % cfg.save_every == 0
                    if periodic:
                        saved = save("last.pt")
                    if signals.now(log_point, device):
                        saved = saved if periodic else save("last.pt")
                        raise stopped(progress.step, out_dir, world_size, say)
                bar.close()

                # Epoch end: rank 0's BatchNorm statistics on every rank, then evaluate, log and save.
                distributed.share_from_rank0(model.buffers())
                if ema:
                    distributed.share_from_rank0(ema.average.buffers())
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the epoch's time includes the work still queued
                examples = cfg.batch_size * (batches_per_epoch - first_batch)  # all processes'
                epoch_rates += [examples / max(time.perf_counter() - epoch_start, 1e-9)] if examples else []
                val = evaluate(evaluated, val_batches, task, cfg, info, amp_dtype)
                logs.log_evaluation(val, task, info.names, val_batches.to_pixels, progress.step, tensorboard)
                unit = "img" if info.images else "examples"
                rate = f"  ({epoch_rates[-1]:,.0f} {unit}/s)" if examples else ""
                line = f"epoch {epoch + 1}/{cfg.epochs}  step {progress.step}  {task.describe(val)}{rate}"
                if not math.isfinite(val.metrics["loss"]):
                    say(line)
                    raise diverged(f"val loss {val.metrics['loss']} after epoch {epoch + 1}")
                score, best = val.metrics[task.MAIN_METRIC], progress.best
                gain = math.inf if best is None else (score - best if task.HIGHER_IS_BETTER else best - score)
                progress.epoch, progress.batch = epoch + 1, 0
                progress.best = score if gain > 0 else best
                progress.stale = 0 if gain > cfg.min_delta else progress.stale + 1
                if cfg.early_stop and progress.stale >= cfg.early_stop and epoch + 1 < cfg.epochs:
                    progress.stopped = (f"val {task.MAIN_METRIC} did not improve by more than "
                                        f"{cfg.min_delta:g} in {progress.stale} evaluations (--early-stop "
                                        f"{cfg.early_stop})")
                saved = save("last.pt")
                if gain > 0:
                    save("best.pt")
                say(line)  # after the saves: a closed stdout (`| head`) cannot cost the epoch
                if progress.stopped:
                    say(f"early stop after epoch {epoch + 1}/{cfg.epochs}: {progress.stopped}; best.pt holds "
                        f"the best val {task.MAIN_METRIC}")
                    break
                if signals.now(True, device):  # a signal in the evaluation: saved just now
                    raise stopped(progress.step, out_dir, world_size, say)
        except UnreadableImage as err:  # an image the data cannot decode stops the run as Ctrl-C does
            if saved is None or (saved.epoch, saved.batch) != (progress.epoch, progress.batch):
                saved = save("last.pt")
            raise UnreadableImage(f"{err}; {out_dir / 'last.pt'} holds step {saved.step}; replace or delete "
                                  f"it, then {resuming(out_dir, world_size)}") from None
        except RuntimeError as err:  # a collective failed: under torchrun, another process may be gone
            if not distributed.peer_lost(err):
                raise
            # Between steps, every rank holds the last whole step (equal on all of them), so rank 0 saves it
            # as it stands, which needs no collective; mid-step (a forward has moved BatchNorm's statistics
            # and the RNGs) last.pt stays as it is, whole.
            if rank == 0 and not mid_step and progress.step > (saved.step if saved else 0):
                saved = save("last.pt")
            left = f"{out_dir / 'last.pt'} holds step {saved.step}" if saved else "no checkpoint was written"
            raise UserError(f"another process of this run failed ({first_line(err, 120)}): stopped at step "
                            f"{progress.step}; {left}; continue with `torchrun ... train.py ... --resume "
                            "auto` (torchrun --max-restarts N does that itself)", 1) from None
        except distributed.Interrupted as err:  # a second signal: stopped at once
            left = ("no checkpoint was written" if saved is None
                    else f"{out_dir / 'last.pt'} holds step {saved.step}; {resuming(out_dir, world_size)}")
            raise UserError(f"interrupted again by {err}: stopped at once at step {progress.step}; {left}",
                            128 + err.signum) from None

        # Do the ranks' final weights agree? (a collective; asked before best.pt's replace them below)
        in_sync = distributed.ranks_agree(model) and (not ema or distributed.ranks_agree(ema.average))

        # Test: best.pt's weights once through the test split, which chose nothing; rank 0 reads the
        # file, every rank gets its weights (--ema: the average's, as evaluation used).
        test = None
        if test_batches is not None:
            chosen = ema.average if ema else model
            if rank == 0:
                chosen.load_state_dict(models.weights_of(checkpoints.load_checkpoint(out_dir / "best.pt")))
            distributed.share_from_rank0(chosen.state_dict().values())
            test = evaluate(evaluated, test_batches, task, cfg, info, amp_dtype)
            logs.log_evaluation(test, task, info.names, test_batches.to_pixels, progress.step, tensorboard,
                                split="test")

        # Summary, while the folder is still this run's. Every rank took part in ranks_agree, a
        # collective; rank 0 then writes the files while the others wait, so all leave together.
        steady = epoch_rates[1:] or epoch_rates  # the first epoch pays for warm-up and compilation
        summary = logs.run_summary(task, val, progress, time.perf_counter() - started, {
            "epochs": cfg.epochs, "examples_per_second": sum(steady) / len(steady) if steady else math.nan,
            "lr": lr, "world_size": world_size, "device": str(device), "ranks_in_sync": in_sync,
            "train_size": info.train_size, "val_size": info.val_size, "test_size": info.test_size}, test=test)
        distributed.on_rank0(logs.write_summary, summary, cfg, task, val, info.names, tensorboard)
    return summary


def stopped(step: int, out_dir: Path, world_size: int, say) -> SystemExit:
    """After a signal, the run saved at `step`: say how to continue, and exit 128 + its number."""
    say(f"interrupted at step {step}; saved {out_dir / 'last.pt'}; {resuming(out_dir, world_size)}")
    return SystemExit(distributed.SIGNALS.exit_code)


def resuming(out_dir: Path, world_size: int) -> str:
    return f"continue with `{distributed.continue_command(out_dir, world_size)}`"


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, batches_per_epoch: int):
    """The schedule in optimizer steps, from a config written in epochs."""
    def steps(epochs: float) -> int:
        return epochs_to_steps(epochs, batches_per_epoch, cfg.accum_steps)

    total, warmup = steps(cfg.epochs), steps(cfg.warmup_epochs)
    if warmup >= total:
        raise UserError(f"warmup_epochs {cfg.warmup_epochs} covers the whole run of {cfg.epochs} epochs; "
                        "lower it")
    options = {"onecycle": dict(pct_start=safe_pct_start(cfg.pct_start, total), div_factor=cfg.div_factor,
                                final_div_factor=cfg.final_div_factor),
               "step": dict(step_size=max(steps(cfg.step_size or max(cfg.epochs / 3, 1)), 1),
                            gamma=cfg.gamma),
               "cosine": dict(min_lr_ratio=cfg.min_lr_ratio)}.get(cfg.schedule, {})
    if cfg.schedule != "onecycle":  # its warm phase is pct_start
        options["warmup_steps"] = warmup
    try:
        return build_scheduler(optimizer, cfg.schedule, total, **options), total
    except ValueError as err:  # schedules.py checks its inputs; here that is a config problem
        raise UserError(f"the {cfg.schedule} schedule does not fit this run of {total} optimizer "
                        f"steps: {err}; change its options or --epochs") from None


def step_weight(counts: list, world_size: int, device: torch.device, seeds: dict) -> torch.Tensor:
    """What an optimizer step's summed losses are weighted by: one over their normalizers' sum over every
    process, times the processes (DDP averages the gradients over them). Tensors (a count that depends on
    the targets) are summed over the processes on the device, never read; numbers (the examples) are the
    same on every rank, and their weight is kept on the device in `seeds`, made once per value."""
    total = sum(counts)
    if isinstance(total, torch.Tensor):
        counted = distributed.all_reduce_sum(total.float()).clamp_min(1e-30)  # none counted: zero gradients
        return world_size / counted
    if total not in seeds:
        seeds[total] = torch.tensor(1 / total, device=device)
    return seeds[total]


@torch.no_grad()
def evaluate(model, batches, task, cfg: Config, info, amp_dtype):
    """One pass over a split's batches through the task's tally, kept on their device and read once
    at the end (summed over processes under torchrun)."""
    model.eval()
    tally = task.Tally(cfg, info, batches.device)
    for inputs, targets in batches.epoch(0):
        with autocast(batches.device, amp_dtype):
            outputs = model(inputs)
        tally.add(outputs, targets, inputs)
    model.train()
    return tally.result(distributed.all_reduce_sum)


# ---------------------------------------------------------------- --lr find


def find_lr(cfg: Config, task, model, batches, info, amp_dtype) -> float:
    """--lr find: lr_find.py's sweep on this very model and data, its files written, its suggestion.

    Under torchrun rank 0 sweeps alone while the others wait for the rate: it accumulates
    world_size of its batches per step, so each step sees the global batch as DDP will. All ranks
    sweeping together would need the stop rule agreed at every step; one rank keeps lr_find as it is.
    """
    found = problem = None
    world_size, device = distributed.world_size(), batches.device
    check_graphs(cfg, device, amp_dtype, world_size)  # a --cuda-graphs the run will refuse: before the sweep
    if distributed.rank() == 0:
        try:
            result, wrote = lr_find.sweep_setup(cfg, task, model, batches, info, batches_per_step=world_size)
            found = result.suggestion
            picture = wrote[1] if isinstance(wrote[1], Path) else wrote[0]  # no matplotlib: no picture
            fix = "" if result.why_none == lr_find.FIRST_LOSS_NOT_FINITE else (
                f"; look at {picture}, widen --find-start-lr/--find-end-lr or raise --find-iters, or pass "
                "--lr N")
            if found is None:
                problem = f"the range test suggested no learning rate ({result.why_none}){fix}"
            else:
                alone = f"; rank 0 alone, {world_size}x its batches per step" if world_size > 1 else ""
                print(f"lr find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e}, "
                      f"{result.stop_reason}{alone}; suggested lr {found:.4g} ({result.method}); wrote "
                      f"{', '.join(str(path) for path in wrote)}")
        except ValueError as err:  # lr_find's checks of its arguments; UserError included
            problem = f"--lr find: {err}"
    found, problem = distributed.from_rank0((found, problem))
    if problem:
        raise UserError(problem)
    return found


# ---------------------------------------------------------------- stop rules

# A logged training loss above this multiple of the run's first batch loss is not coming back
# (lr_find.py stops its sweep at the same factor over its best loss).
DIVERGENCE_FACTOR = 4.0


def divergence(train_loss: float, start_loss: float) -> str | None:
    """What says this logged training loss diverged, or None."""
    if not math.isfinite(train_loss):
        return f"train loss {train_loss}"
    if start_loss > 0 and train_loss > DIVERGENCE_FACTOR * start_loss:
        return f"train loss {train_loss:.4g}, over {DIVERGENCE_FACTOR:g}x the first batch's {start_loss:.4g}"
    return None


# ---------------------------------------------------------------- --evaluate, --predict and the command line


def evaluate_checkpoint(cfg: Config, given: dict, task=default_task) -> None:
    """--evaluate PATH: the --split (val or test) once through a saved model; trains nothing. Writes
    eval.json and the task's pictures next to the checkpoint (or into an --out-dir `given` here)."""
    path = Path(cfg.evaluate)
    if not path.is_file():
        raise UserError(f"--evaluate {path}: no such file (a best.pt, last.pt or state_dict)")
    ckpt = checkpoints.load_checkpoint(path)
    ours = isinstance(ckpt.get("config"), dict)  # else a plain state_dict: no task to check, cfg as given
    if ours and (edited := checkpoints.check_task(ckpt, path, task, "evaluate it with its own task.py")):
        print(edited)
    cfg = resolve.evaluated_config(cfg, given, ckpt["config"]) if ours else validate(cfg)  # ours: as trained
    rank, world_size, device = distributed.setup(cfg.device)
    _, val_batches, test_batches, info = build_loaders(cfg, device, rank, world_size, targets=task.TARGETS)
    if cfg.split == "test" and test_batches is None:
        raise UserError(f"--split test: {cfg.dataset} here has no test split (imagefolder: a test/ folder "
                        "beside train/ and val/; csv: a test.csv); evaluate --split val")
    batches = test_batches if cfg.split == "test" else val_batches
    checkpoints.check_classes(ckpt, path, info.names, "evaluate it on the data it was trained on")
    model = build_model(cfg, info.input_shape[0], len(info.names), device)
    load_weights(model, ckpt, len(info.names), f"--evaluate {path}", new_head=False)
    check_model(model, batches, task, cfg, info)
    with closing(val_batches), nullcontext() if test_batches is None else closing(test_batches):
        result = evaluate(model, batches, task, cfg, info, amp_setup(device, cfg.amp)[0])
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    report = {"checkpoint": str(path), "step": ckpt.get("step"), "dataset": cfg.dataset, "split": cfg.split,
              f"{cfg.split}_size": batches.num_examples,
              **{f"{cfg.split}_{name}": result.metrics[name] for name in task.METRICS}, **result.details}
    if rank == 0:
        logs.report_evaluation(task, result, report, task.pictures(result, info.names, None), out_dir)


@torch.no_grad()
def predict(cfg: Config, given: dict, task=default_task) -> None:
    """--predict PATH: each image through a saved model, read as its run read its own (the checkpoint
    keeps how), one row each from the task, in predictions.csv next to the checkpoint (or in an
    --out-dir `given` here). The outputs stay on the device until the last batch: one read in all."""
    path = Path(cfg.checkpoint)
    ckpt = checkpoints.load_predictor(path, task)
    cfg = resolve.evaluated_config(cfg, given, ckpt["config"])  # built as it was trained
    device, names = distributed.pick_device(cfg.device), ckpt["data"]["names"]
    reading = ckpt["inputs"]["reading"]  # how the run read its images
    batches, files, skipped = prediction_batches(cfg, Path(cfg.predict), reading, device)
    model = build_model(cfg, reading["channels"], len(names), device).eval()
    load_weights(model, ckpt, len(names), f"--checkpoint {path}", new_head=False)
    amp_dtype, outputs = amp_setup(device, cfg.amp)[0], []
    try:
        for images, _ in tqdm(batches.epoch(0), total=len(batches), desc="predict", leave=False,
                              disable=not sys.stdout.isatty()):
            with autocast(device, amp_dtype):
                outputs.append(predicted(model, images, cfg.tta))
    except UnreadableImage as err:
        line = re.sub(r" \(class folder '.*?'\)", "", str(err))  # these files are of no class
        raise UnreadableImage(f"--predict: {line}; move it away, or list the others in a CSV") from None
    finally:
        batches.close()  # its workers stop now, not when the traceback's frames go
    header, rows = task.predictions(torch.cat(outputs).cpu(), names, cfg.top_k)
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    logs.write_predictions(out_dir / "predictions.csv", header, rows, files, skipped, cfg.tta)


def predicted(model, images: torch.Tensor, tta: str) -> torch.Tensor:
    """A batch's outputs; --tta flip averages in the mirror images' (per-pixel outputs flipped back, so
    that each pixel's output meets its own)."""
    outputs = model(images).float()
    if tta != "flip":
        return outputs
    mirrored = model(images.flip(-1)).float()
    if mirrored.ndim > 2 and mirrored.shape[-1] == images.shape[-1]:  # a map over the image's columns
        mirrored = mirrored.flip(-1)
    return (outputs + mirrored) / 2


def main() -> None:
    try:
        with distributed.SIGNALS.installed():  # from start-up on: a signal is one line, never a traceback
            given = parse_given(description=__doc__.splitlines()[0])
            cfg = Config(**given)
            if cfg.evaluate and cfg.predict:
                raise UserError("--evaluate and --predict are two modes of train.py; give one of them")
            if cfg.evaluate or cfg.predict:
                (predict if cfg.predict else evaluate_checkpoint)(cfg, given)
                return
            if not cfg.resume:  # a resume checks its config once the checkpoint's fills the gaps
                validate(cfg)
            train(cfg, given)
    except UserError as err:
        if err.code == 0:  # nothing to do (a complete run resumed): said, and not an error
            if distributed.rank() == 0:
                print(err)
            return
        # Under torchrun, one line from one process; a file only one rank read, from that rank.
        if distributed.rank() == 0 or isinstance(err, UnreadableImage):
            distributed.tell_torchrun(f"error: {err}")
            exit_with_error(str(err), err.code)
        raise SystemExit(err.code) from None
    except (KeyboardInterrupt, Exception) as err:  # a signal outside the loop, or a known torch failure
        if distributed.rank() != 0 and not isinstance(err, KeyboardInterrupt):
            raise  # torch's long report, from rank 0 alone
        exit_with_error(*distributed.failure_line(
            err, " outside the training loop; every checkpoint is as it was: run the command again, or "
            "continue with --resume"))
    finally:
        distributed.release_all()
        distributed.cleanup()


if __name__ == "__main__":
    main()
