"""Semi-synchronous replicas: local SGD and DiLoCo across HSDP's replicate dim, with an fp32 outer state whatever a
param's storage dtype.

Each replica trains alone between syncs: its params are FSDP-sharded over its own shard ranks only, so no gradient
crosses the replicate dim. After the optimizer step of steps H, 2H, ... (``sync_every``) each rank exchanges its own
shards with the ranks holding the same shards in the other replicas (one all-reduce per bucket over the replicate
dim, in fp32):

- local SGD: the params become the replicas' average;
- DiLoCo (arXiv 2311.08105): the pseudo-gradient ``global - params`` is averaged, Nesterov SGD applies it to the
  fp32 global copy (``m = mu * m + delta``; ``update = delta + mu * m``, or ``m`` without Nesterov;
  ``global -= lr * update``), and every replica takes the global copy, cast to each param's own dtype.

The global copy and the momentum are fp32 (on the host by default), so an averaged change below a bf16 param's
spacing accumulates there instead of rounding away: it moves the bf16 param once the sum crosses half a spacing.
Frozen params take no part (a 4-bit base, a frozen tower).

Checkpoints carry the outer state (``semi_sync_checkpoint.py``); fault-tolerant replica groups sync through torchft's
manager (an :class:`OuterExchange`), meeting only at their syncs.
"""

import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.model.tensors import local_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer

BUCKET_BYTES = 64 << 20
"""fp32 bytes of pseudo-gradients (or params) per all-reduce."""


class GroupExchange:
    """The replicas' exchange over a process group (HSDP's replicate dim): every all-reduce succeeds or raises."""

    deferred = False
    """Whether averaged results wait for :meth:`commit` before they are applied."""

    def __init__(self, group: "ProcessGroup") -> None:
        self.group = group

    def begin(self) -> None:
        """Before a sync's all-reduces."""

    def average(self, flat: Tensor) -> None:
        """``flat`` becomes its mean over the replicas, in place."""
        import torch.distributed as dist

        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)

    def commit(self) -> bool:
        """Whether every all-reduce since :meth:`begin` succeeded on every replica."""
        return True


class OuterExchange(Protocol):
    """What a sync needs from the replicas' link: :class:`GroupExchange`, or fault tolerance's replica groups (a
    quorum at :meth:`begin`, where a restarted group heals; averages deferred until the vote at :meth:`commit`)."""

    deferred: bool

    def begin(self) -> None: ...

    def average(self, flat: Tensor) -> None: ...

    def commit(self) -> bool: ...


def semi_sync_problems(
    method: str,
    context_parallel: int,
    expert_parallel: int,
    offload: Optional[str],
    float8: Optional[str] = None,
    quantize_base: Optional[str] = None,
    compile: bool = False,
) -> List[str]:
    """What ``replicate_sync=method`` does not compose with (untested), each with its fix. Tested with it: activation
    checkpointing, LoRA (the adapters' outer state only) and fault-tolerant replica groups."""
    if method == "every_step":
        return []
    problems = []
    untested = {
        f"context_parallel_size={context_parallel}": context_parallel > 1,
        f"expert_parallel_size={expert_parallel}": expert_parallel > 1,
        f"offload={offload!r}": offload is not None,
        f"float8={float8!r}": float8 is not None,
        f"quantize_base={quantize_base!r}": quantize_base is not None,
        "compile=True": compile,
    }
    for setting, present in untested.items():
        if present:
            problems.append(
                f"replicate_sync={method!r} with {setting} is untested; use replicate_sync='every_step' with it, or"
                " leave it off."
            )
    return problems


class OuterSync:
    """Local SGD or DiLoCo over ``exchange`` (with the ranks holding the same shards in every replica) for ``params``
    (the trainable ones, sharded or replicated within a replica), after every ``sync_every``-th optimizer step."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        exchange: OuterExchange,
        method: Literal["local_sgd", "diloco"],
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        state_device: Optional[torch.device] = None,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params = list(params)
        self.exchange, self.method, self.sync_every = exchange, method, sync_every
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.steps = 0
        """Optimizer steps taken; a sync follows each ``sync_every``-th."""
        self.synced_at = 0
        """The step count at the last sync (an early one before a save included)."""
        self.global_copy: List[Tensor] = []
        """DiLoCo: each param's local part in fp32, as of the last sync (taken before the first optimizer step: after
        initialisation and any load)."""
        self.momentum: List[Tensor] = []
        self._state_device, self._state_dtype = state_device, state_dtype
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.in_checkpoint = False
        """Whether the optimizers' state dicts taken now are for a checkpoint (a save, or the template of a load of
        one that holds the outer state): they carry the outer state then (the strategies set it)."""
        self.loaded = False
        """Whether a loaded optimizer state held the outer state."""
        self.optimizers: List["weakref.ref[Optimizer]"] = []
        """The optimizers whose state dicts carry the outer state (``semi_sync_checkpoint.attach_outer_state``)."""
        self._joined = False

    @torch.compiler.disable
    def join(self, *_: Any) -> None:
        """Before the first training forward, under fault tolerance (a forward pre-hook): a sync of nothing yet, whose
        quorum makes the groups start alike. A fresh job's groups take one group's initial params there (torchft's
        first-step sync); a restarted group meets the live groups at their next sync, heals there (params,
        optimizer and outer state) and takes part in it, so its first step is the live groups' next one."""
        if self._joined or not torch.is_grad_enabled():
            return
        self._joined = True
        self.before_step()
        self.sync()

    def reset(self) -> None:
        """Start afresh from the params as they are now (loaded): DiLoCo's global copy taken at the next step, its
        momentum zero, the cycle at step 0."""
        self.global_copy, self.momentum, self.steps, self.synced_at = [], [], 0, 0

    def before_step(self) -> None:
        """Before an optimizer step: DiLoCo's global copy taken from the params the first time (they are initialised
        or loaded by then; a model built on the meta device has no values at setup)."""
        if self.method == "diloco" and not self.global_copy:
            # state_dtype: fp32; a lower one only to show what it loses (tests, benchmarks)
            parts = [local_tensor(p).detach() for p in self.params]
            # its own memory: on the device in fp32 a plain `.to` would alias the param
            self.global_copy = [
                part.to(self._state_device or part.device, self._state_dtype, copy=True) for part in parts
            ]
            self.momentum = [torch.zeros_like(g) for g in self.global_copy]

    def after_step(self) -> None:
        """Count an optimizer step; sync after every ``sync_every``-th."""
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.sync()

    @property
    def mid_cycle(self) -> bool:
        """Whether the replicas took steps since the last sync (they differ)."""
        return self.steps != self.synced_at

    @torch.no_grad()
    def before_save(self) -> None:
        """Before a checkpoint (every rank of the replicate dim at the same step): a checkpoint keeps one copy of what
        the replicas hold, so they are made equal: the params by an outer step if they took steps since the last
        sync, and the inner optimizers' states (each replica's AdamW moments differ) by their average. A resume
        then repeats the run that saved."""
        if self.mid_cycle:
            self.sync()
        parts = _inner_states([reference() for reference in self.optimizers], self.params)
        self.exchange.begin()
        _check_same_sizes(parts, self.exchange)
        self._exchanged(
            [[parts[i] for i in bucket] for bucket in _buckets(parts, BUCKET_BYTES)],
            lambda bucket: torch.cat([part.reshape(-1).float() for part in bucket]),
            _scatter_into,
        )

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now (every rank of the replicate dim calls it at the same step). Under fault tolerance the
        quorum comes first (a restarted group heals there, taking a live group's params and outer state), and a sync
        that failed on some group (a peer died inside it) is not applied: the replicas go on from their local params
        and sync again at the next ``sync_every``-th step."""
        self.exchange.begin()
        parts = [local_tensor(p) for p in self.params]
        buckets = [[self.params[i] for i in bucket] for bucket in _buckets(parts, BUCKET_BYTES)]
        if self.method == "local_sgd":
            applied = self._exchanged(
                buckets, lambda bucket: torch.cat([local_tensor(p).reshape(-1).float() for p in bucket]), _params_from
            )
        else:
            applied = self._exchanged(buckets, self._pseudo_gradient, self._outer_step)
        if applied:
            self.synced_at = self.steps

    def _exchanged(
        self, buckets: List[List[Any]], flatten: Callable[[List[Any]], Tensor], apply: Callable[[Tensor, Any], None]
    ) -> bool:
        """Each bucket flattened and averaged over the replicas, then applied: at once over a process group; under
        fault tolerance all after the vote, and none when it fails. Returns whether they were applied."""
        pending: List[Tuple[Tensor, List[Any]]] = []
        for bucket in buckets:
            flat = flatten(bucket)
            self.exchange.average(flat)
            if self.exchange.deferred:
                pending.append((flat, bucket))
            else:
                apply(flat, bucket)
        if not self.exchange.commit():
            return False
        for flat, bucket in pending:
            apply(flat, bucket)
        return True

    def _pseudo_gradient(self, bucket: List[nn.Parameter]) -> Tensor:
        """What this replica's local steps changed, in fp32, from the params it started the cycle with (the global
        copy in the param's dtype): the global copy's part below the param's spacing stays out."""
        flats = []
        for param in bucket:
            part = local_tensor(param)
            start = self.global_copy[self.index[id(param)]].to(device=part.device, dtype=part.dtype).float()
            flats.append((start - part.float()).reshape(-1))
        return torch.cat(flats)

    def _outer_step(self, flat: Tensor, bucket: List[nn.Parameter]) -> None:
        """Nesterov SGD on the global copy with the averaged pseudo-gradients ``flat``; the params take the copy."""
        offset = 0
        for param in bucket:
            index, part = self.index[id(param)], local_tensor(param)
            delta = flat[offset : offset + part.numel()].view(part.shape).to(self.global_copy[index].device)
            offset += part.numel()
            momentum = self.momentum[index]
            momentum.mul_(self.outer_momentum).add_(delta.to(momentum.dtype))
            update = delta.add(momentum, alpha=self.outer_momentum) if self.nesterov else momentum
            self.global_copy[index].sub_(update.to(momentum.dtype), alpha=self.outer_lr)
            part.copy_(self.global_copy[index])  # cast to the param's own dtype

    def state_dict(self) -> Dict[str, Any]:
        """The outer state a heal carries (fault tolerance): the cycle's position, DiLoCo's global copy and momentum
        (this rank's parts, copied: the live group trains on while a peer reads them)."""
        return {
            "steps": self.steps,
            "synced_at": self.synced_at,
            "global_copy": [g.detach().cpu().clone() for g in self.global_copy],
            "momentum": [m.detach().cpu().clone() for m in self.momentum],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A live group's :meth:`state_dict`, written into this one (a heal; params and optimizer arrive beside it)."""
        self.steps, self.synced_at = state["steps"], state["synced_at"]
        if self.method == "diloco" and state["global_copy"]:
            self.global_copy, self.momentum = [], []
            self.before_step()
            theirs = [*state["global_copy"], *state["momentum"]]
            for mine, saved in zip([*self.global_copy, *self.momentum], theirs, strict=True):
                mine.copy_(saved)


def _inner_states(optimizers: Sequence[Optional["Optimizer"]], params: Sequence[nn.Parameter]) -> List[Tensor]:
    """This rank's parts of the optimizers' floating states of ``params`` (AdamW's moments; not its step count)."""
    return [
        local_tensor(value)
        for optimizer in optimizers
        if optimizer is not None
        for param in params
        for key, value in optimizer.state.get(param, {}).items()
        if key != "step" and isinstance(value, Tensor) and value.is_floating_point()
    ]


def _params_from(flat: Tensor, bucket: List[nn.Parameter]) -> None:
    _scatter_into(flat, [local_tensor(p) for p in bucket])


def _check_same_sizes(parts: List[Tensor], exchange: OuterExchange) -> None:
    """Every replica holds optimizer state for the same params (else their averaging would not line up): raises on
    every rank where some replica does not (a param it never took an optimizer step for)."""
    import torch.distributed as dist

    elements = float(sum(part.numel() for part in parts))
    device = parts[0].device if parts else torch.device("cpu")
    moments = torch.tensor([elements, elements * elements], dtype=torch.float64, device=device)
    exchange.average(moments)  # the sizes are equal exactly when the mean square is the squared mean
    differ = torch.tensor([int(bool(moments[1] != moments[0] * moments[0]))], dtype=torch.int64, device=device)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # every rank of this launch, not only this replicate group's
    if differ.item():
        raise RuntimeError(
            "mixed_fsdp2 (replicate_sync): the replicas hold optimizer state for different params, so a checkpoint"
            " cannot keep one copy of it: a param some replica never took an optimizer step for (this rank's shards"
            f" hold {int(elements)} elements; the replicas' mean is {moments[0].item():g}). Save after a step in"
            " which every replica's batch reached every trainable param, or use replicate_sync='every_step'."
        )


def _scatter_into(flat: Tensor, parts: List[Tensor]) -> None:
    offset = 0
    for part in parts:
        part.copy_(flat[offset : offset + part.numel()].view(part.shape))
        offset += part.numel()


def _buckets(parts: List[Tensor], budget: int) -> List[List[int]]:
    """Consecutive indices of ``parts`` holding about ``budget`` fp32 bytes each (a larger part alone)."""
    buckets: List[List[int]] = [[]]
    size = 0
    for index, part in enumerate(parts):
        if buckets[-1] and size + part.numel() * 4 > budget:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += part.numel() * 4
    return [b for b in buckets if b]
