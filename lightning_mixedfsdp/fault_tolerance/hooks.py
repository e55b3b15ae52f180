"""What a strategy calls at its hooks for fault tolerance, in one object: ``fault_tolerance_for(settings)`` gives
:class:`NoFaultTolerance` (every hook a no-op) without settings, :class:`ReplicaGroups` (torchft) with them, so the
strategies call the same hooks either way and never ask which one they hold. Lightning-free: the strategies pass
plain values (ranks, a broadcast, the objects a heal carries)."""

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.apply.cross_replica import CrossReplicaReduce
from lightning_mixedfsdp.apply.semi_sync import OuterExchange
from lightning_mixedfsdp.config import FaultTolerance
from lightning_mixedfsdp.fault_tolerance.heal import HealSources
from lightning_mixedfsdp.fault_tolerance.session import HealRecord, ReplicaGroupSession, check_fault_tolerance

STATE_KEY = "torchft"
"""The checkpoint entry holding torchft's step counters, written under fault tolerance; a plain run ignores it."""


class NoFaultTolerance:
    """Fault tolerance off: every step commits, this launch writes every checkpoint, the data splits over its own
    ranks only."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def start(
        self,
        device: torch.device,
        group_rank: int,
        group_world_size: int,
        agree: Callable[[Any], Any],
        sources: Callable[[], HealSources],
    ) -> None:
        """Join the replica groups, once the processes are launched."""

    @property
    def cross_replica_reduce(self) -> Optional[CrossReplicaReduce]:
        """What averages every gradient across the replica groups after its reduction within this group."""
        return None

    @property
    def outer_exchange(self) -> Optional[OuterExchange]:
        """Semi-synchronous replica groups' link (``replicate_sync``): their syncs' quorum, averages and vote."""
        return None

    def watch(self, module: nn.Module) -> List[RemovableHandle]:
        """Hooks that start each step's quorum before ``module``'s first training forward."""
        return []

    def commit(self, optimizer: Optimizer) -> bool:
        """Whether this step's update may be applied; a discarded step's grads are dropped."""
        return True

    def step_after_closure(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        on_discard: Callable[[], None],
    ) -> Any:
        """A step that takes its forward and backward as a ``closure`` (the Trainer's): ``step(closure)``."""
        return step(closure)

    def begin_step(self) -> None:
        """Open the step's quorum now (a restarted group heals here) instead of at the first training forward."""

    @property
    def reduction_failed(self) -> bool:
        """Whether a reduction of the open step failed (its grads may be garbage; the vote discards it)."""
        return False

    @property
    def last_heal(self) -> Optional[HealRecord]:
        """The last heal this group received."""
        return None

    def sampler_kwargs(self, data_parallel_size: int, data_parallel_rank: int) -> Dict[str, int]:
        """A distributed sampler's ``num_replicas`` and ``rank`` for training."""
        return {"num_replicas": data_parallel_size, "rank": data_parallel_rank}

    def writes_checkpoints(self) -> bool:
        """Whether this launch writes the job's checkpoints."""
        return True

    def with_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """A checkpoint's state, with what fault tolerance needs to resume."""
        return state

    def restore_state(self, loaded: Dict[str, Any]) -> None:
        """Take fault tolerance's entry out of a loaded checkpoint (a plain run drops one a fault-tolerant run
        wrote) and restore it."""
        loaded.pop(STATE_KEY, None)

    @property
    def manager(self) -> Any:
        raise RuntimeError(
            f"{self.owner}: torchft_manager exists with fault_tolerance set, once the processes are launched (after"
            " `fabric.launch()`, or in the Trainer's fit)."
        )

    def shutdown(self) -> None:
        """Leave the replica groups (at teardown)."""


class ReplicaGroups(NoFaultTolerance):
    """Fault tolerance on: this launch is one replica group of a torchft job (``session.py`` holds its Manager).

    Synchronous (``replicate_sync="every_step"``): every step is a quorum, every gradient averaged across the groups,
    and a vote. Semi-synchronous: the groups meet only at their syncs (every ``sync_every`` steps, as torchft's own
    ``LocalSGD``/``DiLoCo`` do): a quorum (where a restarted group heals, taking a live group's params, optimizer and
    outer state), the averages, and a vote that applies them all or none; the steps between are each group's own."""

    def __init__(self, settings: FaultTolerance, owner: str, semi_synchronous: bool = False) -> None:
        super().__init__(owner)
        check_fault_tolerance(settings, owner)  # the missing parts fail before any launch
        self.settings = settings
        self.semi_synchronous = semi_synchronous
        self._session: Optional[ReplicaGroupSession] = None

    @property
    def session(self) -> ReplicaGroupSession:
        """This rank's torchft session, once :meth:`start` joined it."""
        if self._session is None:
            raise RuntimeError(
                f"{self.owner}: the replica group's torchft manager exists once the processes are launched (after"
                " `fabric.launch()`, or in the Trainer's fit)."
            )
        return self._session

    def start(
        self,
        device: torch.device,
        group_rank: int,
        group_world_size: int,
        agree: Callable[[Any], Any],
        sources: Callable[[], HealSources],
    ) -> None:
        if self._session is None:
            self._session = ReplicaGroupSession.start(
                self.settings, device, group_rank, group_world_size, agree, sources, self.owner
            )

    @property
    def cross_replica_reduce(self) -> Optional[CrossReplicaReduce]:
        return None if self.semi_synchronous else self._reduce

    def _reduce(self, tensor: Tensor) -> None:
        self.session.reduce(tensor)

    @property
    def outer_exchange(self) -> Optional[OuterExchange]:
        return ReplicaGroupExchange(self.session) if self.semi_synchronous else None

    def watch(self, module: nn.Module) -> List[RemovableHandle]:
        return [] if self.semi_synchronous else [self.session.watch(module)]

    def commit(self, optimizer: Optimizer) -> bool:
        if self.semi_synchronous:  # a step between syncs is this group's own
            return True
        committed = self.session.commit()
        if not committed:
            optimizer.zero_grad(set_to_none=True)
        return committed

    def step_after_closure(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        on_discard: Callable[[], None],
    ) -> Any:
        """The closure (forward, backward) first, then the vote, as a loss scaler skips a step: the update only when
        torchft commits the step; a discarded one drops its grads and calls ``on_discard``."""
        result = closure()
        if not self.commit(optimizer):
            on_discard()
            return result
        return step(lambda: result)

    def begin_step(self) -> None:
        self.session.begin_step()

    @property
    def reduction_failed(self) -> bool:
        return self._session is not None and self._session.reduction_failed

    @property
    def last_heal(self) -> Optional[HealRecord]:
        return self._session.last_heal if self._session is not None else None

    def sampler_kwargs(self, data_parallel_size: int, data_parallel_rank: int) -> Dict[str, int]:
        return self.session.sampler_kwargs(data_parallel_size, data_parallel_rank)

    def writes_checkpoints(self) -> bool:
        return self.session.writes_checkpoints()

    def with_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        return {**state, STATE_KEY: self.session.state_dict()}

    def restore_state(self, loaded: Dict[str, Any]) -> None:
        state = loaded.pop(STATE_KEY, None)
        if state is not None:
            self.session.load_state_dict(state)

    @property
    def manager(self) -> Any:
        return self.session.manager

    def shutdown(self) -> None:
        if self._session is not None:
            self._session.shutdown()
            self._session = None


class ReplicaGroupExchange:
    """Semi-synchronous replica groups' sync: the quorum, averages over the participating groups (deferred: a group
    that dies inside them leaves garbage), then the vote."""

    deferred = True

    def __init__(self, session: ReplicaGroupSession) -> None:
        self.session = session

    def begin(self) -> None:
        self.session.begin_step()

    def average(self, flat: Tensor) -> None:
        self.session.reduce(flat)

    def commit(self) -> bool:
        return self.session.commit()


def fault_tolerance_for(
    settings: Optional[FaultTolerance], owner: str, semi_synchronous: bool = False
) -> NoFaultTolerance:
    """The hooks for these settings: torchft's replica groups (synchronous, or meeting every ``sync_every`` steps),
    or none."""
    return NoFaultTolerance(owner) if settings is None else ReplicaGroups(settings, owner, semi_synchronous)
