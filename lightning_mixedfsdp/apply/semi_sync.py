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

Checkpoints hold the outer state beside the optimizer's own, under each param's entry of the optimizer's state dict
(``outer_steps``, the cycle's position; for DiLoCo ``outer_global`` and ``outer_momentum``, fp32 and sharded like the
param), so DCP writes and reshards them as it does AdamW's moments, and a single-file checkpoint gathers them. They
are added only to the state dicts taken for a checkpoint (:attr:`OuterSync.in_checkpoint`), never to the optimizer's
live state (AdamW makes its state only where a param has none), and taken out of a loaded state dict before torch's
``load_state_dict`` (which would cast them to the param's dtype).
"""

import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.model.tensors import local_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer

BUCKET_BYTES = 64 << 20
"""fp32 bytes of pseudo-gradients (or params) per all-reduce."""
STEPS_KEY, GLOBAL_KEY, MOMENTUM_KEY = "outer_steps", "outer_global", "outer_momentum"
OUTER_STATE_KEYS = (STEPS_KEY, GLOBAL_KEY, MOMENTUM_KEY)
"""The outer state's entries in a param's optimizer state, in checkpoints only."""


def semi_sync_problems(
    method: str,
    fault_tolerant: bool,
    context_parallel: int,
    expert_parallel: int,
    offload: Optional[str],
    float8: Optional[str] = None,
    quantize_base: Optional[str] = None,
    compile: bool = False,
) -> List[str]:
    """What ``replicate_sync=method`` does not compose with (untested), each with its fix. Tested with it: activation
    checkpointing and LoRA (the adapters' outer state only)."""
    if method == "every_step":
        return []
    problems = []
    untested = {
        "fault_tolerance (torchft replica groups)": fault_tolerant,
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
    """Local SGD or DiLoCo over ``group`` (the ranks holding the same shards in every replica) for ``params`` (the
    trainable ones, sharded or replicated within a replica), after every ``sync_every``-th optimizer step."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: "ProcessGroup",
        method: Literal["local_sgd", "diloco"],
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        state_device: Optional[torch.device] = None,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params = list(params)
        self.group, self.method, self.sync_every = group, method, sync_every
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.steps = 0
        """Optimizer steps taken; a sync follows each ``sync_every``-th."""
        self.synced_at = 0
        """The step count at the last sync (an early one before a save included)."""
        self.syncs = 0
        self.global_copy: List[Tensor] = []
        """DiLoCo: each param's local part in fp32, as of the last sync (taken before the first optimizer step: after
        initialisation and any load)."""
        self.momentum: List[Tensor] = []
        self._state_device, self._state_dtype = state_device, state_dtype
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.in_checkpoint = False
        """Whether the optimizers' state dicts taken now are for a checkpoint (a save, or the template of a load of
        one that holds the outer state): they carry the outer state then (the strategies set it)."""
        self.loaded = False
        """Whether a loaded optimizer state held the outer state."""
        self._optimizers: List["weakref.ref[Optimizer]"] = []

    def attach(self, optimizer: "Optimizer") -> None:
        """``optimizer``'s state dicts carry the outer state of the params it holds (saved, loaded and resharded with
        its own); nothing when it holds none of them."""
        if any(id(p) in self._index for group in optimizer.param_groups for p in group["params"]):
            optimizer.register_state_dict_post_hook(self._add_to_state_dict)
            optimizer.register_load_state_dict_pre_hook(self._take_from_state_dict)
            self._optimizers.append(weakref.ref(optimizer))

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

    def _add_to_state_dict(self, optimizer: "Optimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
        if not self.in_checkpoint:
            return state_dict
        self.before_step()  # DiLoCo's global copy, if no step took it yet
        state = dict(state_dict["state"])  # its entries are the optimizer's live state dicts: replaced, not changed
        for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=True):
            for saved_id, param in zip(saved_group["params"], group["params"], strict=True):
                index = self._index.get(id(param))
                if index is None:
                    continue
                entry = {**state.get(saved_id, {}), STEPS_KEY: torch.tensor(self.steps, dtype=torch.int64)}
                if self.method == "diloco":
                    entry[GLOBAL_KEY] = _shaped_like(self.global_copy[index], param)
                    entry[MOMENTUM_KEY] = _shaped_like(self.momentum[index], param)
                state[saved_id] = entry
        return {**state_dict, "state": state}

    def _take_from_state_dict(self, optimizer: "Optimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
        state = dict(state_dict["state"])
        steps: Optional[int] = None
        for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=False):
            for saved_id, param in zip(saved_group["params"], group["params"], strict=False):
                saved = state.get(saved_id)
                if saved is None or not any(key in saved for key in OUTER_STATE_KEYS):
                    continue
                entry = {key: value for key, value in saved.items() if key not in OUTER_STATE_KEYS}
                index = self._index.get(id(param))
                if index is not None and STEPS_KEY in saved:
                    steps = int(saved[STEPS_KEY])
                    if self.method == "diloco" and GLOBAL_KEY in saved and MOMENTUM_KEY in saved:
                        self.before_step()
                        self.global_copy[index].copy_(local_tensor(saved[GLOBAL_KEY]))
                        self.momentum[index].copy_(local_tensor(saved[MOMENTUM_KEY]))
                if entry:
                    state[saved_id] = entry
                else:
                    del state[saved_id]
        if steps is not None:  # saved right after a sync (the save's own, if mid-cycle)
            self.steps, self.synced_at, self.loaded = steps, steps, True
        return {**state_dict, "state": state}

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
        states = [
            value
            for reference in self._optimizers
            for optimizer in [reference()]
            if optimizer is not None
            for param in self.params
            for key, value in optimizer.state.get(param, {}).items()
            if key != "step" and isinstance(value, Tensor) and value.is_floating_point()
        ]
        parts = [local_tensor(state) for state in states]
        _check_same_sizes(parts, self.group)
        for bucket in _buckets(parts, BUCKET_BYTES):
            self._average_parts([parts[i] for i in bucket])

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now (every rank of the replicate dim calls it at the same step)."""
        for bucket in _buckets([local_tensor(p) for p in self.params], BUCKET_BYTES):
            if self.method == "local_sgd":
                self._average([self.params[i] for i in bucket])
            else:
                self._outer_step(bucket)
        self.syncs += 1
        self.synced_at = self.steps

    def _average(self, params: List[nn.Parameter]) -> None:
        self._average_parts([local_tensor(p) for p in params])

    def _average_parts(self, parts: List[Tensor]) -> None:
        import torch.distributed as dist

        flat = torch.cat([part.reshape(-1).float() for part in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
        _scatter_into(flat, parts)

    def _outer_step(self, bucket: List[int]) -> None:
        import torch.distributed as dist

        parts = [local_tensor(self.params[i]) for i in bucket]
        device = parts[0].device
        globals_ = [self.global_copy[i] for i in bucket]
        # the pseudo-gradient in fp32: what this replica's local steps changed, from the params it started the cycle
        # with (the global copy in the param's dtype); the global copy's part below the param's spacing stays out
        starts = [g.to(device=device, dtype=p.dtype).float() for g, p in zip(globals_, parts, strict=True)]
        flat = torch.cat([(start - p.float()).reshape(-1) for start, p in zip(starts, parts, strict=True)])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
        offset = 0
        for index, part in zip(bucket, parts, strict=True):
            delta = flat[offset : offset + part.numel()].view(part.shape).to(self.global_copy[index].device)
            offset += part.numel()
            momentum = self.momentum[index]
            momentum.mul_(self.outer_momentum).add_(delta.to(momentum.dtype))
            update = delta.add(momentum, alpha=self.outer_momentum) if self.nesterov else momentum
            self.global_copy[index].sub_(update.to(momentum.dtype), alpha=self.outer_lr)
            part.copy_(self.global_copy[index])  # cast to the param's own dtype


def _check_same_sizes(parts: List[Tensor], group: "ProcessGroup") -> None:
    """Every replica holds optimizer state for the same params (else their averaging would not line up): raises on
    every rank of the job where some replica does not (a param it never took an optimizer step for)."""
    import torch.distributed as dist

    elements = sum(part.numel() for part in parts)
    device = parts[0].device if parts else torch.device("cpu")
    bounds = torch.tensor([elements, -elements], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    differ = torch.tensor([int(bounds[0].item() != -bounds[1].item())], dtype=torch.int64, device=device)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # every rank, not only this replicate group's, raises
    if differ.item():
        raise RuntimeError(
            "mixed_fsdp2 (replicate_sync): the replicas hold optimizer state for different params, so a checkpoint"
            " cannot keep one copy of it: a param some replica never took an optimizer step for (this rank's shards:"
            f" {-bounds[1].item()} to {bounds[0].item()} elements across its replicate group). Save after a step in"
            " which every replica's batch reached every trainable param, or use replicate_sync='every_step'."
        )


def without_outer_state(optimizer: "Optimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A loaded optimizer state dict without the outer state (a semi-synchronous run's checkpoint loaded by one that
    syncs every step, or into an optimizer whose params do not sync)."""
    state = {
        key: {name: value for name, value in entry.items() if name not in OUTER_STATE_KEYS}
        for key, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": {key: entry for key, entry in state.items() if entry}}


def _shaped_like(local: Tensor, param: Tensor) -> Tensor:
    """This rank's part of an outer state tensor as the param is held (a DTensor sharded like it), on its device."""
    from torch.distributed.tensor import DTensor

    local = local.to(local_tensor(param).device)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
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
