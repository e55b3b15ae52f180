"""Stopping a run on request: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, ``kill``) ask the run to stop at
the next optimizer-step boundary, where :class:`~lightning_mixedfsdp.recipes.run.checkpoints.RunCheckpoints` saves
``last.ckpt`` and ends the fit; a second one, the repeat window (:data:`REPEAT_WINDOW_S`) or more after the first,
ends the process at once.

One request often arrives more than once: ``timeout`` signals its child and then the child's whole process group,
and ``srun``, ``torchrun`` and SLURM's ``scancel`` forward what they receive to processes that are signalled
directly too. Those copies come within milliseconds, so a stop signal within the repeat window of the first belongs
to the same request. A person who wants the run gone sends it again after that (a second Ctrl-C).

A signal handler only sets a flag. It runs between two bytecodes of the main thread, possibly between two of FSDP's
collectives, so it must not issue one (Lightning 2.6's own SIGTERM handler broadcasts from inside the handler, which
can pair with another rank's all-gather); the ranks agree on the flag with one all-reduce at each step boundary. A
signal that reached only some ranks (``kill`` of the launching process) stops them all at the same step.

The second signal is seen by a watcher thread, not by the handler: a rank blocked in a collective that never
completes (a hung run) runs no Python handler until it returns, and SIGTERM, now handled, would no longer end it.
CPython writes every handled signal's number to the wakeup file descriptor from C; the thread reads it there.

SIGUSR1, Lightning's SLURM requeue signal, is left to Lightning.
"""

import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Dict, Optional, Tuple

from lightning.pytorch.strategies import Strategy

from lightning_mixedfsdp.recipes.run.console import process_rank

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 2.0
"""Stop signals this soon after the first are copies of the same request (a launcher forwarding it), not an abort."""


class StopRequest:
    """The first SIGINT/SIGTERM this process received while installed, if any."""

    def __init__(self, repeat_window_s: float = REPEAT_WINDOW_S) -> None:
        self.repeat_window_s = repeat_window_s
        """Stop signals less than this many seconds after the first are its copies; a later one aborts. With 0 every
        further stop signal aborts, with ``math.inf`` none does (what a test sets to decide the outcome by the order
        of the signals alone)."""
        self.signal: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._wakeup: Optional[Tuple[int, int]] = None
        """This request's wakeup pipe's write end, and the wakeup fd that was set before."""

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (idempotent; Python lets only the main thread set handlers)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)  # CPython's C handler must never block on it
        self._wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        threading.Thread(
            target=_abort_on_second_signal, args=(read, self.repeat_window_s), name="stop-request", daemon=True
        ).start()
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers and the wakeup fd that were there before :meth:`install`; the watcher ends."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._wakeup is not None:
            write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watcher reads end-of-file
            self._wakeup = None

    def agreed(self, strategy: Strategy) -> bool:
        """Whether any rank was asked to stop: one all-reduce, the same answer on every rank. Call it at the same
        point on every rank."""
        return bool(strategy.reduce_boolean_decision(self.signal is not None, all=False))

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal (130 for SIGINT, 143 for SIGTERM); SIGTERM's when the
        request reached another rank only."""
        return 128 + (self.signal if self.signal is not None else signal.SIGTERM)

    def _handle(self, signum: int, _: Optional[FrameType]) -> None:
        if self.signal is None:
            self.signal = signum
            if process_rank() == 0:  # once per run, not once per rank
                # os.write, not print: a print here could re-enter a print the main thread was in the middle of
                name = signal.Signals(signum).name
                os.write(
                    2,
                    f"\n{name}: stopping at the next step boundary with a checkpoint (again after"
                    f" {self.repeat_window_s:g} s: abort)\n".encode(),
                )


def _abort_on_second_signal(read: int, repeat_window_s: float) -> None:
    """Read the signals CPython reports on the wakeup pipe. The first stop signal is the request; others less than
    ``repeat_window_s`` after it are its copies; one after that ends the process now (no checkpoint, the shell's
    128 + signal), whatever the main thread is blocked in."""
    first: Optional[float] = None
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while chunk := pipe.read(64):
            now = time.monotonic()
            for signum in chunk:
                if signum not in STOP_SIGNALS:
                    continue
                if first is None:
                    first = now
                elif now - first >= repeat_window_s:
                    os.write(2, f"\n{signal.Signals(signum).name} again: aborting\n".encode())
                    os._exit(128 + signum)
