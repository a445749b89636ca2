"""Train a model: `python train.py [--config configs/X.toml] [--field value ...]`.

train() reads top to bottom: the run's setup, a resume's restore, then for each optimizer step its
micro-batches, and at each epoch's end an evaluation and a checkpoint; at the end best.pt once through the
test split, and summary.json. The loss and the metrics are task.py's, the data data.py's, the model
models.py's; machinery/ holds what surrounds the loop. Several GPUs: `torchrun --nproc_per_node=N
train.py ...`. evaluate.py measures or uses a saved model.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import task as default_task
from configs import Config, UserError, parse_given
from data import DATASETS
from machinery import checkpoints, logs, lr_auto, processes, run_folder, stops
from machinery.batches import DataInfo, Splits, build_loaders
from machinery.contract import check_model
from machinery.files import write_json_atomic
from machinery.precision import Compiled, Ema, amp_setup, autocast, compile_model, keeps_gradients
from machinery.weights import weights_of
from models import OPTIMIZERS, build_model, build_optimizer, input_needs
from schedules import SCHEDULES, build_scheduler, epochs_to_steps, optimizer_step, safe_pct_start

# The names --dataset, --optimizer and --schedule take (and --help lists): each list where it is defined.
CHOICES = {"dataset": DATASETS, "optimizer": OPTIMIZERS, "schedule": SCHEDULES}


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
    run_id: str = field(default_factory=lambda: secrets.token_hex(6))  # summary.json names it: this run's

    def evaluated(self, score: float, task, cfg: Config) -> bool:
        """An epoch ended with `score`, the task's main metric: on to the next one. Whether it is the best
        so far (best.pt); --early-stop counts the evaluations without a gain over --min-delta."""
        gain = math.inf if self.best is None else (score - self.best if task.HIGHER_IS_BETTER
                                                   else self.best - score)
        self.epoch, self.batch = self.epoch + 1, 0
        self.best = score if gain > 0 else self.best
        self.stale = 0 if gain > cfg.min_delta else self.stale + 1
        if cfg.early_stop and self.stale >= cfg.early_stop and self.epoch < cfg.epochs:
            self.stopped = (f"val {task.MAIN_METRIC} did not improve by more than {cfg.min_delta:g} in "
                            f"{self.stale} evaluations (--early-stop {cfg.early_stop})")
        return gain > 0


def train(cfg: Config, given: dict | None = None, task=default_task) -> dict:
    """One run; a resume continues with its checkpoint's config, `given` (the flags given now; None: all
    of cfg) on top. Returns what summary.json holds."""
    # ---- Setup: a resume's checkpoint and config, this process's place, the rate, the run folder (claimed).
    cfg, resumed = run_folder.resume(cfg, given, task, CHOICES)  # resumed: None for a new run
    rank, world_size, device = processes.start(cfg.device, cfg.dist_timeout, cfg.deterministic)
    lr = lr_auto.resolve_lr(cfg, task, OPTIMIZERS)  # a number; --lr auto: lr_find.json's suggestion
    out_dir = run_folder.claim(Path(cfg.out_dir), resumed)
    checkpoints.seed_rngs(cfg.seed)

    # ---- Data, model, optimizer and schedule, built as lr_find.py builds them; val chooses best.pt.
    batches, info, model = setup(cfg, task, device, shard=(rank, world_size), fresh=resumed is None)
    amp_dtype, scaler = amp_setup(device, cfg.amp)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, info.batches)
    ema = Ema(model, cfg.ema) if cfg.ema else None  # --ema: the average is evaluated and kept, never trained
    processes.on_rank0(checkpoints.check_free_space, out_dir, model, optimizer)

    # ---- Resume: every state as saved (the RNGs' too), on data giving the same epochs; then --compile.
    progress = checkpoints.restore(resumed, info, cfg.epochs, Progress, model=model, optimizer=optimizer,
                                   scheduler=scheduler, scaler=scaler, ema=ema and ema.average)
    compiled = compile_model(model, ema.average if ema else model, cfg.compile, device, notes=info.notes,
                             accum_steps=cfg.accum_steps, batch_size=cfg.batch_size // world_size)
    ddp_model = processes.data_parallel(compiled.training, device)  # under torchrun: its one DDP wrapper

    # ---- Outputs: the logs --log-to names (rank 0), the resolved config, and what this run is, said once.
    tensorboard = logs.TensorBoard(out_dir, cfg, resumed, lr, active=rank == 0)  # first: --log-to's packages
    processes.on_rank0(write_json_atomic, out_dir / "config.json", {**cfg.to_dict(), "lr": lr})
    logs.announce(cfg, task, info, tensorboard.moved)
    logs.describe_run(cfg, model, (device, amp_dtype), lr, total_steps)

    def checkpoint() -> dict:
        """Every state to continue bit for bit from `progress` ("data": what a resume checks; "inputs")."""
        run = {**asdict(progress), "seconds_before": progress.seconds_before + time.perf_counter() - started}
        return {"model": model.state_dict(), "ema": ema.average.state_dict() if ema else None,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler else None, "rng": checkpoints.capture_rng_state(),
                "run": run, "config": {**cfg.to_dict(), "lr": lr}, "task": task.NAME,
                "task_source": checkpoints.task_identity(task)["source"], "data": info.data_record(),
                "inputs": info.inputs_record(), "step": progress.step, "total_steps": total_steps,
                "trackers": tensorboard.run_ids(), "unlogged": checkpoints.unlogged(losses, counts)}

    # ---- Training: for each optimizer step its micro-batches; at each epoch's end, evaluate and save.
    started, speed, seeds, val = time.perf_counter(), logs.Speed(), {}, None
    losses, counts = checkpoints.restore_unlogged(resumed, device)  # since the last log point, on the device
    stop = stops.Stops(out_dir, progress, checkpoint, tensorboard)
    with tensorboard, run_folder.holding(out_dir), batches, stop:  # no epochs left: a resume of a run's end
        for epoch in range(progress.epoch, progress.epoch if progress.stopped else cfg.epochs):
            bar = logs.progress_bar(info.batches, progress.batch, f"epoch {epoch + 1}/{cfg.epochs}")
            stream = batches.train.epoch(epoch, progress.batch)
            speed.start(progress.batch)
            while progress.batch < info.batches:
                # Accumulation: accum_steps micro-batches a step (fewer at an epoch's end), drawn first, each
                # summed loss weighted by 1 / the step's normalizers on all processes: one batch k x N large.
                window = [next(stream) for _ in range(min(cfg.accum_steps, info.batches - progress.batch))]
                normalizers = [task.normalizer(targets, cfg, info) for _, targets in window]
                weight, stop.step_begun = step_weight(normalizers, world_size, device, seeds), progress.step
                for micro_step, (inputs, targets) in enumerate(window):
                    with processes.gradient_sync(ddp_model, micro_step == len(window) - 1):  # the last's only
                        with autocast(device, amp_dtype):
                            loss = task.loss(ddp_model(inputs), targets, cfg, info)
                        # backward from `weight` rather than 1: loss x weight's gradients, no multiply
                        (scaler.scale(loss) if scaler else loss).backward(weight)
                    losses.append(loss.detach())
                    if progress.start_loss is None:  # a fresh run's first batch: the divergence yardstick
                        progress.start_loss = (losses[0] / normalizers[0]).item()
                        tensorboard.images({"inputs": task.input_picture(
                            inputs, targets, info.names, batches.train.to_pixels)}, 0)
                counts += normalizers

                # The optimizer step, and the scheduler's with it (both skipped where GradScaler finds inf
                # gradients); the average follows the steps taken. The rate is a host number: no sync.
                rate = optimizer.param_groups[0]["lr"]  # this step's, logged at the log point
                if optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad or None) and ema:
                    progress.averaged += 1
                    ema.update(progress.averaged)
                optimizer.zero_grad(set_to_none=not keeps_gradients(cfg.compile, device, cfg.accum_steps))
                progress.step, progress.batch = progress.step + 1, progress.batch + len(window)

                # Log points (every log_every steps, and the epoch's last) are the only place the loop
                # reads the device: the loss since the last one, and the divergence check on it.
                log_point = progress.step % cfg.log_every == 0 or progress.batch == info.batches
                if log_point:
                    train_loss, losses, counts = (torch.stack(losses).sum() / sum(counts)).item(), [], []
                    tensorboard.write(("train/loss", progress.step, train_loss),
                                      ("train/lr", progress.step, rate))
                    bar.update(progress.batch - bar.n)
                    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.3g}")
                    stop.check_divergence(train_loss, device)
                if cfg.save_every and progress.step % cfg.save_every == 0:
                    stop.save()
                stop.stop_if_signalled(log_point, device)  # Ctrl-C, SIGTERM, ...: saved, then one line
            bar.close()

            # ---- Epoch end: rank 0's BatchNorm statistics on every rank, evaluate, best.pt, save.
            processes.share_from_rank0([*model.buffers(), *(ema.average.buffers() if ema else [])])
            rate = speed.end(info.batches, cfg.batch_size, device, info.images)
            val = evaluate(compiled.evaluation, batches.val, task, cfg, info, amp_dtype)  # --ema: the average
            logs.log_evaluation(val, task, info.names, batches.val, progress.step, tensorboard)
            line = f"epoch {epoch + 1}/{cfg.epochs}  step {progress.step}  {task.describe(val)}{rate}"
            stop.check_val_loss(val.metrics["loss"], line)  # not finite: the line, then the stop's
            stop.save(best=progress.evaluated(val.metrics[task.MAIN_METRIC], task, cfg))  # last.pt, best.pt
            processes.say(line)  # after the saves: a closed stdout (`| head`) cannot cost the epoch
            if progress.stopped:
                processes.say(f"early stop after epoch {epoch + 1}/{cfg.epochs}: {progress.stopped}; best.pt "
                              f"holds the best val {task.MAIN_METRIC}")
                break
            stop.stop_if_signalled(True, device)  # a signal in the evaluation: saved just now

    # ---- The end: do the ranks agree; the test split, which chose nothing, once through best.pt; summary.
    in_sync = processes.ranks_agree(model) and (not ema or processes.ranks_agree(ema.average))
    val = val or evaluate(compiled.evaluation, batches.val, task, cfg, info, amp_dtype)  # resumed
    test = None if batches.test is None else evaluate(  # after ranks_agree: best.pt's weights replace these
        load_best(compiled, out_dir / "best.pt"), batches.test, task, cfg, info, amp_dtype)
    logs.log_evaluation(test, task, info.names, batches.test, progress.step, tensorboard, "test")
    summary = logs.run_summary(task, (val, test), progress, time.perf_counter() - started, {
        "epochs": cfg.epochs, "examples_per_second": speed.steady(), "lr": lr, "world_size": world_size,
        "device": str(device), "ranks_in_sync": in_sync, **info.sizes()})
    processes.on_rank0(logs.write_summary, summary, cfg, task, val, info.names, tensorboard)
    return summary


def setup(cfg: Config, task, device: torch.device, *, shard: tuple[int, int] = (0, 1),
          fresh: bool = True) -> tuple[Splits, DataInfo, torch.nn.Module]:
    """The data of cfg.dataset, checked against the task, and the model built for it, checked against both
    (two examples through it and the loss): what train() trains, lr_find.py sweeps and evaluate.py
    measures. `shard`: this process's rank, of how many; `fresh`: the model starts from --pretrained or
    --init-from weights, where a resume or evaluation loads its own."""
    source = DATASETS[cfg.dataset](cfg)
    batches, info = build_loaders(cfg, source, device, targets=task.TARGETS, shard=shard,
                                  needs=input_needs(cfg.model, cfg.pretrained),
                                  follow=getattr(task, "augmented_targets", None))  # optional
    model = build_model(cfg, info.input_shape[0], len(info.names), device, fresh=fresh, notes=info.notes)
    info.notes.append(check_model(model, batches.train, task, cfg, info))
    return batches, info, model


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
        counted = processes.all_reduce_sum(total.float()).clamp_min(1e-30)  # none counted: zero gradients
        return world_size / counted
    if total not in seeds:
        seeds[total] = torch.tensor(1 / total, device=device)
    return seeds[total]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, task, cfg: Config, info, amp_dtype):
    """One pass over a split's batches through the task's tally, kept on their device and read once
    at the end: under torchrun each process tallies its shard, and the tally sums (or gathers, for a
    metric that needs every output) over the processes: the split's figures."""
    model.eval()
    tally = task.Tally(cfg, info, batches.device)
    for inputs, targets in batches.epoch(0):
        with autocast(batches.device, amp_dtype):
            outputs = model(inputs)
        tally.add(outputs, targets, inputs)
    model.train()
    return tally.result(processes.ACROSS_PROCESSES)  # callable: sums, for a result(reduce) of old


def load_best(compiled: Compiled, path: Path) -> torch.nn.Module:
    """The weights best.pt holds (its --ema average where it has one) into the evaluated model, read by
    rank 0 and shared with every rank, in place; returns what evaluation calls."""
    if processes.rank() == 0:
        compiled.evaluated.load_state_dict(weights_of(checkpoints.load_checkpoint(path)))
    processes.share_from_rank0(compiled.evaluated.state_dict().values())
    return compiled.evaluation


def main() -> None:
    with stops.one_line(" outside the training loop; every checkpoint is as it was: run the command again, "
                        "or continue with --resume", program=__name__ == "__main__"):
        from configs.resolve import TRAIN_SETTINGS, evaluate_takes

        given = parse_given(description=__doc__.splitlines()[0], choices=CHOICES, offered=TRAIN_SETTINGS,
                            elsewhere=evaluate_takes)  # evaluate.py's flags: the command that takes them
        train(Config(**given), given)


if __name__ == "__main__":
    main()
