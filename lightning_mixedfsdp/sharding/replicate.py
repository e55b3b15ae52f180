"""Replicated params: Replicate DTensors on the data-parallel mesh, swapped for local views during forward, and the
reducer that averages their grads once per backward.

Optimizers, clipping and DCP see one consistent set of DTensors (shards and replicas on the same mesh), while
unmodified module forwards (HF modules included) see plain tensors, the way FSDP2 swaps in unsharded params.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.sharding.names import ModuleIndex
from lightning_mixedfsdp.sharding.plan import ShardGroup, ShardPlan
from lightning_mixedfsdp.sharding.tensors import cast_floating, tensors_in

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ReplicatedParam:
    name: str
    owner: nn.Module
    attribute: str
    param: nn.Parameter
    compute_dtype: torch.dtype


def replicate_params(
    model: nn.Module,
    index: ModuleIndex,
    plan: ShardPlan,
    mesh: "DeviceMesh",
    device: torch.device,
    handles: List[RemovableHandle],
) -> List[ReplicatedParam]:
    """Turn every replicated param of ``plan`` into a Replicate DTensor and install the forward hooks (their handles
    are appended to ``handles``)."""
    replicated: List[ReplicatedParam] = []
    for group in plan.replicated_groups:
        entries = [_to_replicate_dtensor(index, name, group, mesh, device) for name in group.params]
        handles.extend(_install_swap_hooks(index.outer[group.unit], entries))
        for module_name in group.modules:
            handles.extend(install_cast_hooks(index.inner[module_name], group.key.compute, group.key.output))
        replicated.extend(entries)
    return replicated


def broadcast_from_first_rank(tensors: Sequence[Tensor], group: "ProcessGroup") -> None:
    """Make replicas identical: one bucketed broadcast per dtype from data-parallel rank 0."""
    import torch.distributed as dist

    for bucket in _buckets_by_dtype(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        _unflatten_into(flat, bucket)


def install_cast_hooks(
    module: nn.Module, input_dtype: torch.dtype, output_dtype: Optional[torch.dtype]
) -> List[RemovableHandle]:
    """What FSDP's MixedPrecisionPolicy does at a group boundary, for modules that are not FSDP groups."""

    def cast_inputs(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return cast_floating((args, kwargs), input_dtype)

    handles = [module.register_forward_pre_hook(cast_inputs, with_kwargs=True)]
    if output_dtype is not None:
        handles.append(module.register_forward_hook(lambda _m, _a, output: cast_floating(output, output_dtype)))
    return handles


def _to_replicate_dtensor(
    index: ModuleIndex, name: str, group: ShardGroup, mesh: "DeviceMesh", device: torch.device
) -> ReplicatedParam:
    from torch.distributed.tensor import DTensor, Replicate

    owner_name, _, attribute = name.rpartition(".")
    owner = index.inner[owner_name]
    param = owner._parameters[attribute]
    # a meta param stays on meta: the strategy allocates and fills it after sharding
    local = param.detach().to(device=param.device if param.is_meta else device, dtype=group.key.storage)
    replica = nn.Parameter(
        DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False),
        requires_grad=param.requires_grad,
    )
    owner._parameters[attribute] = replica
    return ReplicatedParam(name, owner, attribute, replica, group.key.compute)


def _install_swap_hooks(unit: nn.Module, entries: List[ReplicatedParam]) -> List[RemovableHandle]:
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

    return [
        unit.register_forward_pre_hook(swap_in, prepend=True),
        unit.register_forward_hook(swap_out, always_call=True),
    ]


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


class ReplicatedGradReducer:
    """Averages the grads of replicated params over all data-parallel ranks once per backward.

    One all-reduce per grad dtype, each bucket carrying a presence flag per param, so a param that got no grad on some
    rank (an unused expert) is averaged as zero there, and one that got no grad anywhere keeps ``grad=None``. Every
    rank issues the same collectives whatever its grads, so nothing deadlocks.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: "ProcessGroup") -> None:
        self._buckets: Dict[torch.dtype, List[nn.Parameter]] = {}
        for param in params:
            if param.requires_grad:
                self._buckets.setdefault(param.dtype, []).append(param)
        self._group = group
        self.requires_gradient_sync = True
        self._callback_queued = False

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def attach(self, root: nn.Module) -> List[RemovableHandle]:
        """Reduce at the end of every backward that flows through ``root``'s outputs."""
        return [root.register_forward_hook(self._hook_outputs)] if self._buckets else []

    @torch.no_grad()
    def reduce(self) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for params in self._buckets.values():
            locals_ = [p.grad.to_local() if p.grad is not None else None for p in params]
            flags = torch.tensor(
                [g is not None for g in locals_], dtype=params[0].dtype, device=params[0].to_local().device
            )
            grads = [
                g if g is not None else p.to_local().new_zeros(p.shape) for g, p in zip(locals_, params, strict=True)
            ]
            flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self._group)
            # the flags are read on the host only when this rank lacks a grad: no device sync in the common case
            missing = any(g is None for g in locals_)
            present = flat[-len(params) :].tolist() if missing else [1.0] * len(params)
            offset = 0
            for param, local, anywhere in zip(params, locals_, present, strict=True):
                chunk = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                if local is not None:
                    local.copy_(chunk)
                elif anywhere > 0:
                    param.grad = DTensor.from_local(chunk.clone(), param.device_mesh, param.placements, run_check=False)

    def _hook_outputs(self, _module: nn.Module, _args: Any, output: Any) -> None:
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, _grad: Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            _queue_after_backward(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if self.requires_gradient_sync:
            self.reduce()


def _queue_after_backward(callback: Any) -> None:
    # Private engine API, checked on torch 2.13.0; FSDP2 queues its own post-backward callback the same way.
    torch.autograd.Variable._execution_engine.queue_callback(callback)
