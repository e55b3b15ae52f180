"""A param's or buffer's full value in regions of bounded size, for exports: no rank ever holds more than one region of
a tensor, however large the tensor (a fused experts weight, an embedding). Every rank walks the same regions in the
same order (each may be a collective).

A region is ``(dim, start, stop, value)``: the indices ``start:stop`` of dimension ``dim`` and all of the others.

- A plain tensor (a replicated param, a buffer) is cut into rows on each rank: no collective.
- A DTensor sharded on its first dimension over one mesh dim (FSDP, HSDP): rows, each block broadcast by the rank
  that holds it within its shard group.
- Any other DTensor with a dimension no placement splits (experts under expert parallelism and FSDP, tensor
  parallelism): slices along that dimension, each gathered (``DTensor.full_tensor``) on its own.
- A DTensor split on every dimension is gathered whole (tensor parallelism row-wise under FSDP: say so in the docs).
"""

import math
from typing import Any, Iterator, List, Optional, Tuple, cast

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.torch import dtensor_with_local
from lightning_mixedfsdp.compat.torchao import is_nf4
from lightning_mixedfsdp.model.quantized import dequantized

Region = Tuple[int, int, int, Tensor]
"""(dim, start, stop, value): the full tensor's indices ``start:stop`` along ``dim``."""


def full_regions(tensor: Tensor, region_bytes: int) -> Iterator[Region]:
    """``tensor``'s full value, region by region, each about ``region_bytes`` (at least one row or slice); a 4-bit
    weight is dequantized on each rank first."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        yield from _local_rows(dequantized(tensor), region_bytes)
        return
    if is_nf4(tensor.to_local()):
        tensor = cast(DTensor, dtensor_with_local(tensor, dequantized(tensor.to_local())))
    if tensor.ndim == 0 or tensor.numel() * tensor.element_size() <= region_bytes:
        full = tensor.full_tensor()
        yield 0, 0, full.shape[0] if full.ndim else 1, full
        return
    owners = _row_owners(tensor)
    if owners is not None:
        yield from _broadcast_rows(tensor, owners, region_bytes)
        return
    free = _unsplit_dim(tensor)
    if free is None:
        full = tensor.full_tensor()
        yield 0, 0, full.shape[0], full
        return
    step = max(1, region_bytes // max(1, _bytes_per_index(tensor, free)))
    for start in range(0, tensor.shape[free], step):
        stop = min(start + step, tensor.shape[free])
        part = cast(DTensor, tensor.narrow(free, start, stop - start))  # local on every rank: no collective
        yield free, start, stop, part.full_tensor()


def _local_rows(tensor: Tensor, region_bytes: int) -> Iterator[Region]:
    if tensor.ndim == 0:
        yield 0, 0, 1, tensor
        return
    step = max(1, region_bytes // max(1, _bytes_per_index(tensor, 0)))
    for start in range(0, tensor.shape[0], step):
        stop = min(start + step, tensor.shape[0])
        yield 0, start, stop, tensor[start:stop]


RowOwners = Tuple[Any, List[Tuple[int, int, int]]]
"""The shard group, and for each of its ranks (global source rank, first row, end row)."""


def _row_owners(tensor: Any) -> Optional[RowOwners]:
    """Who holds which rows when the tensor is split on its first dimension over exactly one mesh dim (the rest
    replicated), as ``torch.chunk`` splits: None for any other layout."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    shards = [(d, p) for d, p in enumerate(tensor.placements) if not isinstance(p, Replicate)]
    if len(shards) != 1 or type(shards[0][1]) is not Shard or shards[0][1].dim != 0:
        return None
    mesh_dim = shards[0][0]
    mesh = tensor.device_mesh
    group, size, coordinate = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    rows = tensor.shape[0]
    per_rank = math.ceil(rows / size)
    spans = [(index * per_rank, min((index + 1) * per_rank, rows)) for index in range(size)]
    local = tensor.to_local()
    mine = max(0, spans[coordinate][1] - spans[coordinate][0])
    if local.shape[0] != mine or tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
        return None  # not torch.chunk's layout: gathered another way
    return group, [(dist.get_global_rank(group, i), start, stop) for i, (start, stop) in enumerate(spans)]


def _broadcast_rows(tensor: Any, owners: RowOwners, region_bytes: int) -> Iterator[Region]:
    import torch.distributed as dist

    group, spans = owners
    local = tensor.to_local()
    me = dist.get_rank()
    step = max(1, region_bytes // max(1, _bytes_per_index(tensor, 0)))
    for source, first, end in spans:
        for start in range(first, end, step):
            stop = min(start + step, end)
            if source == me:
                block = local[start - first : stop - first].contiguous()
            else:
                block = torch.empty((stop - start, *tensor.shape[1:]), dtype=local.dtype, device=local.device)
            dist.broadcast(block, src=source, group=group)
            yield 0, start, stop, block


def _unsplit_dim(tensor: Any) -> Optional[int]:
    """The first dimension no placement of ``tensor`` splits (None when every one is)."""
    from torch.distributed.tensor import Shard

    split = {p.dim for p in tensor.placements if isinstance(p, Shard)}
    return next((d for d in range(tensor.ndim) if d not in split), None)


def _bytes_per_index(tensor: Tensor, dim: int) -> int:
    """Bytes of one index of ``dim`` (a row for dim 0)."""
    return math.prod(s for d, s in enumerate(tensor.shape) if d != dim) * tensor.element_size()
