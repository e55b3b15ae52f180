"""The planner: model + config -> ShardPlan (``types.py``). Pure: reads the model, never changes it, issues no
collectives.

It decides, once, every param's storage/compute/reduce dtype and FSDP group (group forming: ``groups.py``), and every
floating buffer's dtype (``buffers.py``), the 4-bit base (``quantization.py``), the float8 layers (``float8.py``) and
the expert plan (``experts.py``). Names are canonical (``model/names.py``), so the plan fits the model before and
after wrappers are applied.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_mixedfsdp.compat.torch import non_persistent_buffer_names
from lightning_mixedfsdp.config import (
    DEFAULT_KEEP_FP32_MODULES,
    DEFAULT_KEEP_FP32_PARAMS,
    DEFAULT_NORM_RULES,
    BulkDtypes,
    Float8,
    MixedFSDPConfig,
)
from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name
from lightning_mixedfsdp.planning.buffers import plan_buffers
from lightning_mixedfsdp.planning.conditional import find_conditional_modules, without_conditional_units
from lightning_mixedfsdp.planning.experts import ExpertPlan, plan_experts
from lightning_mixedfsdp.planning.float8 import fused_experts, plan_float8
from lightning_mixedfsdp.planning.fp32_compute import plan_fp32_compute
from lightning_mixedfsdp.planning.groups import (
    effective_key,
    find_wrap_units,
    inside,
    mark_expert_groups,
    one_group_per_unit,
    plan_groups,
)
from lightning_mixedfsdp.planning.matching import (
    KeepFp32Matches,
    KeepFp32Rules,
    KeepRule,
    RuleKind,
    find_frozen_modules,
    match_keep_fp32,
)
from lightning_mixedfsdp.planning.options import PlanOptions
from lightning_mixedfsdp.planning.quantization import plan_quantization
from lightning_mixedfsdp.planning.types import DtypeKey, ParamPlan, ShardGroup, ShardPlan


def plan_sharding(
    model: nn.Module, config: MixedFSDPConfig, precision: Union[str, BulkDtypes] = "32-true", shard_ranks: int = 1
) -> ShardPlan:
    """Every param's and buffer's dtype and every param's FSDP group for ``model``, under a Lightning precision flag
    (or bulk dtypes already resolved by :meth:`MixedFSDPConfig.bulk_dtypes`), with params sharded over
    ``shard_ranks``."""
    config.validate()
    bulk = config.bulk_dtypes(precision) if isinstance(precision, str) else precision
    return plan_validated(model, config, bulk, shard_ranks)


def fsdp_groups_can_mix_dtypes() -> bool:
    """The switch point for native mixed-dtype FSDP2: whether one ``fully_shard`` call of the installed torch takes
    params of different original (storage) dtypes, each all-gathered, computed and reduced in its own dtypes.

    No release does, so this answers no on every version: torch 2.11 to 2.15 assert one original dtype per group at
    lazy init (``FSDPParamGroup._init_mp_dtypes``). pytorch#156784 tracks the feature; the per-param
    ``MixedPrecisionPolicy`` work (#196626, #194546) varies only the compute dtype, the storage dtype stays uniform.
    When a release ships it, this answers from that capability, and the planner then makes each unit one group
    (:func:`plan_model`'s ``mixed_dtype_groups``): fewer collectives, the same dtype for every tensor, the same
    checkpoint layout.
    """
    return False


def plan_validated(model: nn.Module, config: MixedFSDPConfig, bulk: BulkDtypes, shard_ranks: int = 1) -> ShardPlan:
    """:func:`plan_sharding` for a config validated already (the strategies validate theirs once, at construction).
    ``shard_ranks``: the ranks each sharded param is split over, which decides the weights 4 bits can hold."""
    return plan_model(model, bulk, PlanOptions.of(config), shard_ranks=shard_ranks)


def plan_model(
    model: nn.Module,
    bulk: BulkDtypes,
    options: Optional[PlanOptions] = None,
    shard_ranks: int = 1,
    mixed_dtype_groups: Optional[bool] = None,
) -> ShardPlan:
    """:func:`plan_sharding` with the config's groups (``options``) and the bulk dtypes resolved: one matching pass,
    one frozen-module pass. With expert parallelism each experts module becomes its own unit (``ShardGroup.expert``).

    ``mixed_dtype_groups`` (default: :func:`fsdp_groups_can_mix_dtypes`) makes each unit one sharded group holding
    every dtype, where torch can; every param and buffer keeps the dtypes it has without. ``shard_ranks``: the ranks
    a sharded param is split over, which decides the frozen weights 4 bits can hold (``quantization.py``)."""
    options = options or PlanOptions()
    mixed_dtype_groups = fsdp_groups_can_mix_dtypes() if mixed_dtype_groups is None else mixed_dtype_groups
    index = ModuleIndex(model)
    matches = match_keep_fp32(model, KeepFp32Rules.of(options.dtypes), index)
    frozen = find_frozen_modules(model, index) if options.dtypes.pin_frozen_modules else []
    experts = _expert_plan(model, index, options)
    conditional = find_conditional_modules(index, options.sharding.conditional_modules)
    units = _units(index, options.sharding.wrap_units, experts, conditional)
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    keys = {name: param_key(p, name in matches, bulk, inside(name, frozen)) for name, p in params.items()}
    frozen_pinned = tuple(n for n, p in params.items() if keys[n] != param_key(p, n in matches, bulk))
    replicate_below = options.sharding.replicate_below_bytes
    groups, group_of = plan_groups(index, params, keys, matches, units, bulk, replicate_below, conditional)
    if experts is not None:
        groups = mark_expert_groups(groups, experts, type(model).__name__)
    quantized, not_quantized = _quantization(model, index, options, shard_ranks, matches, groups, experts)
    param_plans = _param_plans(params, keys, groups, group_of, matches, quantized)
    if mixed_dtype_groups:
        groups, param_plans = one_group_per_unit(groups, param_plans)
    buffer_plans, unbuilt = plan_buffers(model, index, matches, frozen, bulk, options.dtypes.cast_buffers)
    fp32_compute, fp32_compute_warnings = plan_fp32_compute(
        index, options.dtypes.fp32_compute_modules, tuple(matches.rule_of)
    )
    return ShardPlan(
        bulk=bulk,
        params=param_plans,
        groups=tuple(groups),
        buffers=buffer_plans,
        units=tuple(units),
        keep_fp32_modules=matches.modules,
        experts=experts,
        not_quantized=not_quantized,
        offload=options.memory.offload,
        offload_frozen=options.memory.offload_frozen,
        bf16_updates=options.dtypes.bf16_updates,
        float8_recipe=options.float8.recipe,
        float8=_float8_choices(model, index, options.float8, matches),
        float8_left_experts=fused_experts(index) if options.float8.recipe is not None else (),
        replica_groups=options.replica_groups,
        context_parallel=options.parallelism.context_parallel_size,
        frozen_pinned=frozen_pinned,
        fp32_compute=fp32_compute,
        conditional_modules=tuple(conditional),
        non_persistent_buffers=_non_persistent_buffers(index),
        warnings=(*_plan_warnings(matches, unbuilt), *fp32_compute_warnings),
    )


def _quantization(
    model: nn.Module,
    index: ModuleIndex,
    options: PlanOptions,
    shard_ranks: int,
    matches: KeepFp32Matches,
    groups: List[ShardGroup],
    experts: Optional[ExpertPlan],
) -> Tuple[Dict[str, str], Dict[str, str]]:
    """The frozen weights stored in 4 bits, and those left out with the reason (``quantization.py``)."""
    return plan_quantization(
        model,
        index,
        options.memory.quantize_base,
        shard_ranks,
        matches.rule_of.keys(),
        {name for g in groups if g.replicated for name in g.params},
        experts.modules if experts is not None else (),
    )


def _float8_choices(model: nn.Module, index: ModuleIndex, float8: Float8, matches: KeepFp32Matches) -> Any:
    include, exclude = tuple(float8.include), tuple(float8.exclude)
    return plan_float8(model, index, float8.recipe, float8.skip_small, include, exclude, pinned=matches.rule_of.keys())


def _expert_plan(model: nn.Module, index: ModuleIndex, options: PlanOptions) -> Optional[ExpertPlan]:
    size = options.parallelism.expert_parallel_size
    return plan_experts(model, index, size, options.parallelism.expert_parallel_plan) if size > 1 else None


def _units(
    index: ModuleIndex, wrap_units: Optional[Sequence[str]], experts: Optional[ExpertPlan], conditional: Sequence[str]
) -> List[str]:
    """The wrap units, children before parents, none inside a conditional module; under expert parallelism each
    experts module is one too."""
    units = without_conditional_units(find_wrap_units(index, wrap_units), conditional)
    if experts is None:
        return units
    order = {name: position for position, (name, _) in enumerate(index.named_modules())}
    return sorted({*units, *experts.modules}, key=lambda name: -order[name])


def _param_plans(
    params: Dict[str, nn.Parameter],
    keys: Dict[str, DtypeKey],
    groups: List[ShardGroup],
    group_of: Dict[str, str],
    matches: KeepFp32Matches,
    quantized: Dict[str, str],
) -> Dict[str, ParamPlan]:
    group_by_name = {g.name: g for g in groups}
    return {
        name: ParamPlan(
            name=name,
            shape=tuple(p.shape),
            key=effective_key(keys[name], group_by_name[group_of[name]]),
            requires_grad=p.requires_grad,
            group=group_of[name],
            replicated=group_by_name[group_of[name]].replicated,
            rule=matches.rule_of.get(name),
            init_dtype=torch.float32 if name in matches else p.dtype,
            quantized=quantized.get(name),
        )
        for name, p in params.items()
    }


def _non_persistent_buffers(index: ModuleIndex) -> "frozenset[str]":
    return frozenset(
        canonical_name(f"{module_name}.{buffer}" if module_name else buffer)
        for module_name, module in index.named_modules()
        for buffer in non_persistent_buffer_names(module)
    )


def _plan_warnings(matches: KeepFp32Matches, unbuilt: Sequence[str]) -> Tuple[str, ...]:
    return (
        *_rule_warnings(matches.unmatched_rules),
        *(
            f"could not rebuild {m} from its config to read its buffers' dtypes; they keep the dtypes they were"
            " built in (build the model under `init_module()` to give them the compute dtype)"
            for m in unbuilt
        ),
    )


def param_key(param: torch.Tensor, is_pinned: bool, bulk: BulkDtypes, in_frozen_module: bool = False) -> DtypeKey:
    """Precedence: pinned fp32 > frozen modules in the compute dtype > the bulk dtypes > the param's own dtype."""
    if is_pinned:
        return DtypeKey(torch.float32, torch.float32, torch.float32, output=bulk.compute)
    if in_frozen_module and bulk.compute is not None and param.is_floating_point():
        return DtypeKey(bulk.compute, bulk.compute, bulk.compute)
    storage = bulk.storage if bulk.storage is not None and param.is_floating_point() else param.dtype
    compute = bulk.compute if bulk.compute is not None and param.is_floating_point() else storage
    reduce = bulk.reduce if bulk.reduce is not None and param.is_floating_point() else compute
    return DtypeKey(storage, compute, reduce)


def _rule_warnings(unmatched_rules: Sequence[KeepRule]) -> Tuple[str, ...]:
    """Every user rule that matched nothing; the default norm suffixes only when neither matched anything."""
    defaults = {KeepRule(RuleKind.MODULE, rule) for rule in DEFAULT_KEEP_FP32_MODULES}
    defaults |= {KeepRule(RuleKind.PARAM, pattern) for pattern in DEFAULT_KEEP_FP32_PARAMS}
    norms = {KeepRule(RuleKind.MODULE, rule) for rule in DEFAULT_NORM_RULES}
    warnings = [f"keep-fp32 rule {str(r)!r} matched no parameter" for r in unmatched_rules if r not in defaults]
    if norms <= set(unmatched_rules):
        warnings.append(
            f"no module class ends with {' or '.join(DEFAULT_NORM_RULES)}: no norm is kept in fp32; if the"
            " model's norms use another class name, add it to keep_fp32_modules"
        )
    return tuple(warnings)
