"""Execute a ShardPlan on a model, in torchtitan's order: storage casts, then one ``fully_shard`` per sharded group
(children before parents, the root last), then the replicated params with their hooks and gradient reducer."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Set

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.sharding.mesh import ParallelMeshes
from lightning_mixedfsdp.sharding.plan import DtypeKey, ShardGroup, ShardPlan
from lightning_mixedfsdp.sharding.replicate import (
    ReplicatedGradReducer,
    ReplicatedParam,
    broadcast_from_first_rank,
    replicate_params,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass
class AppliedPlan:
    """A plan as applied to one model: its replicas, their reducer, and every hook installed (removable)."""

    plan: ShardPlan
    replicas: List[ReplicatedParam]
    reducer: ReplicatedGradReducer
    handles: List[RemovableHandle] = field(default_factory=list)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def apply_plan(
    model: nn.Module,
    plan: ShardPlan,
    meshes: ParallelMeshes,
    device: torch.device,
    reshard_after_forward: bool = True,
) -> AppliedPlan:
    """Shard ``model`` in place as ``plan`` says."""
    apply_storage_casts(model, plan)
    params = dict(model.named_parameters())
    ignored = {params[name] for name in plan.replicated_params}
    for group in plan.sharded_groups:
        apply_fully_shard(model, group, meshes.fsdp, reshard_after_forward, ignored)
    handles: List[RemovableHandle] = []
    replicas = replicate_params(model, plan, meshes.fsdp, device, handles)
    reducer = ReplicatedGradReducer([r.param for r in replicas], meshes.data_parallel.get_group())
    handles.extend(reducer.attach(model))
    return AppliedPlan(plan=plan, replicas=replicas, reducer=reducer, handles=handles)


@torch.no_grad()
def sync_replicas(applied: AppliedPlan, meshes: ParallelMeshes) -> None:
    """Replicas start identical on every data-parallel rank (rank 0's values), however each rank initialised them."""
    if applied.replicas:
        broadcast_from_first_rank([r.param.to_local() for r in applied.replicas], meshes.data_parallel.get_group())


@torch.no_grad()
def apply_storage_casts(model: nn.Module, plan: ShardPlan) -> None:
    for name, param in model.named_parameters():
        storage = plan.params[name].key.storage
        if param.dtype != storage:
            param.data = param.data.to(storage)


def mp_policy(key: DtypeKey) -> "MixedPrecisionPolicy":
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=key.compute, reduce_dtype=key.reduce, output_dtype=key.output, cast_forward_inputs=True
    )


def apply_fully_shard(
    model: nn.Module,
    group: ShardGroup,
    mesh: "DeviceMesh",
    reshard_after_forward: bool,
    ignored: Set[nn.Parameter],
) -> None:
    from torch.distributed.fsdp import fully_shard

    modules = [model.get_submodule(name) for name in group.modules]
    # None lets FSDP keep the root unsharded after forward (it is all-gathered again at once in backward)
    reshard: Optional[bool] = None if group.is_root and reshard_after_forward else reshard_after_forward
    target = modules[0] if len(modules) == 1 else modules
    fully_shard(
        target, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy(group.key), ignored_params=ignored
    )
