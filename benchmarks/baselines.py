"""What projects hand-write today, as baselines for the benchmarks (and the collective-count test)."""

from typing import Any

import torch
from torch import nn

from lightning_mixedfsdp.recipes.models.tiny_llama import RMSNorm, TinyLlama


def shard_uniform(model: TinyLlama, mesh: Any, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> nn.Module:
    """One fully_shard per block and the root, one policy for everything: needs a uniform-dtype model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def shard_each_norm_separately(model: TinyLlama, mesh: Any, compute: torch.dtype = torch.bfloat16) -> nn.Module:
    """One fully_shard per fp32 norm with an fp32 policy (output cast to the compute dtype), then each block, then
    the root: the per-norm approach most projects use today. Expects fp32 norms and a ``compute``-dtype bulk."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    norm_policy = MixedPrecisionPolicy(torch.float32, torch.float32, output_dtype=compute)
    bulk_policy = MixedPrecisionPolicy(compute, compute)
    for block in model.layers:
        for module in block.modules():
            if isinstance(module, RMSNorm):
                fully_shard(module, mesh=mesh, mp_policy=norm_policy)
        fully_shard(block, mesh=mesh, mp_policy=bulk_policy)
    fully_shard(model.norm, mesh=mesh, mp_policy=norm_policy)
    return fully_shard(model, mesh=mesh, mp_policy=bulk_policy)
