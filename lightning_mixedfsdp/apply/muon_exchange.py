"""Newton-Schulz over whole matrices whose rows are sharded: each matrix brought whole to one owner rank of its shard
group, orthogonalised there once, its rows sent back.

``torch.optim.Muon`` orthogonalises each 2-D update over the whole matrix. Under FSDP2 each rank holds only its rows
(``Shard(0)``), and the same function run on those rows computes another update. :func:`orthogonalise` takes every
Muon matrix's local rows of its update and returns each rank's rows of the whole matrix's orthogonalisation, computed
by torch's own function (:func:`~lightning_mixedfsdp.compat.torch.muon_orthogonalise`):

- matrices are bucketed by (shard group, update dtype): one ``all_to_all_single`` brings each bucket's rows to their
  owners, one more sends the results back (uneven and empty shards included: FSDP2's rows are ``torch.chunk``'s);
- owners are chosen greedily by Newton-Schulz cost, the same on every rank (the matrices arrive in the same order);
- replicas of a shard group (HSDP's replicate dim) each run their group's exchange: no traffic crosses the replicate
  dim, which is the slow link HSDP puts there;
- a matrix held whole (a plain tensor, or a DTensor replicated or split over one rank) is orthogonalised where it is.

Any other layout (rows and columns split, tensor parallelism) is refused by :func:`layout_problem` before a step."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.torch import muon_orthogonalise

NewtonSchulz = Tuple[Tuple[float, float, float], int, float]
"""``(ns_coefficients, ns_steps, eps)`` of a matrix's param group."""


@dataclass(frozen=True)
class MatrixUpdate:
    """One Muon param's update to orthogonalise: its param (for its layout), its local rows and its group's
    Newton-Schulz settings."""

    param: Tensor
    rows: Tensor
    newton_schulz: NewtonSchulz


def layout_problem(param: Tensor) -> Optional[str]:
    """Why ``param``'s layout cannot be orthogonalised whole here, or None: a plain tensor, a DTensor replicated, or
    split along its rows over one mesh dim (FSDP2's ``Shard(0)``) are fine."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    split = [(dim, p) for dim, p in enumerate(param.placements) if not isinstance(p, Replicate) and mesh.size(dim) > 1]
    if not split:
        return None
    if len(split) == 1 and isinstance(split[0][1], Shard) and split[0][1].dim == 0:
        return None
    return f"its layout {tuple(param.placements)} over mesh dims {mesh.mesh_dim_names} splits more than its rows"


def orthogonalise(updates: Sequence[MatrixUpdate]) -> List[Tensor]:
    """Each update's local rows of the orthogonalisation of its whole matrix, in the order given."""
    results: List[Optional[Tensor]] = [None] * len(updates)
    buckets: Dict[Tuple[object, torch.dtype], List[int]] = {}
    for index, update in enumerate(updates):
        group = _shard_group(update.param)
        if group is None:
            results[index] = muon_orthogonalise(update.rows, *update.newton_schulz)
        else:
            buckets.setdefault((group, update.rows.dtype), []).append(index)
    for (group, _dtype), indices in buckets.items():
        for index, rows in zip(indices, _exchange(group, [updates[i] for i in indices]), strict=True):
            results[index] = rows
    return [r for r in results if r is not None]


def _shard_group(param: Tensor) -> Optional[object]:
    """The process group of the mesh dim that splits ``param``'s rows, or None when it is held whole."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and mesh.size(dim) > 1:
            return mesh.get_group(dim)
    return None


def row_counts(rows: int, ranks: int) -> List[int]:
    """The rows each of ``ranks`` holds of a ``rows``-row matrix split as ``torch.chunk`` splits it (FSDP2's
    ``Shard(0)``): ceil(rows / ranks) each, the tail short or empty."""
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(ranks)]


def owners(shapes: Sequence[Tuple[int, int]], ranks: int) -> List[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the rank with the least Newton-Schulz work
    so far (about rows x cols x min(rows, cols) per iteration), ties to the lowest rank; the same on every rank."""
    load = [0] * ranks
    owner = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += _cost(shapes[index])
    return owner


def _cost(shape: Tuple[int, int]) -> int:
    return shape[0] * shape[1] * min(shape)


def _exchange(group: object, updates: Sequence[MatrixUpdate]) -> List[Tensor]:
    """The bucket's matrices to their owners in one all-to-all, orthogonalised there, their rows back in another."""
    import torch.distributed as dist

    ranks, me = dist.get_world_size(group), dist.get_rank(group)  # type: ignore[arg-type]
    shapes = [(int(u.param.shape[0]), int(u.param.shape[1])) for u in updates]
    counts = [row_counts(rows, ranks) for rows, _ in shapes]
    for update, shape, count in zip(updates, shapes, counts, strict=True):
        if tuple(update.rows.shape) != (count[me], shape[1]):
            raise RuntimeError(
                f"a {shape} Muon param's rows on rank {me} of its shard group are {tuple(update.rows.shape)}, not the"
                f" {(count[me], shape[1])} that FSDP2's even split gives; its update cannot be assembled whole"
            )
    owner = owners(shapes, ranks)
    by_owner = [[i for i in range(len(updates)) if owner[i] == rank] for rank in range(ranks)]
    mine = by_owner[me]

    # rows to their owners: to each rank, my rows of the matrices it owns; from each rank, its rows of mine
    outgoing = [updates[i].rows.reshape(-1) for rank in range(ranks) for i in by_owner[rank]]
    sent = torch.cat(outgoing or [_empty(updates)])
    send_sizes = [sum(counts[i][me] * shapes[i][1] for i in by_owner[rank]) for rank in range(ranks)]
    receive_sizes = [sum(counts[i][rank] * shapes[i][1] for i in mine) for rank in range(ranks)]
    received = sent.new_empty(sum(receive_sizes))
    dist.all_to_all_single(received, sent, receive_sizes, send_sizes, group=group)
    pieces = _split(received, receive_sizes)
    whole: List[Tensor] = []
    for i in mine:
        parts = [_take(pieces, rank, counts[i][rank] * shapes[i][1]) for rank in range(ranks)]
        whole.append(muon_orthogonalise(torch.cat(parts).view(shapes[i]), *updates[i].newton_schulz))

    # the results' rows back: to each rank, its rows of my matrices; from each owner, my rows of its matrices
    result_dtype = _result_dtype(updates[0])
    back = [w.to(result_dtype) for w in whole]
    returned = torch.cat(
        [
            back[k][sum(counts[i][:rank]) : sum(counts[i][: rank + 1])].reshape(-1)
            for rank in range(ranks)
            for k, i in enumerate(mine)
        ]
        or [sent.new_empty(0, dtype=result_dtype)]
    )
    return_sizes = [sum(counts[i][rank] * shapes[i][1] for i in mine) for rank in range(ranks)]
    arrive_sizes = [sum(counts[i][me] * shapes[i][1] for i in by_owner[rank]) for rank in range(ranks)]
    arrived = returned.new_empty(sum(arrive_sizes))
    dist.all_to_all_single(arrived, returned, arrive_sizes, return_sizes, group=group)
    chunks = _split(arrived, arrive_sizes)
    results: List[Optional[Tensor]] = [None] * len(updates)
    for rank in range(ranks):
        for i in by_owner[rank]:
            results[i] = _take(chunks, rank, counts[i][me] * shapes[i][1]).view(counts[i][me], shapes[i][1])
    return [r for r in results if r is not None]


def _empty(updates: Sequence[MatrixUpdate]) -> Tensor:
    return updates[0].rows.new_empty(0)


def _result_dtype(update: MatrixUpdate) -> torch.dtype:
    """The dtype torch's orthogonalisation returns for this bucket's dtype (bf16 on 2.11 to 2.15), asked of a 1 x 1
    matrix, so a rank that owns nothing in the bucket agrees with the owners."""
    probe = update.rows.new_ones(1, 1)
    return muon_orthogonalise(probe, *update.newton_schulz).dtype


def _split(flat: Tensor, sizes: Sequence[int]) -> List[List[Tensor]]:
    """``flat`` cut into each rank's segment, each a one-element list holding what is left to take of it."""
    return [[part] for part in torch.split(flat, list(sizes))]


def _take(pieces: List[List[Tensor]], rank: int, size: int) -> Tensor:
    """The next ``size`` elements of ``rank``'s segment."""
    segment = pieces[rank][0]
    pieces[rank][0] = segment[size:]
    return segment[:size]
