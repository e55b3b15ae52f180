"""``lightning_mixedfsdp.stream_weights``: a set-up model's weights for an inference engine, from the strategy that
set it up (Fabric's module or the Trainer's LightningModule), in buckets (``checkpoint/weight_stream.py``)."""

from typing import Any, Iterator, Optional

import torch
from torch import nn

from lightning_mixedfsdp.checkpoint.weight_stream import DEFAULT_BUCKET_BYTES, Bucket, stream_buckets
from lightning_mixedfsdp.strategies.lightning_compat import fabric_module_strategy


def stream_weights(
    model: nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Optional[torch.dtype] = None,
    to_rank: int = 0,
    adapters_only: bool = False,
    checkpoint_names: bool = True,
) -> Iterator[Bucket]:
    """Yield ``model``'s weights in buckets, each a list of ``(hf_name, tensor)`` of at most ``bucket_bytes`` (a
    larger tensor alone), whole tensors on ``to_rank`` and empty buckets elsewhere: what vLLM's and SGLang's
    ``load_weights`` take. Collective: every rank iterates it to the end. ``model`` is what ``fabric.setup``
    returned, or a LightningModule the Trainer set up. ``dtype`` None sends each
    tensor as stored; a dtype casts the bulk, and the plan's keep-fp32 tensors stay fp32. Tied weights go once;
    LoRA is merged into its base weights (``adapters_only=True``: the adapters alone, under peft's names). Names are
    the HF checkpoint's (``checkpoint_names=True``: what ``save_pretrained`` writes, an MoE's fused experts split per
    expert, as serving engines load them), or the model's own. Each bucket is a new list, never emptied by the
    stream (``list(stream_weights(model))`` keeps them all); a loop that drops each bucket once loaded (``del
    bucket``) holds one bucket on ``to_rank``, a plain ``for`` loop the last one too while the next is assembled."""
    strategy = _strategy_of(model)
    if strategy.pipelined:
        raise NotImplementedError(
            f"stream_weights: {type(strategy).__name__} runs pipeline parallelism, and each stage holds its own layers:"
            " streaming across stages is not supported yet; export with strategy.export_safetensors instead"
        )
    keep_fp32 = set(strategy.plan_of(model).fp32_names)
    return stream_buckets(model, keep_fp32, bucket_bytes, dtype, to_rank, adapters_only, checkpoint_names)


def _strategy_of(model: nn.Module) -> Any:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.strategies.mixin import MixedFSDP2Mixin

    strategy = fabric_module_strategy(model)
    if strategy is None and isinstance(model, pl.LightningModule):
        try:
            strategy = model.trainer.strategy
        except RuntimeError:  # "not attached to a Trainer"
            strategy = None
    if not isinstance(strategy, MixedFSDP2Mixin):
        raise TypeError(
            f"stream_weights: {type(model).__name__} was not set up by the mixed_fsdp2 strategy; pass what"
            " fabric.setup(model) returned (or the LightningModule a Trainer with strategy='mixed_fsdp2' trains)"
        )
    return strategy
