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
"""

from typing import TYPE_CHECKING, List, Literal, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.model.tensors import local_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

BUCKET_BYTES = 64 << 20
"""fp32 bytes of pseudo-gradients (or params) per all-reduce."""


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
        self.syncs = 0
        self.global_copy: List[Tensor] = []
        """DiLoCo: each param's local part in fp32, as of the last sync (taken before the first optimizer step: after
        initialisation and any load)."""
        self.momentum: List[Tensor] = []
        self._state_device, self._state_dtype = state_device, state_dtype

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
        return self.steps % self.sync_every != 0

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now (every rank of the replicate dim calls it at the same step)."""
        for bucket in _buckets([local_tensor(p) for p in self.params], BUCKET_BYTES):
            if self.method == "local_sgd":
                self._average([self.params[i] for i in bucket])
            else:
                self._outer_step(bucket)
        self.syncs += 1

    def _average(self, params: List[nn.Parameter]) -> None:
        import torch.distributed as dist

        parts = [local_tensor(p) for p in params]
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
