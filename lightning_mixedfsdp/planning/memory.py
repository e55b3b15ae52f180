"""Training-state bytes per rank, predicted from a plan: params, grads and AdamW states, sharded and replicated.

FSDP2 shards each param's dim 0 over the shard ranks (``torch.chunk``: the first ranks hold ``ceil(rows / shards)``
rows); replicated params are whole on every rank. Grads take the param's storage dtype and exist for trainable
params only; AdamW keeps two states in the param's dtype. Activations depend on batch and sequence and are not
included.
"""

import math
from dataclasses import dataclass
from typing import Dict

from lightning_mixedfsdp.planning.planner import ParamPlan, ShardPlan


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank (rank 0 of the shard dim)."""

    params: int
    grads: int
    optimizer: int
    replicated: int
    """Of the total: the bytes replicated params take beyond an even share (their overhead over full sharding)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def fits(self, gpu_bytes: float) -> bool:
        return self.total <= gpu_bytes

    def rows(self) -> Dict[str, int]:
        return {"params": self.params, "grads": self.grads, "AdamW states": self.optimizer, "total": self.total}


def estimate_memory(plan: ShardPlan, shard_ranks: int, data_parallel_ranks: int) -> MemoryEstimate:
    """Per-rank bytes of ``plan`` with params sharded over ``shard_ranks`` (replicated over the rest of the
    ``data_parallel_ranks``, HSDP)."""
    params = grads = optimizer = replicated = 0
    for param in plan.params.values():
        local = _local_bytes(param, shard_ranks)
        params += local
        if param.requires_grad:
            grads += local
            optimizer += 2 * local
        if param.replicated:
            share = param.nbytes / data_parallel_ranks
            replicated += int((param.nbytes - share) * (4 if param.requires_grad else 1))
    return MemoryEstimate(params, grads, optimizer, replicated)


def _local_bytes(param: ParamPlan, shard_ranks: int) -> int:
    if param.replicated or not param.shape:
        return param.nbytes
    rows = math.ceil(param.shape[0] / shard_ranks)
    return rows * (param.nbytes // param.shape[0])
