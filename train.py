"""Train an image classifier: `python train.py [--config configs/X.toml] [--field value ...]`.

Read top to bottom: config -> data -> model and optimizer -> schedule -> (resume) -> loop ->
evaluate each epoch -> checkpoint -> summary. Multi-GPU: `torchrun --nproc_per_node=N train.py`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import runtime
from configs import Config, UserError, exit_with_error, parse_or_exit
from data import build_loaders
from lr_find import capture_rng_state, restore_rng_state
from models import build_model, build_optimizer
from schedules import build_scheduler, epochs_to_steps, optimizer_step, steps_per_epoch

# Settings that may differ when resuming: they change how a run is watched, not what it computes.
RESUME_MAY_CHANGE = {"out_dir", "resume", "device", "log_every", "save_every", "num_workers",
                     "loader", "data_dir", "compile", "allow_more_epochs", "find_start_lr",
                     "find_end_lr", "find_iters", "find_method"}
LENGTH_FREE_SCHEDULES = ("constant", "warmup", "step")  # curves that do not depend on the run's end


def resolve_lr(cfg: Config, say=print) -> float:
    """--lr auto takes the suggestion that lr_find.py wrote into the same out_dir for this schedule:
    onecycle's peak, or the starting rate of the others."""
    if cfg.lr != "auto":
        return float(cfg.lr)
    path = Path(cfg.out_dir) / "lr_find.json"
    fix = f"run `python lr_find.py --out-dir {cfg.out_dir}` first, or pass --lr 0.1"
    if not path.is_file():
        raise UserError(f"--lr auto needs {path}, which does not exist; {fix}")
    try:
        record = json.loads(path.read_text())
        picks = [s for s in record.get("suggestions", {}).values() if cfg.schedule in s["schedules"]]
        pick = picks[0] if picks else {"lr": record.get("suggestion"), "method": record.get("method")}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{path} is not a sweep that lr_find.py wrote; {fix}") from None
    if not pick["lr"]:
        raise UserError(f"{path} holds no usable suggestion for --schedule {cfg.schedule} (the sweep "
                        f"found none); {fix}")
    what = "its peak" if cfg.schedule == "onecycle" else "its starting rate"
    say(f"lr auto: {pick['lr']:.4g} from {path}, the suggestion for --schedule {cfg.schedule} "
        f"({what}, rule {pick['method']})")
    return float(pick["lr"])


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, batches: int):
    """The schedule in optimizer steps, from a config written in epochs."""
    total = steps_per_epoch(batches, cfg.accum_steps) * cfg.epochs
    options = {}
    if cfg.schedule == "onecycle":
        options = dict(pct_start=cfg.pct_start, div_factor=cfg.div_factor,
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
    return build_scheduler(optimizer, cfg.schedule, total, **options), total


def check_resumable(saved: dict, cfg: Config) -> None:
    """Refuse a resume whose config would change what the saved state means."""
    now = cfg.to_dict()
    diffs = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now
             if k not in RESUME_MAY_CHANGE and saved.get(k) != now[k]]
    if cfg.allow_more_epochs and cfg.schedule in LENGTH_FREE_SCHEDULES:
        diffs = [d for d in diffs if not (d.startswith("epochs:") and cfg.epochs > saved["epochs"])]
    if diffs:
        raise UserError(f"cannot resume: the config differs from the checkpoint's ({'; '.join(diffs)})"
                        "; use the same settings, or a new --out-dir")


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
def evaluate(model, batches, device, amp_dtype) -> tuple[float, float]:
    model.eval()
    totals = torch.zeros(3, device=device)  # loss sum, correct, count
    for inputs, targets in batches.epoch(0):
        with runtime.autocast(device, amp_dtype):
            logits = model(inputs)
        totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
        totals[1] += (logits.argmax(1) == targets).sum()
        totals[2] += len(targets)
    loss_sum, correct, count = runtime.all_reduce_sum(totals).tolist()
    model.train()
    return loss_sum / count, correct / count


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
    cfg = parse_or_exit(description=__doc__.splitlines()[0])
    try:
        train(cfg)
    except UserError as err:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, one line from one process
            exit_with_error(str(err))
        raise SystemExit(2) from None
    finally:
        runtime.cleanup_distributed()


def train(cfg: Config) -> dict:
    rank, world_size, device = runtime.setup_distributed(cfg.device)
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(cfg.out_dir)
    lr = resolve_lr(cfg, say)
    torch.manual_seed(cfg.seed)

    train_batches, val_batches, info = build_loaders(cfg, device, rank, world_size)
    model = build_model(cfg, info.channels, info.num_classes, device)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler, total_steps = make_scheduler(cfg, optimizer, len(train_batches))
    amp_dtype, scaler = runtime.amp_setup(device, cfg.amp)

    start_epoch, start_batch, step, best_acc = 0, 0, 0, 0.0
    if cfg.resume:
        path = out_dir / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
        ckpt = runtime.load_checkpoint(path)
        check_resumable(ckpt["config"], cfg)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_batch, step = ckpt["epoch"], ckpt["batch"], ckpt["step"]
        best_acc = ckpt.get("best_val_acc", 0.0)
        restore_rng_state(ckpt["rng"])
        say(f"resumed from {path} at epoch {start_epoch}, batch {start_batch}, step {step}")
    else:
        problem = runtime.from_rank0(unfinished_run(out_dir / "last.pt") if is_main else None)
        if problem:
            raise UserError(problem)

    fast = torch.compile(model) if cfg.compile else model
    net = fast
    if world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            fast, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint(epoch: int, batch: int, name: str = "last.pt") -> None:
        if is_main:
            runtime.save_checkpoint({
                "model": runtime.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "epoch": epoch, "batch": batch, "step": step, "total_steps": total_steps,
                "best_val_acc": best_acc,
                "rng": capture_rng_state(), "config": cfg.to_dict(),
            }, out_dir / name)

    writer = None
    if is_main:
        from torch.utils.tensorboard import SummaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps({**cfg.to_dict(), "lr": lr}, indent=2))
        writer = SummaryWriter(str(out_dir))
    params = sum(p.numel() for p in model.parameters())
    say(f"{cfg.dataset}: {info.train_size} train / {info.val_size} val, {info.channels}x"
        f"{info.image_size}x{info.image_size}, {info.num_classes} classes, via {info.loader}")
    say(f"{cfg.model} ({params / 1e6:.2f}M params) on {device}"
        f"{f' x{world_size} processes' if world_size > 1 else ''}, amp {amp_dtype or 'off'}, "
        f"{cfg.schedule} schedule, lr {lr:.4g}, {total_steps} optimizer steps")

    batches = len(train_batches)
    val_loss = val_acc = float("nan")
    epoch_rates, started = [], time.perf_counter()
    with StopFlag() as stop:
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
                images_this_epoch += len(targets) * world_size
                if not steps_now:
                    continue
                step_lr = optimizer.param_groups[0]["lr"]
                optimizer_step(optimizer, scheduler, scaler, clip_grad=cfg.clip_grad or None)
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % cfg.log_every == 0 or i + 1 == batches:
                    train_loss = (loss_sum / loss_count).item()
                    loss_sum.zero_()
                    loss_count = 0
                    if writer:
                        writer.add_scalar("train/loss", train_loss, step)
                        writer.add_scalar("train/lr", step_lr, step)
                    bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{step_lr:.3g}", refresh=False)
                    bar.update(i + 1 - bar.n)
                    stopping = world_size > 1 and stop.agreed(device)
                stopping = stopping or (world_size == 1 and bool(stop.signal))
                if stopping or (cfg.save_every and step % cfg.save_every == 0):
                    checkpoint(epoch, i + 1)
                if stopping:
                    say(f"interrupted at step {step}; saved {out_dir / 'last.pt'}; continue with "
                        "`python train.py --resume` and the same options")
                    raise SystemExit(128 + (stop.signal or signal.SIGTERM))
            bar.close()
            runtime.sync_buffers(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - epoch_start
            epoch_rates.append(images_this_epoch / max(seconds, 1e-9))
            start_batch = 0
            val_loss, val_acc = evaluate(fast, val_batches, device, amp_dtype)
            improved = val_acc > best_acc
            best_acc = max(best_acc, val_acc)
            if writer:
                writer.add_scalar("val/loss", val_loss, step)
                writer.add_scalar("val/acc", val_acc, step)
            say(f"epoch {epoch + 1}/{cfg.epochs}  step {step}  val loss {val_loss:.4f}  "
                f"val acc {val_acc:.2%}  ({epoch_rates[-1]:,.0f} img/s)")
            checkpoint(epoch + 1, 0)
            if improved:
                checkpoint(epoch + 1, 0, "best.pt")

    steady = epoch_rates[1:] or epoch_rates  # the first epoch pays for warm-up and compilation
    summary = {"val_acc": val_acc, "val_loss": val_loss, "best_val_acc": best_acc,
               "epochs": cfg.epochs, "steps": step, "seconds": time.perf_counter() - started,
               "images_per_second": sum(steady) / len(steady) if steady else math.nan,
               "lr": lr, "world_size": world_size, "device": str(device),
               "ranks_in_sync": runtime.ranks_agree(model)}
    if writer:
        hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)}
        writer.add_hparams({**hparams, "lr": lr},
                           {"hparam/val_acc": val_acc, "hparam/val_loss": val_loss},
                           run_name="hparams")
        writer.close()
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        say(f"done: val acc {val_acc:.2%} (best {best_acc:.2%}) in {summary['seconds']:.1f}s; "
            f"logs and checkpoints in {out_dir}")
    return summary


if __name__ == "__main__":
    main()
