"""Which frozen base weights the plan stores in 4 bits (``quantize_base``), and why the others are not.

Candidates are the weights of frozen ``nn.Linear`` modules: a peft LoRA model's base layers (peft keeps the
original ``nn.Linear`` as ``base_layer``), a frozen tower's projections. Left in their dtype, each with its reason:

- a keep-fp32 rule pins it (a router gate, an HF ``_keep_in_fp32_modules`` entry);
- it is no floating-point weight (quantized already, e.g. by bitsandbytes);
- the output head, and any weight tied to another (the embedding): QLoRA leaves ``lm_head`` unquantized too, and a
  tied weight is also an embedding table, which NF4 cannot index;
- experts under expert parallelism (fused 3-D expert weights are no ``nn.Linear`` and are never candidates);
- replicated params (small or inseparable: 4 bits would save little and they are not sharded);
- a shape whose rows per shard do not fill whole double-quantization blocks (``model/quantized.py``).
"""

from typing import Collection, Dict, List, Optional, Tuple

from torch import nn

from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name, is_within, join_name, output_head
from lightning_mixedfsdp.model.quantized import nf4_unfit


def plan_quantization(
    model: nn.Module,
    index: ModuleIndex,
    quantize_base: Optional[str],
    shard_ranks: int,
    pinned: Collection[str],
    replicated: Collection[str],
    expert_modules: Collection[str],
) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(param -> format for each weight to quantize, param -> reason for each candidate left as it is)."""
    if quantize_base is None:
        return {}, {}
    chosen: Dict[str, str] = {}
    reasons: Dict[str, str] = {}
    head = output_head(model)
    tied = _tied_params(model)
    for module_name, module in index.named_modules():
        if not isinstance(module, nn.Linear) or module.weight.requires_grad:
            continue
        name = join_name(module_name, "weight")
        reason = _reason_left(name, module, head, tied, pinned, replicated, expert_modules, shard_ranks)
        if reason is None:
            chosen[name] = quantize_base
        else:
            reasons[name] = reason
    return chosen, reasons


def _reason_left(
    name: str,
    module: nn.Linear,
    head: Optional[nn.Module],
    tied: Collection[str],
    pinned: Collection[str],
    replicated: Collection[str],
    expert_modules: Collection[str],
    shard_ranks: int,
) -> Optional[str]:
    if name in pinned:
        return "keep-fp32"
    if not module.weight.is_floating_point():
        return f"stored as {module.weight.dtype} already (quantized by another library?)"
    if module is head:
        return "output head"
    if name in tied:
        return "tied to another param"
    if any(is_within(name, experts) for experts in expert_modules):
        return "expert-parallel experts"
    if name in replicated:
        return "replicated"
    unfit = nf4_unfit(tuple(module.weight.shape), shard_ranks)
    return f"shape: {unfit}" if unfit else None


def _tied_params(model: nn.Module) -> Collection[str]:
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(canonical_name(name))
    return {name for aliases in names.values() if len(aliases) > 1 for name in aliases}
