"""Replicated params: Replicate DTensors on the data-parallel mesh, read by module code as local views, and the
reducer that averages their grads once per backward.

Optimizers, clipping and DCP see one consistent set of DTensors (shards and replicas on the same mesh), while
unmodified module forwards (HF modules included) read plain tensors: the owner's class gets a property per replicated
param (``apply/adapt.py``), the way FSDP2 swaps unsharded params in, but with no hook and no state.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, cast

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.apply.adapt import Adaptation, ClassRestore, adapt
from lightning_mixedfsdp.apply.boundaries import group_boundary
from lightning_mixedfsdp.compat.torch import (
    dtensor_storage,
    dtensor_with_local,
    gradient_divide_factor,
    own_parameters,
    replace_parameter,
)
from lightning_mixedfsdp.model.names import ModuleIndex
from lightning_mixedfsdp.planning.types import ShardGroup, ShardPlan

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


@dataclass
class ReplicatedParam:
    name: str
    param: nn.Parameter
    reduce_dtype: torch.dtype


def replicate_params(
    index: ModuleIndex,
    plan: ShardPlan,
    mesh: "DeviceMesh",
    device: torch.device,
    recompute: bool,
    restores: List[ClassRestore],
) -> List[ReplicatedParam]:
    """Turn every replicated param of ``plan`` into a Replicate DTensor, give its owner a local view of it, and give
    the group's modules their dtype boundary (before ``fully_shard``; what undoes the adaptations is appended to
    ``restores``)."""
    replicated: List[ReplicatedParam] = []
    adaptations: Dict[nn.Module, Adaptation] = {}
    for group in plan.replicated_groups:
        for name in group.params:
            owner_name, _, attribute = name.rpartition(".")
            owner = index.inner[owner_name]
            replicated.append(_to_replicate_dtensor(owner, name, attribute, group, mesh, device))
            view = Adaptation(views=((attribute, group.key.compute),))
            adaptations[owner] = adaptations.get(owner, Adaptation()).merged(view)
        boundary = group_boundary(group, recompute)
        for module_name in group.modules:
            module = index.inner[module_name]
            adaptations[module] = adaptations.get(module, Adaptation()).merged(Adaptation(boundary=boundary))
    restores.extend(adapt(module, adaptation) for module, adaptation in adaptations.items())
    return replicated


def _to_replicate_dtensor(
    owner: nn.Module, name: str, attribute: str, group: ShardGroup, mesh: "DeviceMesh", device: torch.device
) -> ReplicatedParam:
    from torch.distributed.tensor import DTensor, Replicate

    param = own_parameters(owner)[attribute]
    assert param is not None
    # a meta param stays on meta: the model setup allocates and fills it after sharding
    local = param.detach().to(device=param.device if param.is_meta else device, dtype=group.key.storage)
    replica = nn.Parameter(
        DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False),
        requires_grad=param.requires_grad,
    )
    replace_parameter(owner, attribute, replica)
    return ReplicatedParam(name, replica, group.key.reduce)


class ReplicatedGradReducer:
    """Reduces the grads of replicated params over all data-parallel ranks once per backward, under the contract
    FSDP applies to the sharded grads of the same step: the plan's reduce dtype, and FSDP's gradient divide factor
    (``set_gradient_divide_factor``; the mean over ranks when none is set).

    One all-reduce per reduce dtype, each bucket carrying a presence flag per param, so a param that got no grad on
    some rank (an unused expert) counts as zero there, and one that got no grad anywhere keeps ``grad=None``. Every
    rank issues the same collectives whatever its grads, so nothing deadlocks. The flags are built on the device;
    the host reads them back only when this rank lacks a grad.

    A backward leaves an eager step's grads on the local leaves module code read (``adapt.replica_local``); the
    reduction takes them from there (added to a ``param.grad`` left from an earlier backward, as autograd would
    have accumulated it) and leaves the reduced grad in ``param.grad``, a Replicate DTensor. A compiled forward reads
    ``to_local()``, whose backward writes ``param.grad`` itself.
    """

    def __init__(
        self,
        replicas: Sequence[ReplicatedParam],
        group: "ProcessGroup",
        divide_factor: Callable[[], Optional[float]] = lambda: None,
    ) -> None:
        self._buckets: Dict[torch.dtype, List[nn.Parameter]] = {}
        self._frozen: List[ReplicatedParam] = []
        """Replicas frozen so far: each joins its bucket once it requires grad (a module unfrozen after setup)."""
        for replica in replicas:
            if replica.param.requires_grad:
                self._buckets.setdefault(replica.reduce_dtype, []).append(replica.param)
            else:
                self._frozen.append(replica)
        self._group = group
        self._divide_factor = divide_factor
        self._all_present: Dict[torch.dtype, Tensor] = {}
        self.requires_gradient_sync = True
        self.cross_replica_reduce: Optional[Callable[[Tensor], None]] = None
        """Averages each reduced bucket across replica groups too (fault tolerance); None: one replica group."""

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def has_replicas(self) -> bool:
        """Whether any replica may need reducing, now or once unfrozen."""
        return bool(self._buckets or self._frozen)

    def _adopt_unfrozen(self) -> None:
        """Replicas frozen at setup that require grad now join their buckets (every rank unfreezes the same, so the
        buckets stay alike)."""
        unfrozen = [replica for replica in self._frozen if replica.param.requires_grad]
        for replica in unfrozen:
            self._buckets.setdefault(replica.reduce_dtype, []).append(replica.param)
            self._frozen.remove(replica)

    def on_backward_end(self) -> None:
        if self.requires_gradient_sync:
            self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        import torch.distributed as dist

        if self._frozen:
            self._adopt_unfrozen()
        factor = self._divide_factor()
        for reduce_dtype, params in self._buckets.items():
            grads = [self._take_grad(p) for p in params]
            missing = any(g is None for g in grads)
            template = as_dtensor(params[0]).to_local()
            flags = self._presence_flags(reduce_dtype, grads, template.device)
            values = [
                g.to(reduce_dtype) if g is not None else template.new_zeros(p.shape, dtype=reduce_dtype)
                for g, p in zip(grads, params, strict=True)
            ]
            flat = torch.cat([v.reshape(-1) for v in values] + [flags])
            if factor is None:
                dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self._group)
            else:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
                flat.div_(factor)
            if self.cross_replica_reduce is not None:
                # the presence flags are averaged too: a param some group had a grad for stays present
                self.cross_replica_reduce(flat)
            present = flat[-len(params) :].tolist() if missing else None
            offset = 0
            for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
                chunk = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                if param.grad is not None:
                    as_dtensor(param.grad).to_local().copy_(chunk)
                elif grad is not None or (present is not None and present[index] > 0):
                    # its own memory: the chunk would keep the whole bucket alive and alias its neighbours
                    param.grad = dtensor_with_local(param, chunk.to(param.dtype, copy=True))

    @staticmethod
    def _take_grad(param: nn.Parameter) -> Optional[Tensor]:
        """This rank's grad of ``param`` for the reduction: the local leaf's (cleared), plus a ``param.grad`` already
        there (an earlier backward's, or a compiled forward's)."""
        leaf = dtensor_storage(param)
        fresh, leaf.grad = leaf.grad, None
        existing = as_dtensor(param.grad).to_local() if param.grad is not None else None
        if fresh is None:
            return existing
        return fresh if existing is None else existing + fresh

    def drop_local_grads(self) -> None:
        """Forget the grads a failed backward left on the local leaves (recovery before the next forward)."""
        for params in self._buckets.values():
            for param in params:
                dtensor_storage(param).grad = None

    def _presence_flags(self, dtype: torch.dtype, grads: Sequence[Optional[Tensor]], device: torch.device) -> Tensor:
        """One flag per param, made on the device from cached tensors: no host-to-device copy."""
        ones = self._all_present.get(dtype)
        if ones is None or ones.device != device:
            ones = self._all_present[dtype] = torch.ones(len(grads), dtype=dtype, device=device)
        if all(g is not None for g in grads):
            return ones
        zero = ones.new_zeros(())
        return torch.stack([ones[i] if g is not None else zero for i, g in enumerate(grads)])


def as_dtensor(tensor: Tensor) -> "DTensor":
    """A replicated param (or its grad) as the DTensor it is: for the type checker, which sees ``nn.Parameter``."""
    return cast("DTensor", tensor)


def fsdp_gradient_divide_factor(module: nn.Module) -> Optional[float]:
    """The factor ``FSDPModule.set_gradient_divide_factor`` set on ``module``'s own FSDP groups, if any."""
    from torch.distributed.fsdp import FSDPModule

    return gradient_divide_factor(module) if isinstance(module, FSDPModule) else None
