"""Every transformers API the library's expert parallelism uses, each behind one small function.

Checked on transformers 5.23 (``transformers/distributed/expert_parallel.py``, ``parallel_utils.py``, ``mixin.py``).
transformers is optional: these import it only when called.
"""

import re
from typing import Any, Dict, Optional

from torch import nn

EXPERTS_STYLE = "ep_dispatch_experts"
"""The EP style of a module whose experts are reached by all-to-all (5.23); its params carry ``grouped_gemm``."""
SPLIT_STYLE = "grouped_gemm"
"""The EP style of a fused expert param: ``Shard(0)`` over the EP ranks."""


def model_ep_plan(module: nn.Module) -> Optional[Dict[str, str]]:
    """The wildcard EP plan an HF ``PreTrainedModel`` declares (``PreTrainedModel.ep_plan``:
    ``config.base_model_ep_plan`` prefixed with the base model's name, e.g.
    ``{"model.layers.*.mlp.experts": "ep_dispatch_experts", ...}``); None when it declares none. Ask it of
    ``PreTrainedModel``s only: a peft wrapper forwards ``ep_plan`` to the model inside, whose names it is relative
    to."""
    plan = getattr(module, "ep_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan else None


def wildcard_name(name: str) -> str:
    """``layers.3.mlp.experts`` -> ``layers.*.mlp.experts``, as transformers matches plan keys
    (``parallel_utils.replace_layer_number_by_wildcard``, copied: three lines, and it keeps the planner importable
    without transformers)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def apply_expert_parallelism(model: nn.Module, plan: Dict[str, str], ep_mesh: Any, tp_mesh: Any) -> None:
    """transformers' own EP: ``grouped_gemm`` params become ``Shard(0)`` DTensors on ``ep_mesh`` (each rank keeps
    ``num_experts / E`` experts), ``ep_dispatch_experts`` modules get a forward that all-to-alls the tokens to the
    ranks holding their experts and back (``AllToAllEP``). ``plan`` is concrete (no wildcards), params before their
    module, names relative to ``model``."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism as apply

    apply(model, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")


def all_to_all_module() -> Any:
    """The module whose ``all_to_all_single`` (split sizes) and ``all_to_all_single_autograd`` (tokens) the
    all-to-all EP calls at call time: patch them there to count."""
    import transformers.distributed.expert_parallel as module

    return module
