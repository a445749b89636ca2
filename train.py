"""Train a model: `python train.py [--config configs/X.toml] [--field value ...]`.

Read top to bottom: setup (config, data, model, optimizer, schedule, resume), then the loop: for
each optimizer step its micro-batches, a log point now and then, a save on Ctrl-C or SIGTERM; at
each epoch's end an evaluation and a checkpoint; at the end the summary. What the outputs mean
(the loss, the metrics, the pictures) is task.py; what surrounds the loop is in checkpoints.py,
distributed.py and logs.py. Multi-GPU: `torchrun --nproc_per_node=N train.py`.
`python train.py --evaluate runs/x/best.pt` measures a checkpoint on the validation split instead;
`python train.py --predict PATH [--checkpoint runs/x/best.pt]` predicts images with it.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import time
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import checkpoints
import configs
import distributed
import logs
import lr_find
import task as default_task
from configs import Config, UserError, parse_given, resolve
from contract import check_model
from data import UnreadableImage, build_loaders, prediction_batches
from distributed import continue_command, stop_if_signalled
from models import amp_setup, autocast, build_model, build_optimizer, check_graphs, load_weights, runnable
from schedules import build_scheduler, epochs_to_steps, optimizer_step, safe_pct_start, steps_per_epoch


@dataclass
class Run:
    """Where a run stands. The first seven fields are saved in each checkpoint and read back on
    resume; the others are this process's own."""

    epoch: int = 0  # the run continues at this epoch's batch `batch`
    batch: int = 0
    step: int = 0  # optimizer steps taken
    best: float | None = None  # the best val value of the task's main metric so far
    start_loss: float | None = None  # the run's first batch loss, the yardstick for divergence
    seconds_before: float = 0.0  # training time of the run's earlier parts, up to their last save
    part: int = 1  # 2 and up: resumed
    started: float = field(default_factory=time.perf_counter)  # when this part's loop started
    saved_at: tuple | None = None  # (epoch, batch) and step of the last.pt on disk, if any
    saved_step: int | None = None
    first_loss: torch.Tensor | None = None  # start_loss still on the device
    losses: list = field(default_factory=list)  # summed batch losses since the last log point, on the device
    counts: list = field(default_factory=list)  # their normalizers (numbers, or tensors on the device)
    rates: list = field(default_factory=list)  # (step, lr) since the last log point, on the host

    def improves(self, score: float, higher_is_better: bool) -> bool:
        """Whether an evaluation's main metric beats the best so far, which it then becomes."""
        better = self.best is None or (score > self.best if higher_is_better else score < self.best)
        self.best = score if better else self.best
        return better


def train(cfg: Config, given: dict | None = None, task=default_task) -> dict:
    """One run. A resume takes the checkpoint's config, `given` (the flags given; None: all of cfg) on top."""
    # Setup. A resume continues with the checkpoint's config, checked against what was given now;
    # an --out-dir that cannot be written, or holds an unfinished run, is refused before any data loads.
    ckpt, path, cfg = checkpoints.load_resume(cfg, given, task) if cfg.resume else (None, None, cfg)
    rank, world_size, device = distributed.setup(cfg.device)
    is_main = rank == 0  # rank 0 alone prints, logs and saves
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(cfg.out_dir)
    lr = resolve.resolve_lr(cfg, task, say)  # a number (--lr auto: lr_find.json's); None: --lr find
    distributed.on_rank0(checkpoints.claim_out_dir, out_dir, path)
    torch.manual_seed(cfg.seed)

    # Data, model, optimizer and schedule, built as lr_find.py builds them; the loss is the task's.
    # The data is checked against the task (contract.py) as it loads, and one batch goes through the model.
    train_batches, val_batches, info = build_loaders(cfg, device, rank, world_size, targets=task.TARGETS)
    batches = len(train_batches)
    data = {"train_size": info.train_size, "batches": batches, "names": info.names}  # a resume checks it
    model = build_model(cfg, info.input_shape[0], len(info.names), device)
    info.notes.append(check_model(model, train_batches, task, cfg, info))
    amp_dtype, scaler = amp_setup(device, cfg.amp)
    criterion = functools.partial(task.loss, cfg=cfg, info=info)
    if lr is None:  # --lr find: the range test on this model and data, which it leaves as it found them
        lr = find_lr(cfg, task, model, train_batches, info, amp_dtype, device)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, batches)
    distributed.on_rank0(checkpoints.check_free_space, out_dir,
                         checkpoints.checkpoint_bytes(model, optimizer), "a checkpoint")

    # Resume: every state as it was saved, and where the run stood.
    run = resume(ckpt, path, cfg, data, model, optimizer, scheduler, scaler, say) if ckpt else Run()

    # The model three ways: `model`, the plain module, is what is saved; `compiled` runs, in evaluation too
    # (torch.compile'd, or under --cuda-graphs captured after the restore, else model itself); `ddp_model`
    # trains (under torchrun in DDP, which all-reduces the gradients; else compiled itself).
    compiled = runnable(model, cfg, device, amp_dtype, world_size, train_batches)
    ddp_model = compiled if world_size == 1 else torch.nn.parallel.DistributedDataParallel(
        compiled, device_ids=[device.index] if device.type == "cuda" else None)

    # Outputs: the resolved config and TensorBoard (rank 0), and what this run is, said once.
    distributed.on_rank0(checkpoints.write_json_atomic, out_dir / "config.json", {**cfg.to_dict(), "lr": lr})
    tensorboard = logs.TensorBoard(out_dir, run.step if ckpt else None, active=is_main)
    save = functools.partial(save_checkpoint, tensorboard=tensorboard, cfg=cfg, lr=lr, task=task, model=model,
                             optimizer=optimizer, scheduler=scheduler, scaler=scaler, total_steps=total_steps,
                             data=data, inputs=info.inputs_record())
    logs.announce(cfg, task, info, model, device, world_size, amp_dtype, lr, total_steps, tensorboard, say)

    # Training: for each optimizer step, its micro-batches; at each epoch's end, evaluate and save.
    val, epoch_rates, seeds = None, [], {}
    with (tensorboard, distributed.holding(out_dir), closing(train_batches), closing(val_batches),
          distributed.SIGNALS.installed(), distributed.SIGNALS.in_mode("defer") as stop,
          stops_in_one_line(run, save, out_dir, world_size)):
        for epoch in range(run.epoch, cfg.epochs):
            run.epoch = epoch  # (evaluate() puts the model back in train mode)
            bar = tqdm(total=batches, initial=run.batch, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                       disable=not (is_main and sys.stdout.isatty()))
            epoch_start, first_batch = time.perf_counter(), run.batch
            stream = train_batches.epoch(epoch, run.batch)
            while run.batch < batches:
                # Accumulation: accum_steps micro-batches a step (the epoch's last step may get fewer),
                # drawn first: each summed loss is weighted by the step's normalizer over all of them and
                # every process, so that a step is one batch k x N times as large, for weighted and
                # masked means too. Only the last backward all-reduces.
                window = [next(stream) for _ in range(min(cfg.accum_steps, batches - run.batch))]
                counts = [task.normalizer(targets, cfg, info) for _, targets in window]
                weight = step_weight(counts, world_size, device, seeds)
                for micro_step, (inputs, targets) in enumerate(window):
                    last = micro_step == len(window) - 1
                    with nullcontext() if last or world_size == 1 else ddp_model.no_sync():
                        with autocast(device, amp_dtype):
                            loss = criterion(ddp_model(inputs), targets)
                        # backward from `weight` rather than 1: loss x weight's gradients, with no multiply
                        (scaler.scale(loss) if scaler is not None else loss).backward(weight)
                    run.losses.append(loss.detach())
                    if run.first_loss is None:  # the divergence yardstick; the inputs as the model sees them
                        run.first_loss = run.losses[0] / counts[0]
                        logs.inputs(inputs, targets, task, info.names, train_batches.pixels, run, tensorboard)
                run.counts += counts

                # The optimizer step, and the scheduler's with it (both skipped where GradScaler
                # finds inf gradients). The rate is a number the host has: keeping it costs no sync.
                run.rates.append((run.step + 1, optimizer.param_groups[0]["lr"]))
                optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad or None)
                optimizer.zero_grad(set_to_none=True)
                run.step, run.batch = run.step + 1, run.batch + len(window)

                # Log points (every log_every steps, and the epoch's last) are the only place the
                # loop reads the device: the mean loss, and the divergence check on it.
                log_point = run.step % cfg.log_every == 0 or run.batch == batches
                if log_point:
                    why = divergence(logs.log_train_loss(run, tensorboard, bar), run.start_loss)
                    if distributed.any_rank(why is not None, device):  # all ranks stop at one step
                        raise diverged(why or "diverged on another process", optimizer, lr, run, out_dir)

                # Ctrl-C, SIGTERM or SIGHUP: save, then stop (Signals.now says when, under torchrun too).
                if periodic := bool(cfg.save_every) and run.step % cfg.save_every == 0:
                    save(run, "last.pt")
                stop_if_signalled(stop, log_point, device, run, save, periodic, say, out_dir, world_size)
            bar.close()

            # Epoch end: rank 0's BatchNorm statistics on every rank, then evaluate, log and save.
            distributed.sync_buffers(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the epoch's time includes the work still queued
            examples = (batches - first_batch) * cfg.batch_size  # all processes'; none if resumed at its end
            epoch_rates += [examples / max(time.perf_counter() - epoch_start, 1e-9)] if examples else []
            val = evaluate(compiled, val_batches, task, cfg, info, device, amp_dtype)
            logs.log_evaluation(val, task, info.names, val_batches.pixels, run.step, tensorboard)
            rate = f"  ({epoch_rates[-1]:,.0f} {'img' if info.images else 'examples'}/s)" if examples else ""
            line = f"epoch {epoch + 1}/{cfg.epochs}  step {run.step}  {task.describe(val)}{rate}"
            if not math.isfinite(val.metrics["loss"]):
                say(line)
                raise diverged(f"val loss {val.metrics['loss']} after epoch {epoch + 1}", optimizer, lr, run,
                               out_dir)
            improved = run.improves(val.metrics[task.MAIN_METRIC], task.HIGHER_IS_BETTER)
            run.epoch, run.batch = epoch + 1, 0
            save(run, "last.pt")
            if improved:
                save(run, "best.pt")
            say(line)  # after the saves: a closed stdout (`| head`) cannot cost the epoch
            stop_if_signalled(stop, True, device, run, save, True, say, out_dir, world_size)  # one in eval

        # Summary, while the folder is still this run's. Every rank takes part in ranks_agree, a
        # collective; rank 0 then writes the files while the others wait, so all leave together.
        summary = logs.run_summary(task, val, run, lr, cfg.epochs, epoch_rates, world_size, device,
                                   distributed.ranks_agree(model))
        distributed.on_rank0(logs.write_summary, summary, cfg, task, val, info.names, tensorboard)
    return summary


def save_checkpoint(run: Run, name: str, *, tensorboard: logs.TensorBoard, cfg: Config, lr: float, task,
                    model, optimizer, scheduler, scaler, total_steps: int, data: dict,
                    inputs: dict | None = None) -> None:
    """A checkpoint that continues where `run` stands: the states a run continues from bit for bit
    (every RNG's included), where it stood, and its config. Never one of nan or inf weights. The
    rates kept since the last log point go to TensorBoard first: its log holds every step saved."""
    path = Path(cfg.out_dir) / name
    if not checkpoints.all_finite(model.state_dict().values()):
        raise diverged("the weights hold nan or inf", optimizer, lr, run, path.parent)
    tensorboard.scalars({"train/lr": run.rates})
    run.rates = []
    if run.start_loss is None and run.first_loss is not None:  # saving reads the device anyway
        run.start_loss = run.first_loss.item()
    if distributed.rank() == 0:  # the other ranks hold the same states
        with distributed.SIGNALS.in_mode("hold"):  # a signal now waits for the file to be whole
            checkpoints.save_checkpoint({
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": checkpoints.capture_rng_state(),
                "run": {"epoch": run.epoch, "batch": run.batch, "step": run.step, "best": run.best,
                        "start_loss": run.start_loss, "part": run.part,
                        "seconds_before": run.seconds_before + time.perf_counter() - run.started},
                "config": {**cfg.to_dict(), "lr": lr},
                "task": task.NAME, "task_source": resolve.task_identity(task)["source"],
                "data": data,  # what fixes the schedule: a resume on other data is refused
                "inputs": inputs,  # their shape and dtype; how images were read, as --predict reads new ones
                "step": run.step, "total_steps": total_steps,  # what --evaluate and the run checks read
            }, path)
    if name == "last.pt":
        run.saved_at, run.saved_step = (run.epoch, run.batch), run.step


@contextmanager
def stops_in_one_line(run: Run, save, out_dir: Path, world_size: int):
    """An image the data cannot decode stops the run as Ctrl-C does: save, then say which file. A
    second signal stops it at once: say what last.pt holds."""
    try:
        yield
    except UnreadableImage as err:
        if (run.epoch, run.batch) != run.saved_at:
            save(run, "last.pt")
        then = ("nothing was trained yet; replace or delete it and run again" if run.saved_step is None
                else f"{out_dir / 'last.pt'} holds step {run.saved_step}; replace or delete it, then "
                f"continue with `{continue_command(out_dir, world_size)}`")
        raise UnreadableImage(f"{err}; {then}") from None
    except distributed.Interrupted as err:
        kept = ("no checkpoint was written" if run.saved_step is None else f"{out_dir / 'last.pt'} holds "
                f"step {run.saved_step}; continue with `{continue_command(out_dir, world_size)}`")
        raise UserError(f"interrupted again by {err}: stopped at once at step {run.step}; {kept}",
                        128 + err.signum) from None


def resume(ckpt: dict, path: Path, cfg: Config, data: dict, model, optimizer, scheduler, scaler, say) -> Run:
    """Every state as it was saved (the RNGs' too), and the run as it stood: its next part. Data that
    no longer gives the same epochs is refused, before any state is put back."""
    checkpoints.check_same_data(ckpt, path, data)
    checkpoints.restore_training_state(ckpt, path, model, optimizer, scheduler, scaler)
    saved = ckpt["run"]
    run = Run(**{**saved, "part": saved["part"] + 1}, saved_at=(saved["epoch"], saved["batch"]),
              saved_step=saved["step"])
    say(f"resumed from {path} at step {run.step} "
        f"({checkpoints.position(run.epoch, run.batch, cfg.epochs, data['batches'])})")
    return run


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, batches: int):
    """The schedule in optimizer steps, from a config written in epochs."""
    total = steps_per_epoch(batches, cfg.accum_steps) * cfg.epochs
    options = {}
    if cfg.schedule == "onecycle":
        options = dict(pct_start=safe_pct_start(cfg.pct_start, total), div_factor=cfg.div_factor,
                       final_div_factor=cfg.final_div_factor)
    elif cfg.schedule == "step":
        every = cfg.step_size or max(cfg.epochs / 3, 1)
        options = dict(step_size=max(epochs_to_steps(every, batches, cfg.accum_steps), 1), gamma=cfg.gamma)
    elif cfg.schedule == "cosine":
        options = dict(min_lr_ratio=cfg.min_lr_ratio)
    warmup = epochs_to_steps(cfg.warmup_epochs, batches, cfg.accum_steps)
    if warmup >= total:
        raise UserError(f"warmup_epochs {cfg.warmup_epochs} covers the whole run of {cfg.epochs} epochs; "
                        "lower it")
    if cfg.schedule != "onecycle":
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
def evaluate(model, batches, task, cfg: Config, info, device, amp_dtype):
    """One pass over the validation split through the task's tally, kept on the device and read
    once at the end (summed over processes under torchrun)."""
    model.eval()
    tally = task.Tally(cfg, info, device)
    for inputs, targets in batches.epoch(0):
        with autocast(device, amp_dtype):
            outputs = model(inputs)
        tally.add(outputs, targets, inputs)
    model.train()
    return tally.result(distributed.all_reduce_sum)


# ---------------------------------------------------------------- --lr find


def find_lr(cfg: Config, task, model, batches, info, amp_dtype, device: torch.device) -> float:
    """--lr find: lr_find.py's sweep on this very model and data, its files written, its suggestion.

    Under torchrun rank 0 sweeps alone while the others wait for the rate: it accumulates
    world_size of its batches per step, so each step sees the global batch as DDP will. All ranks
    sweeping together would need the stop rule agreed at every step; one rank keeps lr_find as it is.
    """
    found = problem = None
    world_size = distributed.world_size()
    check_graphs(cfg, device, amp_dtype, world_size)  # a --cuda-graphs the run will refuse: before the sweep
    if distributed.rank() == 0:
        try:
            result, wrote = lr_find.sweep_setup(cfg, task, model, batches, info, batches_per_step=world_size)
            found = result.suggestion
            fix = "" if result.why_none == lr_find.FIRST_LOSS_NOT_FINITE else (
                f"; look at {wrote[-1]}, widen --find-start-lr/--find-end-lr or raise --find-iters, or pass "
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


def diverged(what: str, optimizer, lr: float, run: Run, out_dir: Path) -> UserError:
    """The line a diverged run stops with: where, at what rate, what to try, and what last.pt holds. A
    first loss that is not finite came before any step: the data or the model, not the rate."""
    at_lr = optimizer.param_groups[0]["lr"]
    kept = ("this run wrote no checkpoint" if run.saved_step is None
            else f"{out_dir / 'last.pt'} still holds step {run.saved_step}")
    if run.start_loss is not None and not math.isfinite(run.start_loss):
        return UserError(f"the first batch's loss is {run.start_loss}, before any optimizer step: not the "
                         "learning rate but the data or the model (nan or inf in the inputs or targets, or a "
                         f"layer that makes them); check them, e.g. the dataset's files; {kept}")
    return UserError(f"training diverged at step {run.step} ({what}; lr {at_lr:.3g}): try a lower --lr than "
                     f"{lr:.3g}, e.g. --lr {lr / 10:.2g}, or `python lr_find.py` with the same options "
                     f"to find one; {kept}")


# ---------------------------------------------------------------- --evaluate, --predict and the command line


def evaluate_checkpoint(cfg: Config, given: dict | None = None, task=default_task) -> dict:
    """--evaluate PATH: the validation split once through a saved model; trains nothing. Writes
    eval.json and the task's pictures next to the checkpoint (or into an --out-dir given here).
    `given`: the settings the command line gave (None: all of cfg's)."""
    given = cfg.to_dict() if given is None else given
    path = Path(cfg.evaluate)
    if not path.is_file():
        raise UserError(f"--evaluate {path}: no such file (a best.pt, last.pt or state_dict)")
    ckpt = checkpoints.load_checkpoint(path)
    ours = isinstance(ckpt.get("config"), dict)  # else a plain state_dict: no task or classes to check
    if ours and (edited := checkpoints.check_task(ckpt, path, task, "evaluate it with its own task.py")):
        print(edited)
    cfg = resolve.evaluated_config(cfg, given, ckpt.get("config"))  # ours: built as it was trained
    rank, world_size, device = distributed.setup(cfg.device)
    _, val_batches, info = build_loaders(cfg, device, rank, world_size, targets=task.TARGETS)
    if ours:
        checkpoints.check_classes(ckpt, path, info.names, "evaluate it on the data it was trained on")
    model = build_model(cfg, info.input_shape[0], len(info.names), device)
    load_weights(model, ckpt, len(info.names), f"--evaluate {path}", new_head=False)
    check_model(model, val_batches, task, cfg, info)
    with closing(val_batches):  # its workers stop on the way out, as train() and predict()'s do
        val = evaluate(model, val_batches, task, cfg, info, device, amp_setup(device, cfg.amp)[0])
    out_dir = Path(cfg.out_dir) if "out_dir" in given else path.parent
    pictures = task.pictures(val, info.names, None)
    return logs.report_evaluation(task, val, pictures, val_size=info.val_size, checkpoint=path,
                                  step=ckpt.get("step"), dataset=cfg.dataset, out_dir=out_dir,
                                  is_main=rank == 0)


@torch.no_grad()
def predict(cfg: Config, given: dict | None = None, task=default_task) -> Path:
    """--predict PATH: each image through a saved model, read as its run read its own (the checkpoint
    keeps how), one row each from the task, in predictions.csv next to the checkpoint (or in an
    --out-dir given here). The outputs stay on the device until the last batch: one read in all."""
    given = cfg.to_dict() if given is None else given
    path = Path(cfg.checkpoint)
    ckpt = checkpoints.load_predictor(path, task)
    cfg = resolve.evaluated_config(cfg, given, ckpt["config"])  # built as it was trained
    device, names = distributed.pick_device(cfg.device), ckpt["data"]["names"]
    reading = ckpt["inputs"]["images"]  # how the run read its images
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
    return logs.write_predictions(out_dir / "predictions.csv", header, rows, files, skipped, cfg.tta)


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
                configs.validate(cfg)
            train(cfg, given)
    except UserError as err:
        if err.code == 0:  # nothing to do (a complete run resumed): said, and not an error
            if os.environ.get("RANK", "0") == "0":
                print(err)
            return
        # Under torchrun, one line from one process; a file only one rank read, from that rank.
        if os.environ.get("RANK", "0") == "0" or isinstance(err, UnreadableImage):
            distributed.tell_torchrun(f"error: {err}")
            configs.exit_with_error(str(err), err.code)
        raise SystemExit(err.code) from None
    except (KeyboardInterrupt, Exception) as err:  # a signal outside the loop, or a known torch failure
        if os.environ.get("RANK", "0") != "0" and not isinstance(err, KeyboardInterrupt):
            raise  # torch's long report, from rank 0 alone
        configs.exit_with_error(*distributed.failure_line(
            err, " outside the training loop; every checkpoint is as it was: run the command again, or "
            "continue with --resume"))
    finally:
        distributed.release_all()
        distributed.cleanup()


if __name__ == "__main__":
    main()
