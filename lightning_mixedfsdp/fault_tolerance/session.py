"""One replica group's side of fault tolerance: torchft's ``Manager`` and the step it brackets.

A step is the quorum, started before the step's first training forward (a restarted group heals there, before it
computes anything), then every gradient averaged across the groups (``apply/cross_replica.py``), then one commit vote
at the first optimizer step: the step is applied where every rank of the group reduced without error and enough
groups took part, and discarded (its grads dropped) elsewhere. Further optimizer steps before the next forward follow
the same vote.
"""

import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional
from urllib.parse import urlparse

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.compat.torchft import LIGHTHOUSE_LINE, all_reduce_average, check_torchft, make_manager
from lightning_mixedfsdp.config import FaultTolerance
from lightning_mixedfsdp.fault_tolerance.heal import HealSources, heal_state, load_heal_state

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


@dataclass
class HealRecord:
    """The last heal this group received: at which step, how many tensor bytes, in how many seconds (the quorum
    and transfer included)."""

    step: int
    bytes: int
    seconds: float


class ReplicaGroupSession:
    """Fault tolerance for the ranks of one replica group (one launch); every rank of the group holds one."""

    manager: Any
    """torchft's ``Manager`` of this rank."""

    def __init__(self, settings: FaultTolerance, sources: Callable[[], HealSources]) -> None:
        self.settings = settings
        self._sources = sources
        self._quorum_open = False
        self._decision: Optional[bool] = None
        self._received: Optional[int] = None
        self.last_heal: Optional[HealRecord] = None

    @classmethod
    def start(
        cls,
        settings: FaultTolerance,
        device: torch.device,
        group_rank: int,
        group_world_size: int,
        agree: Callable[[Any], Any],
        sources: Callable[[], HealSources],
        owner: str,
    ) -> "ReplicaGroupSession":
        """Connect this rank to its group's torchft manager. ``agree(value)`` returns group rank 0's ``value`` on
        every rank (a broadcast), so an unreachable lighthouse fails every rank with the same error, never a hang.
        ``sources`` gives the objects a heal reads or writes, when one happens."""
        check_torchft(owner)
        # torchft's HTTP transport hands torch.load a read-only buffer when a heal arrives; the tensors are copied
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        lighthouse = lighthouse_url(settings, owner)
        problem = agree(lighthouse_problem(lighthouse, settings.connect_timeout_s) if group_rank == 0 else None)
        if problem is not None:
            raise ConnectionError(unreachable_message(owner, lighthouse, settings.connect_timeout_s, problem))
        assert settings.replica_id is not None and settings.num_replica_groups is not None  # validated
        session = cls(settings, sources)
        session.manager = make_manager(
            device,
            replica_id=f"mixed_fsdp2_{settings.replica_id}",
            lighthouse=lighthouse,
            min_replicas=settings.min_replicas,
            group_rank=group_rank,
            group_world_size=group_world_size,
            timeout_s=settings.timeout_s,
            quorum_timeout_s=settings.quorum_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            load_state_dict=session._load_heal,
            state_dict=session._serve_heal,
        )
        return session

    def _serve_heal(self) -> Dict[str, Any]:
        return heal_state(self._sources())

    def _load_heal(self, state: Dict[str, Any]) -> None:
        self._received = load_heal_state(state, self._sources())

    # ---- the step ------------------------------------------------------------------------------------------------

    def watch(self, module: nn.Module) -> RemovableHandle:
        """Start the quorum before ``module``'s first training forward of each step."""
        return module.register_forward_pre_hook(self._before_forward, prepend=True)

    @torch.compiler.disable
    def _before_forward(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.begin_step()

    def begin_step(self) -> None:
        """The step's quorum, once per step; a restarted group heals here, before it computes anything."""
        if self._quorum_open:
            return
        started = time.perf_counter()
        self._received = None
        self.manager.start_quorum()
        if self._received is not None:
            self.last_heal = HealRecord(self.manager.current_step(), self._received, time.perf_counter() - started)
        self._quorum_open, self._decision = True, None

    def commit(self) -> bool:
        """Whether this step's update may be applied: torchft's vote over the group, once per step (later optimizer
        steps of the same step get the same answer)."""
        if not self._quorum_open:
            if self._decision is not None:
                return self._decision
            self.begin_step()  # a step with no training forward: vote anyway, so step counts stay in line
        self._decision = bool(self.manager.should_commit())
        self._quorum_open = False
        return self._decision

    @property
    def last_decision(self) -> Optional[bool]:
        """The latest step's vote: True committed, False discarded, None while a step is open or before any."""
        return None if self._quorum_open else self._decision

    @property
    def reduction_failed(self) -> bool:
        """Whether a reduction of the open step failed (its grads may be garbage; the vote will discard it)."""
        return self._quorum_open and self.manager.errored() is not None

    def reduce(self, tensor: Tensor) -> None:
        """Average ``tensor`` in place across the participating groups (a gradient, after its group's reduction)."""
        all_reduce_average(self.manager, tensor)

    # ---- data, checkpoints ---------------------------------------------------------------------------------------

    def sampler_kwargs(self, data_parallel_size: int, data_parallel_rank: int) -> Dict[str, int]:
        """A distributed sampler's ``num_replicas`` and ``rank``: every group's data-parallel ranks counted, so each
        group draws its own part of the data."""
        assert self.settings.replica_id is not None and self.settings.num_replica_groups is not None
        return {
            "num_replicas": data_parallel_size * self.settings.num_replica_groups,
            "rank": self.settings.replica_id * data_parallel_size + data_parallel_rank,
        }

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints: the first participant of the latest quorum (before any
        quorum, group 0). The others skip the save; the groups hold equal state, so one copy resumes them all."""
        rank = self.manager.participating_rank()
        return rank == 0 if rank is not None else self.settings.replica_id == 0

    def state_dict(self) -> Dict[str, int]:
        """torchft's step counters, saved with each checkpoint so a resumed job goes on from them."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def check_fault_tolerance(settings: FaultTolerance, owner: str) -> None:
    """What fault tolerance needs before any process starts: torchft installed, a lighthouse URL given."""
    check_torchft(owner)
    lighthouse_url(settings, owner)


def missing_lighthouse(settings: FaultTolerance) -> Optional[str]:
    """Why no lighthouse is known (none given, none in ``$TORCHFT_LIGHTHOUSE``), with the fix; None when one is. The
    recipe loader asks it too, before any launch."""
    if settings.lighthouse or os.environ.get(LIGHTHOUSE_ENV):
        return None
    return (
        "fault_tolerance has no lighthouse: set fault_tolerance.lighthouse='http://host:29510' or"
        f" ${LIGHTHOUSE_ENV}, after starting one with `{LIGHTHOUSE_LINE}`."
    )


def lighthouse_url(settings: FaultTolerance, owner: str) -> str:
    problem = missing_lighthouse(settings)
    if problem is not None:
        raise ValueError(f"{owner}: {problem}")
    return settings.lighthouse or os.environ[LIGHTHOUSE_ENV]


def lighthouse_problem(url: str, timeout_s: float) -> Optional[str]:
    """Why the lighthouse at ``url`` cannot be reached within ``timeout_s`` (a TCP connect), or None."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.hostname is None or parsed.port is None:
        return "the URL names no host and port"
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            return None
    except OSError as err:
        return str(err) or type(err).__name__


def unreachable_message(owner: str, url: str, timeout_s: float, problem: str) -> str:
    return (
        f"{owner}: the torchft lighthouse at {url!r} is unreachable within {timeout_s:g}s ({problem}). Start one"
        f" with `{LIGHTHOUSE_LINE}` (from the torchft the trainers import) and point fault_tolerance.lighthouse or"
        f" ${LIGHTHOUSE_ENV} at it, e.g. http://<its host>:29510."
    )
