"""Train a model: `python train.py [--config configs/X.toml] [--field value ...]`.

train() reads top to bottom: the setup, then for each optimizer step its micro-batches, at each epoch's end an
evaluation and a checkpoint, and at the end best.pt once through the test split. Each option is chosen once,
at setup: what is off is never entered. Several GPUs: `torchrun --nproc_per_node=N train.py ...`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import task as default_task
from configs import TRAIN_SETTINGS, Config, UserError, command_line, evaluate_takes, parse_given
from data import DATASETS
from machinery import checkpoints, contract, logs, processes, run_folder, stops
from machinery.batches import build_plain, plain
from machinery.files import write_json_atomic
from machinery.processes import amp_setup, autocast
from models import OPTIMIZERS, build_model, build_optimizer, input_needs
from schedules import SCHEDULES, build_scheduler, epochs_to_steps, optimizer_step, safe_pct_start

CHOICES = {"dataset": DATASETS, "optimizer": OPTIMIZERS, "schedule": SCHEDULES}  # the names each flag takes


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
        """An epoch ended with `score` (the main metric): whether it is the best yet; --early-stop counts."""
        gain = math.inf if self.best is None else (score - self.best if task.HIGHER_IS_BETTER
                                                   else self.best - score)
        self.epoch += 1
        self.batch = 0
        self.best = score if gain > 0 else self.best
        self.stale = 0 if gain > cfg.min_delta else self.stale + 1
        if cfg.early_stop and self.stale >= cfg.early_stop and self.epoch < cfg.epochs:
            self.stopped = (f"val {task.MAIN_METRIC} did not improve by more than {cfg.min_delta:g} in "
                            f"{self.stale} evaluations (--early-stop {cfg.early_stop})")
        return gain > 0


def train(cfg: Config, given: dict | None = None, task=default_task) -> dict:
    """One run (resumed: its checkpoint's config, the flags `given` now on top); what summary.json holds."""
    # ---- Setup: the config (a resume's), this process's place, the rate, the run folder (claimed).
    cfg, resumed = run_folder.resume(cfg, given, task, CHOICES)  # resumed: None for a new run
    process = processes.start(cfg.device, cfg.dist_timeout, cfg.deterministic)  # alone, or torchrun's
    lr, lr_note = chosen_lr(cfg, given, task)  # the note: the default rate on other data than digits
    out_dir = run_folder.claim(Path(cfg.out_dir), resumed, process)

    # ---- Data, model, optimizer and schedule, built as lr_find.py builds them; val chooses best.pt.
    batches, info, model = setup(cfg, task, process.device, shard=process.shard, fresh=resumed is None)
    amp_dtype, scaler = amp_setup(process.device, cfg.amp)  # bf16 where the GPU has it, or fp16 + a scaler
    optimizer, scheduler, turns, total_steps = optimizers(model, cfg, lr, info.batches, process.world_size)
    ema = averaged(model, cfg.ema) if cfg.ema else None  # evaluation and best.pt use it; never trained
    process.on_rank0(checkpoints.check_free_space, out_dir, model, optimizer, ema)
    saves = keeping_best(cfg.keep_best, task, resumed) if cfg.keep_best else stops.Stops  # --keep-best's

    # ---- Resume: every state as saved (the RNGs' too), on data giving the same epochs; --profile; --compile.
    states = {"model": model, "ema": ema, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    progress = Progress() if resumed is None else resumed.restore(info, cfg.epochs, Progress, **states)
    traced = profiled(optimizer, cfg, given, resumed, out_dir, process, total_steps - progress.step) if (
        cfg.profile) else contextlib.nullcontext()  # --profile's torch.profiler (refused before any log)
    evaluated = ema.average if ema else model  # what evaluation measures and best.pt keeps
    training, evaluation, free_gradients = compiled(model, evaluated, cfg, info.notes, process) if (
        cfg.compile != "off") else (model, evaluated, True)  # what the loop calls to train, to evaluate
    ddp_model = process.parallel(training)  # under torchrun its one DDP wrapper; alone the model itself

    # ---- Outputs: the logs --log-to names (rank 0), the resolved config, and what this run is, said once.
    log = logs.Logs(out_dir, cfg, lr, resumed=resumed, active=process.rank == 0)  # first: --log-to's packages
    process.on_rank0(write_json_atomic, out_dir / "config.json", {**cfg.to_dict(), "lr": lr})
    logs.announce(cfg, task, info, log.moved, (model, process, amp_dtype, lr, total_steps, lr_note))

    def checkpoint() -> dict:  # every state to continue bit for bit from `progress`
        run = {**asdict(progress), "seconds_before": progress.seconds_before + time.perf_counter() - started}
        return {**{name: state.state_dict() if state else None for name, state in states.items()},
                "rng": checkpoints.capture_rng_state(), "run": run, "config": {**cfg.to_dict(), "lr": lr},
                "task": task.NAME, "task_source": checkpoints.task_identity(task)["source"],
                "data": info.data_record(), "inputs": info.inputs_record(), "step": progress.step,
                "total_steps": total_steps, "trackers": log.run_ids(),
                "unlogged": checkpoints.unlogged(losses, counts)}  # losses since the last log point

    # ---- Training: for each optimizer step its micro-batches; at each epoch's end, evaluate and save.
    speed = metered(cfg, model, batches, task, info, amp_dtype, process) if cfg.throughput else logs.Speed()
    started, weights, val = time.perf_counter(), {}, None
    losses, counts = resumed.unlogged(process.device) if resumed else ([], [])  # since the last log point
    with log, run_folder.holding(out_dir), batches, traced:  # held, and open, until summary.json is written
        with saves(out_dir, progress, checkpoint, log, process) as stop:  # no epochs: a run's end
            for epoch in range(progress.epoch, progress.epoch if progress.stopped else cfg.epochs):
                bar = logs.progress_bar(info.batches, progress.batch, f"epoch {epoch + 1}/{cfg.epochs}")
                stream = speed.start(batches.train.epoch(epoch, progress.batch), progress.batch)
                while progress.batch < info.batches:
                    # accum_steps micro-batches a step, each loss weighted as in one batch k x N large
                    window = [*itertools.islice(stream, min(cfg.accum_steps, info.batches - progress.batch))]
                    normalizers = [task.normalizer(targets, cfg, info) for _, targets in window]
                    weight = step_weight(normalizers, process, weights)
                    stop.begin_step()
                    for turn, optimizer, scheduler in turns:  # turn: {}, or {"turn": which network}
                        optimizer.zero_grad(set_to_none=free_gradients)  # its gradients, from nothing
                        for micro_step, (inputs, targets) in enumerate(window):
                            with process.gradient_sync(ddp_model, micro_step == len(window) - 1):  # last's
                                with autocast(process.device, amp_dtype):
                                    loss = task.loss(ddp_model(inputs, **turn), targets, cfg, info, **turn)
                                # backward from `weight` rather than 1: loss x weight's gradients, no multiply
                                (scaler.scale(loss) if scaler else loss).backward(weight)
                            losses.append(loss.detach())
                            if progress.start_loss is None:  # a new run's first batch: divergence's yardstick
                                progress.start_loss = (losses[0] / normalizers[0]).item()
                                log.images({"inputs": task.input_picture(
                                    inputs, targets, info.names, batches.train.to_pixels)}, 0)
                        counts += normalizers  # networks in turn: train/loss is their losses' mean

                        # The step, the schedule's after it only if it happened (fp16: skips on inf); no sync
                        step_lr = optimizer.param_groups[0]["lr"]  # this step's, shown at the log point
                        if optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad) and ema:
                            progress.averaged += 1
                            ema.update(progress.averaged)
                    progress.step += 1
                    progress.batch += len(window)

                    # Log points, every log_every steps and at the epoch's end: the only reads of the device
                    log_point = progress.step % cfg.log_every == 0 or progress.batch == info.batches
                    if log_point:
                        train_loss = (torch.stack(losses).sum() / sum(counts)).item()
                        losses, counts = [], []
                        log.write(("train/loss", progress.step, train_loss), ("train/lr", progress.step,
                                                                              step_lr))
                        bar.update(progress.batch - bar.n)
                        bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{step_lr:.3g}")
                        stop.check_divergence(train_loss)
                    if cfg.save_every and progress.step % cfg.save_every == 0:
                        stop.save()
                    stop.stop_if_signalled(log_point)  # Ctrl-C, SIGTERM, ...: saved, then one line
                bar.close()

                # ---- Epoch end: rank 0's BatchNorm statistics on every rank, evaluate, best.pt, save.
                process.share([*model.buffers(), *(ema.average.buffers() if ema else [])])
                pace = speed.end(info.batches, cfg.batch_size, process.device, info.images)
                val = evaluate(evaluation, batches.val, task, cfg, info, amp_dtype, process)  # --ema: average
                logs.log_evaluation(val, task, info.names, batches.val, progress.step, log)
                line = f"epoch {epoch + 1}/{cfg.epochs}  step {progress.step}  {task.describe(val)}{pace}"
                stop.check_val_loss(val.metrics["loss"], line)  # not finite: the line, then the stop's
                stop.save(best=progress.evaluated(val.metrics[task.MAIN_METRIC], task, cfg), val=val.metrics)
                processes.say(line)  # after the saves: a closed stdout (`| head`) cannot cost the epoch
                if progress.stopped:
                    processes.say(f"early stop after epoch {epoch + 1}/{cfg.epochs}: {progress.stopped}; "
                                  f"best.pt holds the best val {task.MAIN_METRIC}")
                    break
                stop.stop_if_signalled(True)  # a signal in the evaluation: saved just now

        # ---- The end: do the ranks agree; the test split, which chose nothing, once through best.pt.
        in_sync = process.agree(model) and (not ema or process.agree(ema.average))
        val = val or evaluate(evaluation, batches.val, task, cfg, info, amp_dtype, process)  # a resumed end
        test = None if batches.test is None else evaluate(  # after agree(): best.pt's weights replace these
            load_best(evaluated, evaluation, out_dir / "best.pt", process), batches.test, task, cfg, info,
            amp_dtype, process)
        logs.log_evaluation(test, task, info.names, batches.test, progress.step, log, "test")
        summary = logs.run_summary(task, (val, test), progress, time.perf_counter() - started, {
            "epochs": cfg.epochs, **speed.facts(), "device": str(process.device),
            "lr": lr, "world_size": process.world_size, "ranks_in_sync": in_sync, **info.sizes()})
        process.on_rank0(logs.write_summary, summary, cfg, task, val, info.names, log)
    return summary


def setup(cfg: Config, task, device: torch.device, *, shard: tuple[int, int] = (0, 1), fresh: bool = True,
          trains: bool = True):
    """cfg.dataset's data and the model built for it, each checked against the task (two examples through
    both): what train() trains, lr_find.py sweeps and evaluate.py measures. `fresh`: not resumed."""
    checkpoints.seed_rngs(cfg.seed)
    source = DATASETS[cfg.dataset](cfg)
    batches, info = build_loaders(cfg, source, device, targets=task.TARGETS, shard=shard,
                                  needs=input_needs(cfg.model, cfg.pretrained),
                                  follow=getattr(task, "augmented_targets", None),  # optional
                                  moves=getattr(task, "TARGETS_MOVE_WITH_IMAGES", None))  # optional
    if trains:
        contract.check_trainable(cfg, info)
    model = build_model(cfg, info.input_shape[0], len(info.names), device, fresh=fresh, notes=info.notes)
    info.notes.append(contract.check_model(model, batches.train, task, cfg, info))
    return batches, info, model


def build_loaders(cfg: Config, source, device: torch.device, *, targets: str, needs, shard=(0, 1),
                  follow=None, moves=None) -> tuple:
    """The data path, chosen once: tensors on the device (batches.py), or any other data (served.py)."""
    if plain(cfg, source, device, follow):
        return build_plain(cfg, source, device, targets=targets, needs=needs, shard=shard, moves=moves)
    from machinery.served import build_served

    return build_served(cfg, source, device, targets=targets, needs=needs, shard=shard, follow=follow,
                        moves=moves)


def averaged(model: torch.nn.Module, decay: float):
    """--ema: an exponential moving average of the weights (machinery/precision.py)."""
    from machinery.precision import Ema

    return Ema(model, decay)


def keeping_best(keep: int, task, resumed):
    """--keep-best K: Stops whose epoch-end saves keep the K best checkpoints too (machinery/kept_best.py)."""
    from machinery.kept_best import KeepingBest

    return lambda *args: KeepingBest(*args, keep=keep, task=task, resumed=resumed)


def compiled(model: torch.nn.Module, evaluated: torch.nn.Module, cfg: Config, notes: list, process) -> tuple:
    """--compile: the training and the evaluation forward, each compiled once (machinery/precision.py)."""
    from machinery.precision import compile_model

    return compile_model(model, evaluated, cfg.compile, process.device, notes=notes,
                         accum_steps=cfg.accum_steps, batch_size=cfg.batch_size // process.world_size)


def metered(cfg: Config, model: torch.nn.Module, batches, task, info, amp_dtype, process):
    """--throughput: logs.Speed that also gives TFLOP/s, MFU and the share of time waiting for batches
    (machinery/throughput.py)."""
    from machinery.throughput import measured

    return measured(model, batches.train, task, cfg, info, amp_dtype, process.world_size)


def profiled(optimizer: torch.optim.Optimizer, cfg: Config, given: dict | None, resumed, out_dir: Path,
             process, steps_left: int):
    """--profile: steps after a warm-up traced into the run folder (machinery/profile.py), in the context
    returned. The checkpoint's config keeps --profile: a resume traces only where it is given again (`given`
    None: all of cfg is), else it could not end with few steps left and would overwrite the first trace."""
    if not (resumed is None or given is None or "profile" in given):
        return contextlib.nullcontext()
    from machinery.profile import record_steps

    return record_steps(optimizer, cfg.profile, out_dir, device=process.device, steps_left=steps_left,
                        rank=process.rank, restart=resumed is not None and cfg.resume == "auto")


def chosen_lr(cfg: Config, given: dict | None, task) -> tuple[float, str | None]:
    """The rate a run trains with; where it is the default and the data not digits, a note that says so."""
    if cfg.lr == "auto":  # lr_find.json's suggestion, where its sweep measured this setup
        from machinery.lr_auto import resolve_lr

        return resolve_lr(cfg, task, OPTIMIZERS), None
    if given is None or "lr" in given or cfg.resume or cfg.dataset == Config.dataset:
        return float(cfg.lr), None
    refind = command_line("lr_find.py", cfg, leave_out=("lr", "epochs", "log_every", "save_every"))
    said = (f"lr {cfg.lr:g} is the default, chosen for {Config.dataset}: on {cfg.dataset} it may train far "
            f"worse; measure this data's with `{refind}`, then train with --lr auto")
    return float(cfg.lr), said


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, batches_per_epoch: int):
    """The schedule in optimizer steps, from a config written in epochs."""
    def steps(epochs: float) -> int:
        return epochs_to_steps(epochs, batches_per_epoch, cfg.accum_steps)

    total = steps(cfg.epochs)
    options = dict(pct_start=safe_pct_start(cfg.pct_start, total), div_factor=cfg.div_factor,
                   final_div_factor=cfg.final_div_factor) if cfg.schedule == "onecycle" else (
        warm_options(cfg, steps, total))  # onecycle's warm phase is pct_start
    try:
        return build_scheduler(optimizer, cfg.schedule, total, **options), total
    except ValueError as err:  # schedules.py checks its inputs; here that is a config problem
        raise UserError(f"the {cfg.schedule} schedule does not fit this run of {total} optimizer "
                        f"steps: {err}; change its options or --epochs") from None


def optimizers(model: torch.nn.Module, cfg: Config, lr: float, batches_per_epoch: int,
               world_size: int) -> tuple:
    """The optimizer, its schedule, what a step steps (it, or each network's: in_turn) and the steps."""
    if hasattr(model, "turns"):
        return in_turn(model, cfg, lr, batches_per_epoch, world_size)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, batches_per_epoch)
    return optimizer, scheduler, [({}, optimizer, scheduler)], total_steps


def in_turn(model: torch.nn.Module, cfg: Config, lr: float, batches_per_epoch: int, world_size: int) -> tuple:
    """The networks a model trains in turn (its turns(), machinery/turns.py), each with an optimizer and a
    schedule of its own, built from the same flags as one model's."""
    from machinery.turns import Turns, networks

    turns = []
    for turn, network in networks(model, cfg, world_size).items():
        optimizer = build_optimizer(network, cfg, lr)
        scheduler, total_steps = make_scheduler(cfg, optimizer, batches_per_epoch)
        turns.append((turn, optimizer, scheduler))
    saved = Turns(turns)  # the checkpoint's "optimizer" and what the loop steps
    return saved, None, saved, total_steps


def warm_options(cfg: Config, steps, total: int) -> dict:
    """The options of the schedules that take a linear warmup (constant, warmup, step, cosine), in steps."""
    warmup = steps(cfg.warmup_epochs)
    if warmup >= total:
        raise UserError(f"warmup_epochs {cfg.warmup_epochs} covers the whole run of {cfg.epochs} epochs; "
                        "lower it")
    step_size = max(steps(cfg.step_size), 1) if cfg.step_size else None  # None: schedules.py's third
    options = {"step": dict(step_size=step_size, gamma=cfg.gamma),
               "cosine": dict(min_lr_ratio=cfg.min_lr_ratio)}
    return {**options.get(cfg.schedule, {}), "warmup_steps": warmup}


def step_weight(counts: list, process, weights: dict) -> torch.Tensor:
    """1 / the step's normalizers summed over every process, x the processes (DDP averages gradients): a
    tensor count is summed on the device, never read; a number's weight is made once, in `weights`."""
    total = sum(counts)
    if isinstance(total, torch.Tensor):
        counted = process.sum(total.float()).clamp_min(1e-30)  # none counted: zero gradients
        return process.world_size / counted
    if total not in weights:
        weights[total] = torch.tensor(1 / total, device=process.device)
    return weights[total]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, task, cfg: Config, info, amp_dtype, across=processes.ALONE):
    """One pass over a split through the task's Tally, kept on the device and read once at the end; under
    torchrun each process tallies its shard, and `across` (the process) combines them."""
    training = model.training
    model.eval()
    tally = task.Tally(cfg, info, batches.device)
    for inputs, targets in batches.epoch(0):
        with autocast(batches.device, amp_dtype):
            outputs = model(inputs)
        tally.add(outputs, targets, inputs)
    model.train(training)  # as it was: an --ema average stays in eval mode
    return tally.result(across)


def load_best(evaluated: torch.nn.Module, evaluation: torch.nn.Module, path: Path, process):
    """best.pt's weights (its --ema average, if any) into `evaluated`, read by rank 0, shared with all."""
    if process.rank == 0:
        evaluated.load_state_dict(checkpoints.weights_of(checkpoints.load_checkpoint(path)))
    process.share(evaluated.state_dict().values())
    return evaluation


def main() -> None:
    with stops.one_line(" outside the training loop; every checkpoint is as it was: run the command again, "
                        "or continue with --resume", program=__name__ == "__main__"):
        given = parse_given(description=__doc__.splitlines()[0], choices=CHOICES, offered=TRAIN_SETTINGS,
                            elsewhere=evaluate_takes)  # evaluate.py's flags: the command that takes them
        if given.get("seeds"):  # --seeds N: a run a seed, then their spread (machinery/seeds.py)
            from machinery.seeds import repeat

            return repeat(train, given, default_task, OPTIMIZERS)
        train(Config(**given), given)


if __name__ == "__main__":
    main()
