"""Where the run's processes work and how they agree: the device, torchrun's process group and its
collectives, and the one line a process ends with under torchrun.

Under torchrun every process runs train.py; rank 0 alone prints, logs and saves, and decisions that only
rank 0 can make (its files, a signal it received) reach the others by a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from configs import UserError
from machinery.inputs import each


def pick_device(name: str = "auto", deterministic: bool = False) -> torch.device:
    """cuda > mps > cpu unless forced; under torchrun each process takes its LOCAL_RANK's GPU. CUDA runs
    fast (TF32, cuDNN autotuning), or with `deterministic` repeatably: deterministic kernels only (an op
    without one raises, and the scripts name it in one line), no autotuning, no TF32."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # refused just below
    backend = getattr(torch, device.type, None) if device.type in ("mps", "xpu") else None
    if device.type not in ("cpu", "cuda", "mps", "xpu") or (backend and not backend.is_available()):
        there = f"{name} is not on this machine" if backend else f"{name!r} is not a device to train on"
        raise UserError(f"--device {there}; use auto, cpu, cuda, cuda:N, mps or xpu") from None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda" and device.index is not None and world_size > 1:
        raise UserError(f"--device {name} would put all {world_size} torchrun processes on one GPU; "
                        "use --device cuda (each process takes its LOCAL_RANK's GPU)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device cuda was asked for but no CUDA GPU is visible; use --device cpu")
        if device.index is None:  # where each process sees one GPU (Slurm's --gpus-per-task=1), it is 0
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        if deterministic:  # cuBLAS reads this when it starts, at the first matmul: before it, here
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not deterministic
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = not deterministic, deterministic
    if deterministic:
        torch.use_deterministic_algorithms(True)
        if device.type != "cuda":
            say(f"--deterministic: on {device.type} the kernels already repeat bit for bit; only an op with "
                "no deterministic kernel would now stop the run")
    return device


def start(device_name: str, timeout_minutes: float = 60.0, deterministic: bool = False
          ) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun: one process per GPU (nccl), or gloo on CPU, whose
    collectives wait `timeout_minutes` for every process (--dist-timeout) before the job fails."""
    device = pick_device(device_name, deterministic)
    if "RANK" not in os.environ:
        return 0, 1, device
    watch_parent()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world_size))
    # Keys of this attempt's own: torchrun's restarts may keep its store, where a dead process's address
    # would otherwise be found first (gloo then connects to it, and fails or hangs).
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=timeout_minutes))
    return rank, world_size, device


def watch_parent() -> None:
    """Under torchrun: should the agent that started this process die (a kill -9 of torchrun), this
    process gets the SIGTERM the agent would have sent, so it saves and stops at its next log point,
    as the others do, instead of training on unwatched (and writing into a folder a new job may use)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="torchrun-agent-watch", daemon=True).start()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: rank 0 alone prints, logs and saves. Before the process group starts (a
    failure at start-up), torchrun's RANK says."""
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def say(*lines: str) -> None:
    """Print, once: on rank 0 alone under torchrun."""
    if rank() == 0:
        print(*lines, sep="\n")


def peer_lost(err: BaseException) -> bool:
    """Whether a failed collective says another process of the run is gone (killed, or stopped by
    torchrun after another failure): NCCL's errors are torch's DistError, gloo's a closed connection."""
    return is_distributed() and (isinstance(err, dist.DistError) or "gloo/transport" in str(err))


def gradient_sync(ddp_model: nn.Module, last: bool):
    """The block of a micro-batch's forward and backward: DDP all-reduces the gradients in the last
    micro-batch's backward only, the others' accumulate where they are (no_sync)."""
    return contextlib.nullcontext() if last or not is_distributed() else ddp_model.no_sync()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor)
    return tensor


def all_gather_rows(rows):
    """Every process's `rows` (a tensor, or a tuple or dict of them, as inputs are), one per example of its
    shard in the order its batches came, as the whole split's, in the split's order: rank r holds the
    examples r, r + W, r + 2W, ... of W processes (batches.py), so its row i is the split's example
    i x W + r. Other rows (each process's most confidently wrong) come back all, interleaved so. The row
    counts go first, then the rows, padded to the most any process holds; the padding is dropped."""
    if not is_distributed():
        return rows
    return each(lambda _, t: _gathered(t), rows)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    count, world_size = torch.tensor([len(t)], device=t.device), dist.get_world_size()
    counts = [torch.empty_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count)
    counts = torch.cat(counts)
    most = max(int(counts.max()), 1)
    padded = torch.zeros((most, *t.shape[1:]), dtype=torch.uint8 if t.dtype == torch.bool else t.dtype,
                         device=t.device)  # gloo sends no bool
    padded[:len(t)] = t
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    real = torch.arange(most, device=t.device)[:, None] < counts  # [row, rank]: not padding
    return torch.stack(parts, 1).flatten(0, 1)[real.flatten()].to(t.dtype)


class Across:
    """What a task's Tally.result combines its tallies with over torchrun's processes (in one process: as
    they are): `sum` for sums and counts, `gather` for what a metric needs whole (each example's scores
    or embedding: average precision, retrieval). Called as a function it sums, as the `reduce` that a
    Tally.result written before gather existed takes."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(tensor)

    def gather(self, rows):
        return all_gather_rows(rows)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(tensor)


ACROSS_PROCESSES = Across()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any, so that all of them stop at the same step."""
    if not is_distributed():
        return flag
    return all_reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0


def from_rank0(value):
    """Rank 0's value on every rank, for decisions only rank 0 can make (its files, say)."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def on_rank0(work: Callable, *args) -> None:
    """`work(*args)` on rank 0 alone (a check of its files, a write), its UserError raised on every
    rank: rank 0 decides, and one broadcast makes all ranks go on, or stop, together."""
    problem = None
    if not is_distributed():
        work(*args)
    elif rank() == 0:
        try:
            work(*args)
        except UserError as err:
            problem = str(err)
    problem = from_rank0(problem)  # on every rank: the ranks that did not run `work` wait here
    if problem:
        raise UserError(problem)


def share_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Copy rank 0's `tensors` to every rank, in place: weights that rank 0 alone read from a file, or
    BatchNorm statistics, which DDP broadcasts at the start of each forward, so that after the last one
    every rank holds statistics updated by its own shard (shared before evaluation and saving)."""
    if is_distributed():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def ranks_agree(module: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters and buffers (a DDP sanity check)."""
    if not is_distributed():
        return True
    flat = torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return not any_rank(not torch.equal(flat, reference), flat.device)


def data_parallel(model: nn.Module, device: torch.device) -> nn.Module:
    """The model itself, or under torchrun its one DistributedDataParallel wrapper. Buffers are not
    broadcast at each forward: BatchNorm's running statistics serve evaluation only, and each epoch's end
    shares rank 0's before it (share_from_rank0), which are the same either way; a broadcast every
    forward, micro-batches included, bought nothing. torch 2.14 names that forward_sync_buffers=False
    (and warns at broadcast_buffers=False, the name of the torch versions before it)."""
    if not is_distributed():
        return model
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
        nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                               else None, **{no_sync: False})


def cleanup() -> None:
    """Leave the process group, then pause a moment before the process exits. Gloo's worker threads
    let go of a finished collective's tensors just after the caller's wait returns, and need the GIL
    to free one that Python created; a process that is already exiting then aborts with "terminate
    called without an active exception" (seen at exit of torchrun runs, error paths included)."""
    if is_distributed():
        dist.destroy_process_group()
        time.sleep(0.1)  # the GIL is free: the worker threads finish


def tell_torchrun(message: str) -> None:
    """Under torchrun, the one line this process ends with, in the error file torchrun reads: its
    summary then shows the line as the root cause (after its own traceback, which it always prints)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            info = {"py_callstack": message, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
