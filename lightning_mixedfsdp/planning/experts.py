"""Expert parallelism: each MoE layer's experts split over ``expert_parallel_size`` ranks, tokens moved by all-to-all.

transformers 5.23 ships the parts (``transformers.distributed.expert_parallel``): a wildcard EP plan per MoE model
(``config.base_model_ep_plan``), the ``grouped_gemm`` style that makes the fused 3-D expert params ``Shard(0)``
DTensors on the EP mesh, and the ``ep_dispatch_experts`` style whose ``AllToAllEP`` sends each (token, expert) pair to
the expert's rank and the outputs back. We use them as they are; what is ours is small:

* here, :func:`plan_experts` (pure, for the planner): the concrete plan, the experts modules (each becomes its own
  FSDP unit, sharded over the ranks holding the same experts) and the numbers the report prints;
* in ``apply/experts.py``, ``apply_expert_parallel`` (the ``apply_*`` leaf, after tensor parallelism, before AC /
  compile / FSDP) and ``set_expert_reduction``, the divide factor that makes expert grads the mean over all
  data-parallel ranks, as dense grads are.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from torch import nn

from lightning_mixedfsdp.compat.transformers import (
    EXPERTS_STYLE,
    SPLIT_STYLE,
    model_ep_plan,
    wildcard_name,
)
from lightning_mixedfsdp.model.names import ModuleIndex, is_hf_model, is_within

if TYPE_CHECKING:
    pass

# per MoE layer and step: AllToAllEP exchanges the split sizes (int64, experts x ranks) then the tokens (dispatch) and
# the expert outputs (combine); backward runs the two token all-to-alls in reverse
SPLIT_EXCHANGES_PER_LAYER, TOKEN_ALL_TO_ALLS_PER_LAYER = 1, 2


class ExpertParallelError(ValueError):
    """A model or plan that expert parallelism cannot shard, with the fix."""


@dataclass(frozen=True)
class ExpertPlan:
    """What the planner decides for expert parallelism: which modules, which params, how many experts."""

    size: int
    """``expert_parallel_size``: ranks each MoE layer's experts are split over."""
    plan: Dict[str, str]
    """The concrete plan (canonical names, params before their module) handed to transformers."""
    modules: Tuple[str, ...]
    """The ``ep_dispatch_experts`` modules: one FSDP unit each, on the expert mesh."""
    params: Tuple[str, ...]
    """Params split over the EP ranks (``Shard(0)``: dim 0 is the expert)."""
    num_experts: Dict[str, int]
    """Experts per module, before the split."""

    def all_to_alls_per_step(self, checkpointed: bool = False) -> Dict[str, int]:
        """All-to-alls of one forward+backward: per MoE layer, forward dispatch + combine (and one split-size
        exchange), backward the same two token all-to-alls reversed; a checkpointed layer runs its forward again."""
        layers = len(self.modules)
        forward = layers * (TOKEN_ALL_TO_ALLS_PER_LAYER + SPLIT_EXCHANGES_PER_LAYER)
        backward = layers * TOKEN_ALL_TO_ALLS_PER_LAYER + (forward if checkpointed else 0)
        return {"forward": forward, "backward": backward, "token_forward": layers * TOKEN_ALL_TO_ALLS_PER_LAYER}


def plan_experts(
    model: nn.Module, index: ModuleIndex, size: int, user_plan: Optional[Dict[str, str]] = None
) -> ExpertPlan:
    """The expert plan of ``model`` for ``size`` EP ranks: ``user_plan`` (wildcard names relative to ``model``, in
    transformers' format) or the plan the model (or the HF model inside it) declares. Pure; raises
    :class:`ExpertParallelError` naming the fix."""
    wildcard = dict(user_plan) if user_plan else _declared_plan(index)
    owner = type(model).__name__
    if not wildcard:
        raise ExpertParallelError(
            f"expert_parallel_size={size}: {owner} declares no expert-parallel plan (no transformers"
            " `base_model_ep_plan` on its config). Pass your own as expert_parallel_plan={'<...>.experts':"
            " 'ep_dispatch_experts', '<...>.experts.<param>': 'grouped_gemm'}, or leave expert_parallel_size=1."
        )
    plan = _expand(index, wildcard)
    modules = tuple(name for name, style in plan.items() if style == EXPERTS_STYLE)
    if not modules:
        raise ExpertParallelError(
            f"expert_parallel_size={size}: the expert-parallel plan of {owner} names no module of it with the"
            f" {EXPERTS_STYLE!r} style (plan: {wildcard}). Fix the names (relative to {owner}, `*` for layer"
            " numbers) or leave expert_parallel_size=1."
        )
    params = tuple(name for name, style in plan.items() if style != EXPERTS_STYLE and name not in index.inner)
    stray = [p for p in params if not any(is_within(p, m) for m in modules)]
    num_experts: Dict[str, int] = {}
    problems = [f"{p} is split over the EP ranks but lies in no {EXPERTS_STYLE!r} module" for p in stray]
    for module in modules:
        own = [f"{module}.{n}" for n, _ in index.inner[module].named_parameters()]
        unsplit = [p for p in own if p not in params]
        if unsplit:  # its forward indexes every param by the local expert id
            problems.append(f"{unsplit[0]} lies in {module} but is not split (give it {SPLIT_STYLE!r})")
            continue
        counts = {tuple(_param_shape(index, p))[0] for p in params if is_within(p, module)}
        if len(counts) != 1:
            problems.append(f"{module}: its split params disagree on the number of experts ({sorted(counts)})")
            continue
        num_experts[module] = counts.pop()
        if num_experts[module] % size:
            problems.append(f"{module} holds {num_experts[module]} experts, which {size} ranks cannot split evenly")
    if problems:
        raise ExpertParallelError(
            f"expert_parallel_size={size} cannot shard {owner}: {'; '.join(problems[:3])}. Choose an"
            " expert_parallel_size that divides the number of experts, or fix expert_parallel_plan."
        )
    return ExpertPlan(size, plan, modules, params, num_experts)


def _declared_plan(index: ModuleIndex) -> Dict[str, str]:
    """The plans HF models inside ``model`` declare, prefixed with where they sit (the outermost one that has one)."""
    found: Dict[str, str] = {}
    owners: List[str] = []
    for name, module in index.named_modules():
        if any(is_within(name, o) for o in owners):
            continue
        plan = model_ep_plan(module) if is_hf_model(module) else None
        if plan:
            owners.append(name)
            found.update({f"{name}.{key}" if name else key: style for key, style in plan.items()})
    return found


def _expand(index: ModuleIndex, wildcard: Dict[str, str]) -> Dict[str, str]:
    """transformers' ``_expand_parallel_plan``: per module, its own params that a rule names, then the module."""
    plan: Dict[str, str] = {}
    for name, module in index.named_modules():
        if not name:
            continue
        module_style = wildcard.get(wildcard_name(name))
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{name}.{param_name}"
            # a param's own rule, else its module's (transformers' `.weight`/`.bias` fallback); the experts' dispatch
            # style shards no param
            style = wildcard.get(wildcard_name(full)) or module_style
            if style is not None and style != EXPERTS_STYLE:
                plan[full] = style
        if module_style is not None:
            plan[name] = module_style
    return plan


def _param_shape(index: ModuleIndex, name: str) -> Tuple[int, ...]:
    module, _, attribute = name.rpartition(".")
    return tuple(getattr(index.inner[module], attribute).shape)
