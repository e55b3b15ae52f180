"""Replicated params: Replicate DTensors on the data-parallel mesh, swapped for local views during forward.

Optimizers, clipping and DCP see one consistent set of DTensors (shards and replicas on the same mesh), while
unmodified module forwards (HF modules included) see plain tensors, the way FSDP2 swaps in unsharded params.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_mixedfsdp.plan import ShardGroup, ShardPlan


@dataclass
class ReplicatedParam:
    name: str
    owner: nn.Module
    attribute: str
    param: nn.Parameter
    compute_dtype: torch.dtype


def replicate_params(model: nn.Module, plan: ShardPlan, mesh: Any, device: torch.device) -> List[ReplicatedParam]:
    """Turn every replicated param of ``plan`` into a Replicate DTensor and install the forward hooks."""
    replicated: List[ReplicatedParam] = []
    for group in plan.replicated_groups:
        unit = model.get_submodule(group.unit)
        entries = [_to_replicate_dtensor(model, name, group, mesh, device) for name in group.params]
        _install_swap_hooks(unit, entries)
        for module_name in group.modules:
            install_cast_hooks(model.get_submodule(module_name), group.key.compute, group.key.output)
        replicated.extend(entries)
    return replicated


def broadcast_from_first_rank(tensors: Sequence[Tensor], group: Any) -> None:
    """Make replicas identical: one bucketed broadcast per dtype from data-parallel rank 0."""
    import torch.distributed as dist

    for bucket in _buckets_by_dtype(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        _unflatten_into(flat, bucket)


def install_cast_hooks(module: nn.Module, input_dtype: torch.dtype, output_dtype: Optional[torch.dtype]) -> None:
    """What FSDP's MixedPrecisionPolicy does at a group boundary, for modules that are not FSDP groups."""

    def cast_inputs(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return _cast_floating((args, kwargs), input_dtype)

    module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if output_dtype is not None:
        module.register_forward_hook(lambda _m, _a, output: _cast_floating(output, output_dtype))


def _to_replicate_dtensor(
    model: nn.Module, name: str, group: ShardGroup, mesh: Any, device: torch.device
) -> ReplicatedParam:
    from torch.distributed.tensor import DTensor, Replicate

    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = owner._parameters[attribute]
    # a meta param stays on meta: the strategy allocates and fills it after sharding
    local = param.detach().to(device=param.device if param.is_meta else device, dtype=group.key.storage)
    replica = nn.Parameter(
        DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False),
        requires_grad=param.requires_grad,
    )
    owner._parameters[attribute] = replica
    return ReplicatedParam(name, owner, attribute, replica, group.key.compute)


def _install_swap_hooks(unit: nn.Module, entries: List[ReplicatedParam]) -> None:
    def swap_in(*_: Any) -> None:
        for entry in entries:
            view = entry.param.to_local()
            # an autograd-tracked cast: the grad arrives in the storage dtype, as with FSDP's param_dtype
            view = view.to(entry.compute_dtype) if view.dtype != entry.compute_dtype else view
            # the instance attribute shadows `_parameters[...]`, so module code reads a plain tensor
            object.__setattr__(entry.owner, entry.attribute, view)

    def swap_out(*_: Any) -> None:
        for entry in entries:
            entry.owner.__dict__.pop(entry.attribute, None)

    unit.register_forward_pre_hook(swap_in, prepend=True)
    unit.register_forward_hook(swap_out, always_call=True)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def _buckets_by_dtype(tensors: Sequence[Tensor]) -> Dict[torch.dtype, List[Tensor]]:
    buckets: Dict[torch.dtype, List[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.dtype, []).append(tensor)
    return buckets


def _unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
