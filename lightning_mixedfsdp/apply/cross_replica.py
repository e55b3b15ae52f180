"""The reduction across replica groups (fault tolerance): every gradient, after it is reduced within its group, is
averaged across the groups by a function the caller gives (torchft's manager all-reduce), in the dtype it was reduced
in, so fp32 norms stay fp32 across groups too."""

from typing import Callable

from torch import Tensor, nn

from lightning_mixedfsdp.apply.replicate import ReplicatedGradReducer

CrossReplicaReduce = Callable[[Tensor], None]
"""Averages a tensor in place across the replica groups."""


def apply_cross_replica_reduction(model: nn.Module, reducer: ReplicatedGradReducer, reduce: CrossReplicaReduce) -> None:
    """``reduce`` on every sharded group's gradients (FSDP2's all-reduce hook of each ``fully_shard``: its
    reduce-scatter output, or with HSDP its all-reduce output, in the group's reduce dtype; experts groups included)
    and on the replicated params' buckets. FSDP2's hook is per ``fully_shard`` call, so every one gets it, or the
    groups' params drift apart."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(reduce)
    reducer.cross_replica_reduce = reduce
