"""Collectives over many small tensors: one flat collective per (dtype, device) bucket, written back in place."""

from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@torch.no_grad()
def broadcast_from_first_rank(tensors: Sequence[Tensor], group: "ProcessGroup") -> None:
    """Make ``tensors`` identical on every rank of ``group``: rank 0's values."""
    import torch.distributed as dist

    for bucket in _buckets(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        _unflatten_into(flat, bucket)


@torch.no_grad()
def average_over_ranks(tensors: Sequence[Tensor], group: "ProcessGroup") -> None:
    """Replace ``tensors`` (floating) by their mean over the ranks of ``group``."""
    import torch.distributed as dist

    for bucket in _buckets(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
        _unflatten_into(flat, bucket)


def _buckets(tensors: Sequence[Tensor]) -> Dict[Tuple[torch.dtype, torch.device], List[Tensor]]:
    buckets: Dict[Tuple[torch.dtype, torch.device], List[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return buckets


def _unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
