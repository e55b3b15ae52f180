"""The 4-bit frozen base (QLoRA): torchao's NF4 weights, which shapes can hold them, their bytes, and quantizing one
rank's rows so that every rank's shard equals the whole tensor's quantization, chunked.

NF4 packs two weights per byte in blocks of 64, each block with an int8 scaler, and every 256 scalers with one
quantization factor in the weight's dtype (torchao's and QLoRA's double quantization). FSDP2 all-gathers the three
parts of every shard (torchao implements its all-gather extension) and rebuilds the whole weight with the scaler
mean of the local shard, so that mean must be the whole tensor's on every rank: a rank that quantizes only its rows
learns it by one all-reduce of block maxima.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.torchao import (
    NF4_BLOCK,
    NF4_SCALER_BLOCK,
    block_absmax,
    dequantize,
    is_nf4,
    nf4_with_scaler_mean,
)

NF4 = "nf4"
_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
_WEIGHTS_PER_FACTOR = NF4_BLOCK * NF4_SCALER_BLOCK


def nf4_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of an NF4 weight of ``numel`` weights in nominal ``dtype``: half a byte per weight, one int8 scaler per
    64 weights, one factor in ``dtype`` per 16,384 (about 0.26x of bf16)."""
    return numel // 2 + numel // NF4_BLOCK + (numel // _WEIGHTS_PER_FACTOR) * dtype.itemsize


def nf4_unfit(shape: Sequence[int], shards: int) -> Optional[str]:
    """Why a weight of ``shape`` sharded by rows over ``shards`` ranks cannot be NF4; None when it can. Each shard
    must hold whole double-quantization blocks (16,384 weights), so every rank's scalers and factors are its own."""
    if len(shape) != 2:
        return f"{len(shape)}-D, NF4 holds 2-D weights"
    rows, columns = shape
    if rows % shards:
        return f"{rows} rows do not split evenly over {shards} shard ranks"
    if (rows // shards * columns) % _WEIGHTS_PER_FACTOR:
        return (
            f"a shard of {rows // shards}x{columns} weights is not a multiple of {_WEIGHTS_PER_FACTOR} (NF4's"
            f" {NF4_BLOCK}-weight blocks x {NF4_SCALER_BLOCK} scalers)"
        )
    return None


def scaler_mean(full: Tensor) -> Tensor:
    """The scaler mean of the whole tensor, as torchao computes it (in the tensor's dtype)."""
    return block_absmax(full.reshape(-1)).mean()


def quantize_rows(rows: Sequence[Tensor], group: Optional[object] = None) -> List[Tensor]:
    """NF4 of each rank's ``rows`` of several weights, each with the scaler mean of the whole weight: one all-reduce
    over ``group`` (the ranks that hold the other rows) for all of them. Equal to quantizing every whole weight and
    keeping this rank's chunk (up to the mean's last bit, summed in fp32 here)."""
    import torch.distributed as dist

    if not rows:
        return []
    maxima = [block_absmax(r.reshape(-1)) for r in rows]
    sums = torch.stack([m.float().sum() for m in maxima] + [torch.tensor(float(m.numel())) for m in maxima])
    sums = sums.to(rows[0].device)
    dist.all_reduce(sums, group=group)
    count = len(rows)
    means = [(sums[i] / sums[count + i]).to(r.dtype) for i, r in enumerate(rows)]
    return [nf4_with_scaler_mean(r, mean) for r, mean in zip(rows, means, strict=True)]


def quantize_part(full: Tensor, part: Tensor) -> Tensor:
    """NF4 of ``part`` (this rank's rows of ``full``) with the whole tensor's scaler mean: no communication."""
    return nf4_with_scaler_mean(part, scaler_mean(full))


@torch.no_grad()
def fill_nf4(target: Tensor, quantized: Tensor) -> None:
    """Write ``quantized`` into the NF4 shard ``target`` in place, part by part: every view of a shard (FSDP2 keeps
    several) shares these tensors."""
    for name in _PARTS:
        getattr(target, name).copy_(getattr(quantized, name))


def dequantized(tensor: Tensor) -> Tensor:
    """A weight in its nominal dtype: NF4 dequantized, any other tensor as it is."""
    return dequantize(tensor) if is_nf4(tensor) else tensor


def nf4_parts(tensor: Tensor) -> Tuple[Tensor, ...]:
    """The stored parts of an NF4 weight (data, scalers, factors, mean): what its bytes are."""
    return tuple(getattr(tensor, name) for name in _PARTS)
