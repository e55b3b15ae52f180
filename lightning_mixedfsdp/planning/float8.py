"""Which Linear layers train in float8 (``float8="tensorwise"`` or ``"rowwise"``), each with its reason.

Candidates are the ``nn.Linear`` modules. In order, a layer is left out when:

- ``float8_exclude`` names it;
- a keep-fp32 rule pins its weight, or the weight is frozen (a LoRA base, a frozen tower): float8 casts only pay
  where a weight gradient is computed, and a pinned layer asked for fp32;
- its dims are not divisible by 16 (float8 GEMMs need it), whatever ``float8_include`` says;
- unless ``float8_include`` names it: it is the output head (its logits feed the loss directly), a router or gate
  (a module named ``gate``, ``router`` or ``*_gate``: float8 noise flips top-k choices), or too small to gain
  (torchao's thresholds, measured on H100, with ``float8_skip_small``).

MoE experts under transformers 5 are fused 3-D params, no ``nn.Linear``: they stay in the compute dtype (torchao's
float8 grouped GEMM for MoE is a prototype the library does not apply), and the report says so.
"""

import re
from dataclasses import dataclass
from typing import Collection, Dict, Optional, Sequence, Tuple

from torch import nn

from lightning_mixedfsdp.model.names import ModuleIndex, join_name, output_head

_ROUTER = re.compile(r"(^|_)(gate|router)$")


@dataclass(frozen=True)
class Float8Choice:
    """One Linear layer's float8 decision."""

    converted: bool
    reason: str


def plan_float8(
    model: nn.Module,
    index: ModuleIndex,
    recipe: Optional[str],
    skip_small: bool,
    include: Sequence[str],
    exclude: Sequence[str],
    pinned: Collection[str],
) -> Dict[str, Float8Choice]:
    """Every ``nn.Linear`` module's decision (canonical module name -> choice); empty without a recipe."""
    if recipe is None:
        return {}
    forced_in = [re.compile(p) for p in include]
    forced_out = [re.compile(p) for p in exclude]
    head = output_head(model)
    choices = {}
    for name, module in index.named_modules():
        if isinstance(module, nn.Linear):
            forced = any(p.search(name) for p in forced_in)
            out = _reason_out(name, module, recipe, skip_small, forced, forced_out, head, pinned)
            converted = out is None
            reason = ("float8_include" if forced else "eligible") if converted else out
            choices[name] = Float8Choice(converted, reason or "")
    return choices


def _reason_out(
    name: str,
    module: nn.Linear,
    recipe: str,
    skip_small: bool,
    forced: bool,
    forced_out: Sequence["re.Pattern[str]"],
    head: Optional[nn.Module],
    pinned: Collection[str],
) -> Optional[str]:
    if any(p.search(name) for p in forced_out):
        return "float8_exclude"
    if join_name(name, "weight") in pinned:
        return "keep-fp32"
    if not module.weight.requires_grad:
        return "frozen"
    out_features, in_features = module.weight.shape
    if in_features % 16 or out_features % 16:
        return f"dims {in_features}->{out_features} not divisible by 16"
    if forced:
        return None
    if module is head:
        return "output head"
    if _ROUTER.search(name.rpartition(".")[2]):
        return "router or gate"
    if skip_small and too_small(recipe, in_features, out_features):
        return f"small: {in_features}->{out_features} below the {recipe} threshold (float8_skip_small)"
    return None


def too_small(recipe: str, in_features: int, out_features: int) -> bool:
    """torchao's thresholds (``_auto_filter_for_tensorwise`` / ``_auto_filter_for_rowwise``, torchao 0.18, measured
    on H100): below them the casts to float8 cost more than the faster matmul saves."""
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def fused_experts(index: ModuleIndex) -> Tuple[str, ...]:
    """Modules holding 3-D params (fused MoE experts): no Linear, left in the compute dtype under float8."""
    return tuple(
        name for name, module in index.named_modules() if any(p.dim() == 3 for p in module.parameters(recurse=False))
    )
