"""Under torchrun: one of its processes, each running train.py on its shard, and what they agree on by
collectives (processes.Alone is the same for one process). Rank 0 alone prints, logs and saves; what only
it can decide (its files, a signal it received) reaches the others by a collective."""

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


class Torchrun:
    """This process in torchrun's process group: the same methods as processes.Alone."""

    def __init__(self, device: torch.device, rank: int | None = None, world_size: int | None = None):
        self.device = device
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.shard = (self.rank, self.world_size)  # this process's part of each epoch, of how many

    @classmethod
    def joined(cls, device: torch.device, timeout_minutes: float) -> Torchrun:
        """The process group: nccl on GPUs, gloo on CPUs; its collectives wait `timeout_minutes` for every
        process (--dist-timeout) before the job fails. A later run in the same process (--seeds) uses the
        group the first one joined."""
        if joined():
            return cls(device)
        watch_parent()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank, world_size))
        # Keys of this attempt's own: a restart may keep torchrun's store, where a dead process's address
        # would be found first (gloo then connects to it, and fails or hangs).
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(minutes=timeout_minutes))
        return cls(device, rank, world_size)

    def on_rank0(self, work: Callable, *args) -> None:
        """`work(*args)` on rank 0 alone, its UserError raised on every rank: all go on, or stop, together."""
        problem = None
        if self.rank == 0:
            try:
                work(*args)
            except UserError as err:
                problem = str(err)
        problem = from_rank0(problem)
        if problem:
            raise UserError(problem)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def gather(self, rows):
        """Every process's rows (a tensor, or a tuple or dict of them) as the split's, in its order."""
        return each(lambda _, t: _gathered(t), rows)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any: all of them stop at the same step."""
        return self.sum(torch.tensor([float(flag)], device=self.device)).item() > 0

    def share(self, tensors: Iterable[torch.Tensor]) -> None:
        """Rank 0's tensors on every rank, in place: weights it alone read, or BatchNorm's statistics."""
        for tensor in tensors:
            dist.broadcast(tensor, src=0)

    def parallel(self, model: nn.Module) -> nn.Module:
        """The model's one DistributedDataParallel wrapper. Its buffers are not broadcast at each forward:
        BatchNorm's statistics serve evaluation only, and each epoch's end shares rank 0's (share)."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        parameters = inspect.signature(nn.parallel.DistributedDataParallel).parameters
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **{no_sync: False})

    def gradient_sync(self, model: nn.Module, last: bool):
        """A micro-batch's forward and backward: DDP all-reduces the gradients in the last one's alone."""
        return contextlib.nullcontext() if last else model.no_sync()

    def agree(self, module: nn.Module) -> bool:
        """True when every rank holds bit-identical parameters and buffers."""
        flat = torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])
        reference = flat.clone()
        dist.broadcast(reference, src=0)
        return not self.any(not torch.equal(flat, reference))


def from_rank0(value):
    """Rank 0's value on every rank."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """Rank r holds the examples r, r + W, ... of W processes: its row i is the split's i x W + r. The row
    counts go first, then the rows, padded to the most any process holds; the padding is dropped."""
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


def watch_parent() -> None:
    """Should torchrun's agent die (kill -9), this process gets the SIGTERM the agent would have sent: it
    saves and stops at its next log point, instead of training on unwatched."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="torchrun-agent-watch", daemon=True).start()


def joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if joined():
        dist.barrier()


def peer_lost(err: BaseException) -> bool:
    """Whether a failed collective says another process is gone (NCCL's DistError, gloo's connection)."""
    return joined() and (isinstance(err, dist.DistError) or "gloo/transport" in str(err))


def leave() -> None:
    """Leave the process group, then pause: gloo's threads free a collective's tensors just after it returns,
    and a process already exiting would abort ("terminate called without an active exception")."""
    if joined():
        dist.destroy_process_group()
        time.sleep(0.1)


def tell_torchrun(message: str) -> None:
    """The one line this process ends with, in the error file torchrun reads: its summary shows it."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            info = {"py_callstack": message, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
