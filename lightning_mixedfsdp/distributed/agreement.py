"""One rule for every distributed section that can fail on one rank (a load's reads, a rank-0 stream, an export's
writes): the work that can fail on a rank runs with no collective inside it, its error is kept, and at the section's
end every rank learns of it in one small collective and raises the same kind of error with the same message, naming
the rank that failed. No rank is ever left in a collective its failed peer will not join.

The bound: the section's own work plus one object all-gather. A rank killed outright (SIGKILL, OOM) never reaches
the agreement; its peers then wait for the process group's timeout (Lightning's default 30 minutes; a launcher such as
torchrun tears the job down sooner when a rank dies).
"""

import builtins
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Tuple, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_NOT_KEPT = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""What a section never keeps: the process is being stopped. Every other error is kept, ``BaseException`` subclasses
included (torch DCP's ``CheckpointException`` is one)."""

Failure = Tuple[int, str, str]
"""(rank, exception class name, message)."""


class Agreement:
    """This rank's first failure in a section, and the collective that makes every rank raise it.

    ``with agreement.local(): ...`` keeps an error raised inside (the section goes on, so the ranks stay in step);
    ``agreement.agree()`` raises on every rank when any rank kept one. ``what`` names the section in the messages.
    Errors after this rank's first (a stream's close after a failed write) are kept in ``later`` and logged, never
    raised before the agreement: a rank that raised alone would leave its peers waiting in its collective."""

    def __init__(self, what: str, group: Any = None) -> None:
        self.what = what
        self.group = group
        self.error: Optional[BaseException] = None
        self.later: List[BaseException] = []

    @property
    def failed(self) -> bool:
        """Whether this rank failed in the section already (it may skip its remaining local work)."""
        return self.error is not None

    @contextmanager
    def local(self) -> Iterator[None]:
        """Work with no collective inside: an exception is kept (the first one; later ones logged), not raised."""
        try:
            yield
        except _NOT_KEPT:
            raise
        except BaseException as error:  # every rank hears of the first at agree()
            if self.error is None:
                self.error = error
            else:
                self.later.append(error)
                log.warning(
                    "%s: a further error after this rank's first: %s: %s", self.what, type(error).__name__, error
                )

    def agree(self) -> None:
        """Every rank raises the first failing rank's error (its own, unchanged, on that rank), or none does."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):  # one process: its own error, if any
            if self.error is not None:
                raise self.error
            return
        mine: Optional[Failure] = None
        if self.error is not None:
            mine = (dist.get_rank(), type(self.error).__name__, str(self.error))
        failures: List[Optional[Failure]] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(failures, mine, group=self.group)
        reported = [failure for failure in failures if failure is not None]
        if not reported:
            return
        if self.error is not None:
            raise self.error
        rank, kind, message = min(reported)
        raise same_kind(kind, f"{self.what}: rank {rank} failed: {message}")


def on_rank_zero(what: str, compute: Callable[[], T], group: Any = None) -> T:
    """``compute()`` on rank 0 (of ``group``) and its result on every rank; when it raises, every rank raises the same
    kind of error with its message (rank 0 its own error)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):  # one process
        return compute()
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    outcome: List[Any] = [None, None]
    own: Optional[BaseException] = None
    if rank == 0:
        try:
            outcome = [None, compute()]
        except _NOT_KEPT:
            raise
        except BaseException as error:
            outcome = [(type(error).__name__, str(error)), None]
            own = error
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(outcome, src=source, group=group)
    if outcome[0] is not None:
        if own is not None:
            raise own
        kind, message = outcome[0]
        raise same_kind(kind, f"{what}: rank 0 failed: {message}")
    return outcome[1]


def same_kind(name: str, message: str) -> Exception:
    """An error of the built-in class of that name (``ValueError``, ``FileNotFoundError``, ...) with ``message``;
    a ``RuntimeError`` for any other class."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except TypeError:  # a built-in whose constructor takes more than a message (UnicodeDecodeError)
            pass
    return RuntimeError(message)
