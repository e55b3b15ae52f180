"""Filling a sharded model from full tensors that rank 0 produces one chunk at a time (a wrap unit, or one root-level
module), so no rank ever holds more than one chunk beyond its shards.

Per chunk: rank 0 reports whether it could produce the chunk (an error reaches every rank, so none waits on a
collective), then one broadcast per dtype carries the chunk, cast to the dtypes the sharded model holds, and every
rank keeps its own slice (``distribute_tensor(..., src_data_rank=None)``: any placement, no further communication).
"""

from collections.abc import Mapping
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.compat.torchao import is_nf4
from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.model.quantized import fill_nf4, quantize_part
from lightning_mixedfsdp.model.tensors import local_tensor

Chunk = List[str]
"""Canonical names of the params and buffers that travel together."""


def tensor_targets(model: nn.Module) -> Dict[str, Tensor]:
    """Every param (tied ones once) and buffer of a sharded model, by canonical name: where full values go."""
    targets: Dict[str, Tensor] = {canonical_name(n): p for n, p in model.named_parameters()}
    targets.update({canonical_name(n): b for n, b in model.named_buffers()})
    return targets


def stream_into(
    model: nn.Module,
    chunks: Sequence[Chunk],
    produce: Optional[Iterator[Tuple[Optional[str], Mapping[str, Tensor]]]],
) -> None:
    """Fill ``model``'s tensors chunk by chunk. Rank 0 passes ``produce``, yielding per chunk ``(error, tensors)``
    in the order of ``chunks``; the other ranks pass None. Names missing from the model are skipped (tied copies).

    Rank 0 reads a whole chunk into its broadcast buffers before any rank enters the chunk's broadcasts, so a read
    that fails (an error ``produce`` reports, a file that breaks while read) reaches every rank as the same error
    instead of leaving them in a broadcast."""
    import torch.distributed as dist

    targets = tensor_targets(model)
    for chunk in chunks:
        members = _by_dtype([(name, targets[name]) for name in chunk if name in targets])
        buffers = {
            dtype: torch.empty(sum(t.numel() for _, t in group), dtype=dtype, device=local_tensor(group[0][1]).device)
            for dtype, group in members.items()
        }
        status: List[Optional[str]] = [None]
        if produce is not None:
            try:
                error, tensors = next(produce)
                if error is not None:
                    raise RuntimeError(error)
                _pack(members, buffers, tensors)
            except Exception as failure:
                status = [f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise RuntimeError(status[0])
        with torch.no_grad():
            for dtype, group in members.items():
                dist.broadcast(buffers[dtype], src=0)
                _unpack(group, buffers[dtype])


def _pack(
    members: Dict[torch.dtype, List[Tuple[str, Tensor]]], buffers: Dict[torch.dtype, Tensor], full: Mapping[str, Tensor]
) -> None:
    """Rank 0: the chunk's full tensors into its flat buffers, one dtype each (a lazy mapping reads each tensor here,
    one at a time)."""
    with torch.no_grad():
        for dtype, group in members.items():
            offset = 0
            for name, target in group:
                buffers[dtype][offset : offset + target.numel()].copy_(full[name].reshape(-1))
                offset += target.numel()


def _unpack(group: List[Tuple[str, Tensor]], flat: Tensor) -> None:
    offset = 0
    for _, target in group:
        _fill(target, flat[offset : offset + target.numel()].view(target.shape))
        offset += target.numel()


def _fill(target: Tensor, full: Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        if is_nf4(target.to_local()):  # this rank's rows, quantized with the whole weight's scaler mean
            fill_nf4(target.to_local(), quantize_part(full, local))
        else:
            target.to_local().copy_(local)
    elif is_nf4(target):
        fill_nf4(target, quantize_part(full, full))
    else:
        target.copy_(full)


def _by_dtype(targets: Iterable[Tuple[str, Tensor]]) -> Dict[torch.dtype, List[Tuple[str, Tensor]]]:
    buckets: Dict[torch.dtype, List[Tuple[str, Tensor]]] = {}
    for name, target in targets:
        buckets.setdefault(target.dtype, []).append((name, target))
    return buckets


def produce_each(
    chunks: Sequence[Chunk], read: Callable[[Chunk], Mapping[str, Tensor]]
) -> Iterator[Tuple[Optional[str], Mapping[str, Tensor]]]:
    """``produce`` for a reader that can fetch any chunk on demand (a checkpoint file)."""
    for chunk in chunks:
        yield None, read(chunk)
