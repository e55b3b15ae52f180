"""The frozen base's fingerprint: a checkpoint leaves the 4-bit base out (it comes from its own source each time the
model is set up), so it records a digest of every frozen tensor, and a resume compares them: a base built from config
instead of the pretrained weights is caught before a step trains on it.

A digest does not depend on how the tensor is sharded (a resume on another world size matches): each rank hashes its
own elements, every element with its index in the full tensor, and the sums of the hashes are added over the ranks
that split the tensor (one all-reduce per shard group for all tensors). A 4-bit weight is hashed by its dequantized
values. Two independent 31-bit sums make a 62-bit digest.
"""

import math
from typing import Any, Dict, List, Mapping, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.model.quantized import dequantized

FINGERPRINT_KEY = "mixed_fsdp2_frozen_base"
"""The checkpoint entry holding the frozen tensors' digests."""

_MODULUS = 2**31 - 1
_MULTIPLIERS = ((1_103_515_245, 40_692, 2_147_483_629), (1_664_525, 48_271, 2_147_483_587))


def frozen_fingerprints(module: nn.Module) -> Dict[str, str]:
    """Every frozen param of ``module`` (``requires_grad=False``) by canonical name -> its digest; every rank calls it
    and gets the same digests."""
    import torch.distributed as dist

    frozen = [(canonical_name(name), param) for name, param in module.named_parameters() if not param.requires_grad]
    by_group: Dict[Any, List[Tuple[str, Tensor]]] = {}
    for name, param in frozen:
        group, sums = _partial_sums(param.detach())
        by_group.setdefault(group, []).append((name, sums))
    digests: Dict[str, str] = {}
    for group, entries in by_group.items():
        sums = torch.stack([s for _, s in entries]) if entries else torch.zeros(0, 2, dtype=torch.int64)
        if group is not None and dist.is_initialized():
            sums = sums.to(_collective_device(group))
            dist.all_reduce(sums, group=group)
        sums = sums.cpu() % _MODULUS
        for (name, _), pair in zip(entries, sums.tolist(), strict=True):
            digests[name] = f"{pair[0]:08x}{pair[1]:08x}"
    return dict(sorted(digests.items()))


def fingerprint_differences(saved: Mapping[str, str], current: Mapping[str, str]) -> List[str]:
    """The frozen tensors whose digests differ, or that one side lacks, each described."""
    differing = sorted(name for name in set(saved) & set(current) if saved[name] != current[name])
    only_saved = sorted(set(saved) - set(current))
    only_current = sorted(set(current) - set(saved))
    problems = []
    if differing:
        problems.append(f"{len(differing)} of {len(saved)} frozen tensors differ: {_listed(differing)}")
    if only_saved:
        problems.append(f"frozen in the checkpoint's run but not now: {_listed(only_saved)}")
    if only_current:
        problems.append(f"frozen now but not in the checkpoint's run: {_listed(only_current)}")
    return problems


def _listed(names: List[str]) -> str:
    return f"{names[:4]}{' and more' if len(names) > 4 else ''}"


def _partial_sums(param: Tensor) -> Tuple[Any, Tensor]:
    """(the group the sums add over, or None; this rank's two hash sums of its elements)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None, _hash_sums(dequantized(param), 0)
    local = dequantized(param.to_local())
    shards = [(d, p) for d, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if not shards:
        return None, _hash_sums(local, 0)
    mesh_dim, placement = shards[0]
    mesh = param.device_mesh
    rows, size = param.shape[0], mesh.size(mesh_dim)
    per_rank = math.ceil(rows / size)
    first = mesh.get_local_rank(mesh_dim) * per_rank
    if (
        len(shards) == 1
        and type(placement) is Shard
        and placement.dim == 0
        and local.shape[0] == max(0, min(first + per_rank, rows) - first)
    ):
        return mesh.get_group(mesh_dim), _hash_sums(local, first * math.prod(param.shape[1:]))
    # another layout (tensor or expert parallelism): hash the full value, gathered in rows
    return None, _hash_sums(param.full_tensor(), 0)


def _hash_sums(values: Tensor, first_index: int) -> Tensor:
    """Two sums, each of a hash of every element's bits with its flat index in the full tensor (from
    ``first_index``), modulo a 31-bit prime: int64 arithmetic that never overflows."""
    flat = values.detach().reshape(-1)
    bits = _bits(flat)
    index = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) + first_index
    sums = []
    for value_factor, index_factor, mix in _MULTIPLIERS:
        h = ((bits * value_factor) % _MODULUS + ((index % _MODULUS) * index_factor) % _MODULUS) % _MODULUS
        h = ((h ^ (h >> 13)) * mix) % _MODULUS
        sums.append(h.sum() % _MODULUS)
    return torch.stack(sums).to(torch.int64).cpu()


def _bits(flat: Tensor) -> Tensor:
    """The elements' bit patterns as non-negative int64 (below 2**32)."""
    if flat.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        raw = flat.contiguous().view(width).to(torch.int64)
    else:
        raw = flat.to(torch.int64)
    if flat.element_size() == 8:
        raw = raw ^ (raw >> 32)
    return raw & 0xFFFFFFFF if flat.element_size() >= 4 else raw & ((1 << (8 * flat.element_size())) - 1)


def _collective_device(group: Any) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the CPU for gloo, the current GPU for NCCL."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    return (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend and "gloo" not in backend
        else torch.device("cpu")
    )
