"""Stopping a run on request: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, ``kill``) ask the run to stop at
the next optimizer-step boundary, where :class:`~lightning_mixedfsdp.recipes.checkpoints.RunCheckpoints` saves
``last.ckpt`` and ends the fit; a second SIGINT aborts at once.

A signal handler only sets a flag. It runs between two bytecodes of the main thread, possibly between two of FSDP's
collectives, so it must not issue one (Lightning 2.6's own SIGTERM handler broadcasts from inside the handler, which
can pair with another rank's all-gather); the ranks agree on the flag with one all-reduce at each step boundary. A
signal that reached only some ranks (``kill`` of the launching process) stops them all at the same step.

SIGUSR1, Lightning's SLURM requeue signal, is left to Lightning.
"""

import os
import signal
import threading
from types import FrameType
from typing import Any, Dict, Optional

from lightning.pytorch.strategies import Strategy

from lightning_mixedfsdp.recipes.console import process_rank

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The first SIGINT/SIGTERM this process received while installed, if any."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (idempotent; Python lets only the main thread set handlers)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

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
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now, as without this handler
        if self.signal is None:
            self.signal = signum
            if process_rank() == 0:  # once per run, not once per rank
                # os.write, not print: a print here could re-enter a print the main thread was in the middle of
                name = signal.Signals(signum).name
                message = f"\n{name}: stopping at the next step boundary with a checkpoint (Ctrl-C again aborts)\n"
                os.write(2, message.encode())
