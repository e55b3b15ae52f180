"""Gradient-norm clipping over grads that mix Shard/Replicate placements, meshes and dtypes."""

import math
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placement_key(param: Tensor) -> Tuple[Any, Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.device_mesh, tuple(param.placements)
    return None, None


@torch.no_grad()
def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The global grad norm in fp32, identical on every rank.

    Grads are grouped by (mesh, placements); each group's local contribution is reduced over the mesh dims it is
    sharded on, then the groups are combined. Params without a grad contribute zero, so every rank issues the same
    collectives.
    """
    import torch.distributed as dist

    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    contributions: Dict[Tuple[Any, Any], Tensor] = {}
    for param in parameters:
        key = _placement_key(param)
        grad = param.grad
        local = _local(grad) if grad is not None else None
        device = _local(param).device
        if local is None or local.numel() == 0:
            value = torch.zeros((), dtype=torch.float32, device=device)
        else:
            value = torch.linalg.vector_norm(local, norm_type, dtype=torch.float32)
            value = value if is_inf else value.pow(norm_type)
        previous = contributions.get(key)
        contributions[key] = (
            value if previous is None else (torch.maximum(previous, value) if is_inf else previous + value)
        )

    total: Optional[Tensor] = None
    for (mesh, placements), value in contributions.items():
        if mesh is not None:
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():
                    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                    dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = value if total is None else (torch.maximum(total, value) if is_inf else total + value)
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for grads that mix Shard/Replicate placements, meshes and dtypes."""
    params = [p for p in parameters]
    total = total_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite ({total.item()}), so it cannot be"
            " clipped. Set `error_if_nonfinite=False` to clip anyway."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            local = _local(param.grad)
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
    return total
