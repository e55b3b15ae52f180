"""A sharded model's weights streamed whole to one rank in buckets, for an inference engine (vLLM's and SGLang's
``load_weights`` take ``(name, tensor)`` iterables) or a generator rank.

Every rank walks the same tensors in the same order (each region of a tensor may be a collective, ``gather.py``);
``to_rank`` assembles each tensor whole in its target dtype, region by region, into the bucket, and a bucket is
handed out when the next tensor would not fit in ``bucket_bytes`` (a tensor larger than the bucket travels alone).
The other ranks hold one region at a time and get empty buckets, the same number. Each bucket is a list of its own
(``list(stream)`` keeps every bucket); the stream keeps no reference to a bucket it handed out. So ``to_rank`` holds
the bucket being assembled and one region beyond its shards, plus whatever buckets the caller still names (a plain
``for bucket in ...`` names the last one while the next is assembled: ``del bucket`` once it is loaded to hold one),
every other rank one region: no whole model is ever gathered (trl #7131's 64 GiB on rank 0), and no unit is
unsharded around another group's sends.

Names are the HF checkpoint's (``checkpoint_names``, the default: what ``save_pretrained`` writes, an MoE's fused
experts split per expert as serving engines load them) or the model's own (canonical: Fabric's and FSDP's wrappers,
activation checkpointing and ``torch.compile`` left out); tied weights are sent once (the first name the state dict
holds); root-owned params (the final norm, the head) are sent like the others; a PEFT model's LoRA layers are merged
into their base weights on the fly (``export.py``'s merge), or with ``adapters_only`` only its adapter tensors are
sent, under peft's names."""

from typing import Callable, Collection, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.export import PendingTensor, export_tensors, merged_peft_tensors
from lightning_mixedfsdp.compat.transformers import checkpoint_tensors
from lightning_mixedfsdp.model.names import (
    canonical_name,
    is_hf_model,
    is_peft_model,
    peft_base_name,
    unwrap_model,
    user_class,
)

Bucket = List[Tuple[str, Tensor]]
DEFAULT_BUCKET_BYTES = 64 * 2**20


def target_dtype(
    name: str, stored: torch.dtype, dtype: Optional[torch.dtype], keep_fp32: Collection[str]
) -> torch.dtype:
    """What ``name`` is sent in: its stored dtype without ``dtype``; with one, ``dtype`` for the floating bulk, fp32
    for the tensors the plan keeps in fp32, integers as stored."""
    if dtype is None or not stored.is_floating_point:
        return stored
    return torch.float32 if name in keep_fp32 else dtype


def streamed_tensors(model: nn.Module, adapters_only: bool) -> Tuple[List[PendingTensor], bool]:
    """The tensors to send, each once (a tied weight under the first name the state dict holds), and whether they
    carry peft's base names (merged)."""
    model = unwrap_model(model)
    tied_copies, seen = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied_copies.add(canonical_name(name))
        seen.add(id(tensor))
    tensors = [pending for pending in export_tensors(model) if pending.name not in tied_copies]
    if is_peft_model(model) and adapters_only:
        return [pending for pending in tensors if "lora_" in pending.name], False
    if is_peft_model(model):
        return merged_peft_tensors(model, tensors), True
    return tensors, False


def stream_buckets(
    model: nn.Module,
    keep_fp32: Collection[str],
    bucket_bytes: int,
    dtype: Optional[torch.dtype] = None,
    to_rank: int = 0,
    adapters_only: bool = False,
    checkpoint_names: bool = True,
) -> Iterator[Bucket]:
    """The weights of ``model`` (every rank iterates; see the module's docstring) in buckets of at most
    ``bucket_bytes``; ``keep_fp32``: the names the plan keeps in fp32 (under the model's own names);
    ``checkpoint_names``: under the checkpoint's names (else the model's own)."""
    import torch.distributed as dist

    if bucket_bytes < 1:
        raise ValueError(f"stream_weights: bucket_bytes={bucket_bytes} must be positive (e.g. 64 * 2**20)")
    receiving = dist.get_rank() == to_rank
    tensors, merged = streamed_tensors(model, adapters_only)
    convert = _checkpoint_conversion(model, merged) if checkpoint_names and not adapters_only else None
    if merged:
        keep_fp32 = {base for base in (peft_base_name(n) for n in keep_fp32) if base is not None}
    region_bytes = max(1, bucket_bytes // 2)
    bucket: Bucket = []
    filled = 0
    for pending in tensors:
        dtype_sent = target_dtype(pending.name, pending.dtype, dtype, keep_fp32)
        size = int(torch.Size(pending.shape).numel()) * dtype_sent.itemsize
        if filled and filled + size > bucket_bytes:
            yield bucket
            bucket, filled = [], 0  # a new list: the caller may keep the one it was handed
        whole = _assembled(pending, dtype_sent, region_bytes, receiving)
        if whole is not None:
            bucket += convert(pending.name, whole).items() if convert is not None else [(pending.name, whole)]
        filled += size
    if filled:
        yield bucket


def _checkpoint_conversion(model: nn.Module, merged: bool) -> Optional[Callable[[str, Tensor], Dict[str, Tensor]]]:
    """An HF model's conversion of a whole tensor to the checkpoint's tensors (``merged``: a PEFT model's tensors
    under its base model's names, so the base model's class converts), or None."""
    inner = unwrap_model(model)
    base = inner.get_base_model() if merged else inner  # type: ignore[operator]
    if not is_hf_model(base):
        return None
    return checkpoint_tensors(user_class(base), base.config)


def _assembled(pending: PendingTensor, dtype: torch.dtype, region_bytes: int, receiving: bool) -> Optional[Tensor]:
    """The tensor whole in ``dtype`` on the receiving rank (None elsewhere), from its regions: every rank takes part
    in each region's collective, only the receiver keeps it."""
    whole: Optional[Tensor] = None
    for dim, start, stop, value in pending.regions(region_bytes):
        if not receiving:
            continue
        if whole is None:
            whole = torch.empty(pending.shape, dtype=dtype, device=value.device)
        if whole.ndim == 0:
            whole.copy_(value.reshape(()))
        else:
            whole.narrow(dim, start, stop - start).copy_(value)
    return whole
