"""Execute a ShardPlan: storage casts, one ``fully_shard`` per sharded group, replicated params and their hooks."""

from dataclasses import dataclass
from typing import List, Optional, Set

import torch
from torch import nn

from lightning_mixedfsdp.gradients import ReplicatedGradReducer
from lightning_mixedfsdp.mesh import ParallelMeshes
from lightning_mixedfsdp.plan import DtypeKey, ShardGroup, ShardPlan
from lightning_mixedfsdp.replicate import ReplicatedParam, broadcast_from_first_rank, replicate_params


@dataclass
class AppliedPlan:
    plan: ShardPlan
    replicas: List[ReplicatedParam]
    reducer: ReplicatedGradReducer


def apply_plan(
    model: nn.Module,
    plan: ShardPlan,
    meshes: ParallelMeshes,
    device: torch.device,
    reshard_after_forward: bool = True,
) -> AppliedPlan:
    """Shard ``model`` in place as ``plan`` says, children before parents, the root last."""
    cast_to_planned_storage(model, plan)
    params = dict(model.named_parameters())
    ignored = {params[name] for name in plan.replicated_params}
    for group in plan.sharded_groups:
        apply_fully_shard(model, group, meshes.fsdp, reshard_after_forward, ignored)
    replicas = replicate_params(model, plan, meshes.fsdp, device)
    reducer = ReplicatedGradReducer([r.param for r in replicas], meshes.data_parallel.get_group())
    reducer.attach(model)
    return AppliedPlan(plan=plan, replicas=replicas, reducer=reducer)


@torch.no_grad()
def sync_replicas(applied: AppliedPlan, meshes: ParallelMeshes) -> None:
    """Replicas start identical on every data-parallel rank (rank 0's values), however each rank initialised them."""
    if applied.replicas:
        broadcast_from_first_rank([r.param.to_local() for r in applied.replicas], meshes.data_parallel.get_group())


@torch.no_grad()
def cast_to_planned_storage(model: nn.Module, plan: ShardPlan) -> None:
    for name, param in model.named_parameters():
        storage = plan.params[name].key.storage
        if param.dtype != storage:
            param.data = param.data.to(storage)


def mp_policy(key: DtypeKey) -> "torch.distributed.fsdp.MixedPrecisionPolicy":
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=key.compute, reduce_dtype=key.reduce, output_dtype=key.output, cast_forward_inputs=True
    )


def apply_fully_shard(
    model: nn.Module, group: ShardGroup, mesh: object, reshard_after_forward: bool, ignored: Set[nn.Parameter]
) -> None:
    from torch.distributed.fsdp import fully_shard

    modules = [model.get_submodule(name) for name in group.modules]
    # None lets FSDP keep the root unsharded after forward (it is all-gathered again at once in backward)
    reshard: Optional[bool] = None if group.is_root and reshard_after_forward else reshard_after_forward
    target = modules[0] if len(modules) == 1 else modules
    fully_shard(
        target, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy(group.key), ignored_params=ignored
    )
