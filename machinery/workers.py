"""DataLoader worker processes, where files are read every epoch or decoded once: how many, their
signals (the main process saves first, then ends them) and the shared memory their batches pass through."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys

import torch

from configs import UserError
from machinery.stops import SIGNALS, Signals


def count(setting: int | str, device: torch.device) -> int:
    """--num-workers, or for auto 2, and on CUDA (where a GPU would wait on 2) the CPU cores each of this
    machine's processes has, up to 8."""
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


_ENDING = []  # end_workers registered at exit (once)


@contextlib.contextmanager
def starting():
    """The block in which workers start (a DataLoader's first pass): a signal then is acted on after it
    (raised inside a fork's callbacks it was only printed), and at exit the workers are ended."""
    if not _ENDING:
        atexit.register(end_workers)  # before multiprocessing's, which would wait for them for ever
        _ENDING.append(True)
    with SIGNALS.held_while_forking():
        yield


def worker_init(worker: int) -> None:
    """A worker's first step: where the main process handles signals (train.py saves, then ends its
    workers), a signal to the whole group (systemd, Slurm, kill -TERM -PGID) spares it."""
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):  # the parent's, inherited
        for sig in Signals.NAMES:
            signal.signal(sig, signal.SIG_IGN)
        sys.excepthook = _quiet_when_parent_left


def _quiet_when_parent_left(kind, error, trace) -> None:
    """A worker's report of an error outside its batches: a connection the main process dropped when it
    stopped on a signal is no error of the worker's."""
    if not issubclass(kind, (ConnectionResetError, BrokenPipeError, EOFError)):
        sys.__excepthook__(kind, error, trace)


def end_workers() -> None:
    """At exit: workers ignore signals (worker_init), so multiprocessing's SIGTERM would leave its wait for
    them lasting for ever. Their end is no error: torch's SIGCHLD handler, which would say so, goes first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def check_shared_memory(batch_bytes: int, workers: int, notes: list[str]) -> None:
    """Workers hand batches over in /dev/shm (Linux), which Docker makes 64 MB: too small for the batches in
    flight (prefetch_factor 2 a worker, one in use, for each process here) is refused now; under twice that,
    said in a note."""
    if workers == 0 or not os.path.isdir("/dev/shm"):
        return
    need = batch_bytes * (2 * workers + 1) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = shutil.disk_usage("/dev/shm").free
    said = (f"/dev/shm has {free / 2**20:.1f} MiB free and the DataLoader's batches in flight need about "
            f"{need / 2**20:.1f} MiB")
    fix = "use --num-workers 0, or give the container more shared memory (docker run --shm-size=2g)"
    if free < need:
        raise UserError(f"{said}; {fix}")
    if free < 2 * need:
        notes.append(f"{said}: if workers fail for want of shared memory, {fix}")
