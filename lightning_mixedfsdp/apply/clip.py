"""Gradient-norm clipping over grads that mix Shard/Replicate placements, meshes and dtypes.

Grads are grouped by (mesh, placements) and, inside a group, by (device, dtype): one foreach norm kernel per bucket
(in fp32, whatever the grad dtype), one all-reduce per group over its sharded mesh dims, one combine; the scaling is
one foreach multiply per bucket. torchtitan's clipping is shaped the same way.
"""

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.torch import assert_on_device, foreach_mul_, foreach_norm
from lightning_mixedfsdp.config import NonfiniteCheck
from lightning_mixedfsdp.model.tensors import local_tensor

_GroupKey = Tuple[Any, Any]
_BucketKey = Tuple[torch.device, torch.dtype]


def _placement_key(param: Tensor) -> _GroupKey:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.device_mesh, tuple(param.placements)
    return None, None


_Groups = Dict[_GroupKey, Dict[_BucketKey, List[Tensor]]]


def _grouped_grads(params: Iterable[Tensor]) -> Tuple[_Groups, torch.device]:
    """Local grads by placement group, then by (device, dtype), in one pass. Every param's group is present, grad or
    not, so every rank issues the same collectives."""
    groups: _Groups = {}
    device: Optional[torch.device] = None
    for param in params:
        buckets = groups.setdefault(_placement_key(param), {})
        if param.grad is not None:
            grad = local_tensor(param.grad)
            device = device or grad.device
            if grad.numel():
                buckets.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups, device or torch.device("cpu")


@torch.no_grad()
def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0, across: Any = None) -> Tensor:
    """The global grad norm in fp32, identical on every rank.

    Each placement group's local contribution is reduced over the mesh dims it is sharded on, then the groups are
    combined. Params without a grad contribute zero.
    """
    return _total_norm(*_grouped_grads(parameters), float(norm_type), across)


def _total_norm(groups: _Groups, device: torch.device, norm_type: float, across: Any = None) -> Tensor:
    import torch.distributed as dist

    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, placements), buckets in groups.items():
        norms = [n for grads in buckets.values() for n in foreach_norm(grads, norm_type)]
        value = torch.zeros((), dtype=torch.float32, device=device)
        if norms:
            stacked = torch.stack([n.to(device) for n in norms])
            value = stacked.max() if is_inf else stacked.pow(norm_type).sum()
        if mesh is not None:
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():
                    dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if is_inf else total + value
    if across is not None:  # pipeline stages: each holds its own params, every param once
        dist.all_reduce(total, op=op, group=across)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    nonfinite_check: NonfiniteCheck = "raise",
    across: Any = None,
    counted_elsewhere: Sequence[Tensor] = (),
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for grads that mix Shard/Replicate placements, meshes and dtypes.
    ``counted_elsewhere``: params clipped here whose grad another rank's norm holds (a tied copy on the last pipeline
    stage), left out of this rank's part of the norm.

    ``error_if_nonfinite`` keeps torch's and Lightning's contract: a non-finite norm raises a ``RuntimeError`` here,
    before any grad is scaled, which the caller can catch and train on (skip the batch). On CUDA that check waits for
    the norm: one host sync per call. ``nonfinite_check="device_assert"`` drops the sync: on CUDA the check becomes a
    device-side assert placed before the scaling. If it fails, no kernel queued after it runs (the grads are not
    scaled, the optimizer step that follows changes nothing) and the error surfaces as a RuntimeError ("device-side
    assert triggered") at the next call that waits for the GPU, e.g. ``loss.item()`` or a checkpoint save; that
    process cannot use the GPU again, so restart from the last checkpoint. On other devices both raise here.
    """
    parameters = list(parameters)
    groups, device = _grouped_grads(parameters)
    norm_groups = groups
    if counted_elsewhere:
        skipped = {id(param) for param in counted_elsewhere}
        norm_groups, _ = _grouped_grads([p for p in parameters if id(p) not in skipped])
        norm_groups = {key: norm_groups.get(key, {}) for key in groups}  # every group's collectives still issued
    total = _total_norm(norm_groups, device, float(norm_type), across)
    if error_if_nonfinite:
        _check_finite(total, norm_type, on_device=nonfinite_check == "device_assert")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for buckets in groups.values():
        for (device, dtype), grads in buckets.items():
            foreach_mul_(grads, coefficient.to(device=device, dtype=dtype))
    return total


def _check_finite(total: Tensor, norm_type: float, on_device: bool) -> None:
    message = (
        f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. Set"
        " `error_if_nonfinite=False` to clip anyway."
    )
    if on_device and total.device.type == "cuda":
        assert_on_device(torch.isfinite(total), message)
    elif not torch.isfinite(total):
        raise RuntimeError(message.replace("non-finite", f"non-finite ({total.item()})"))
