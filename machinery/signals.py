"""The signals that stop a run: Ctrl-C, SIGTERM (systemd, Slurm, `kill`, torchrun stopping its workers),
SIGHUP (a dropped ssh session) and SIGUSR1 (what Slurm's --signal sends before a time limit).

Outside the training loop a signal raises Interrupted at once. Inside it (mode "defer") a signal only
sets a flag, which the loop reads after each step (stops.py saves, then stops); a second one stops at
once, except while a save runs (mode "hold"), which nothing interrupts.

A run started in-process (train.train(), or a script's main() called by pytest, a notebook, a caller's
loop) passes the signal on once it has stopped: the handler that was there before gets it, so Ctrl-C
stops the caller too (KeyboardInterrupt), as SIGTERM does where nothing handled it. A script run as a
program (`python train.py`, torchrun's workers) ends with its own exit code and line instead.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import signal
import sys
import threading

import torch

from machinery import processes


class Interrupted(KeyboardInterrupt):
    """A signal that stops the process where it stands (the scripts say so in one line)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """The handlers for the whole process, and the signal received (0: none)."""

    NAMES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

    def __init__(self):
        self.received, self.mode, self.previous = 0, "raise", {}
        self.stopped_by = 0  # the signal the outermost block received, until hand_on() passes it on
        self.pass_on = True  # False: a signal ends the run as in a program (tests that signal themselves)

    @contextlib.contextmanager
    def installed(self, *, program: bool = False):
        """The handlers for the block (nested blocks share them); only the main thread can have any. The
        outermost block puts the earlier handlers back and, unless the process is the script run as a
        `program`, hands a signal received on to them (hand_on)."""
        outermost = not self.previous and threading.current_thread() is threading.main_thread()
        if outermost:
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.NAMES}
            self.stopped_by = 0
            atexit.register(_end_workers)  # run before multiprocessing's, which would wait for them
        try:
            yield self
        finally:
            if outermost:
                self.stopped_by = self.received
                for sig, handler in self.previous.items():
                    signal.signal(sig, handler)
                self.previous, self.received, self.mode = {}, 0, "raise"
                if not program:
                    self.hand_on()

    def hand_on(self) -> None:
        """The signal that stopped the run, to the handler installed() put back: a caller's (pytest's, a
        notebook's, a loop of runs'), so that it stops too; Python's own SIGINT handler raises
        KeyboardInterrupt here, and SIGTERM with no handler ends the process."""
        signum, self.stopped_by = self.stopped_by, 0
        if signum and self.pass_on:
            signal.raise_signal(signum)

    @contextlib.contextmanager
    def in_mode(self, mode: str):
        """"defer" (the loop: save, then stop) or "hold" (a save: nothing interrupts it)."""
        before, self.mode = self.mode, mode
        try:
            yield self
        finally:
            self.mode = before

    @contextlib.contextmanager
    def held_while_forking(self):
        """A signal in the block (DataLoader workers starting) is noted, then acted on after it: raised
        inside a fork's at-fork callbacks (logging's lock), it was only printed, in a traceback of 8 lines."""
        before, first = self.mode, not self.received
        with self.in_mode("hold"):
            yield
        if before == "raise" and first and self.received:
            raise Interrupted(self.received)

    def _handle(self, signum, frame):
        first = not self.received
        self.received = self.received or signum
        if self.mode == "hold" or (self.mode == "defer" and first):
            return
        raise Interrupted(signum)

    def now(self, log_point: bool, device: torch.device) -> bool:
        """Stop after this step? Alone: as soon as a signal came. Under torchrun every rank must stop
        at the same step (one that left would hang the others in DDP's next all-reduce), so they
        agree by an all-reduce, at log points only, where the loop reads the device anyway."""
        if not processes.is_distributed():
            return bool(self.received)
        return log_point and processes.any_rank(bool(self.received), device)

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGTERM)  # a rank stopped by the others': as SIGTERM


SIGNALS = Signals()  # one per process, as signal handlers are


def worker_init(worker: int) -> None:
    """A DataLoader worker's first step: where the main process handles signals (train.py saves first,
    then ends its workers), a signal to the whole group (systemd, Slurm, kill -TERM -PGID) spares it."""
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):  # the parent's, inherited
        for sig in Signals.NAMES:
            signal.signal(sig, signal.SIG_IGN)
        sys.excepthook = _quiet_when_parent_left


def _quiet_when_parent_left(kind, error, trace) -> None:
    """A worker's report of an error outside its batches (torch sends those to the main process). The
    thread that hands tensors over (multiprocessing's resource_sharer) reports a connection the main
    process dropped, stopping on a signal, in 20 lines: that is no error of the worker's."""
    if not issubclass(kind, (ConnectionResetError, BrokenPipeError, EOFError)):
        sys.__excepthook__(kind, error, trace)


def _end_workers() -> None:
    """At exit: DataLoader workers leave signals to this process (worker_init), so the SIGTERM with which
    multiprocessing ends them would be ignored, and its wait for them last for ever. (Their end is not
    an error: torch's SIGCHLD handler, which would say it is, goes first.)"""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
