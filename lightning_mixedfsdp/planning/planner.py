"""The planner: model + config -> ShardPlan (``types.py``). Pure: reads the model, never changes it, issues no
collectives.

It decides, once, every param's storage/compute/reduce dtype and FSDP group, and every floating buffer's dtype.
Names are canonical (``model/names.py``), so the plan fits the model before and after wrappers are applied.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_mixedfsdp._torch_compat import non_persistent_buffer_names
from lightning_mixedfsdp.config import DEFAULT_NORM_RULES, BulkDtypes, MixedFSDPConfig
from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name, is_within
from lightning_mixedfsdp.planning.construction import constructed_buffer_dtypes
from lightning_mixedfsdp.planning.experts import ExpertParallelError, ExpertPlan, plan_experts
from lightning_mixedfsdp.planning.float8 import fused_experts, plan_float8
from lightning_mixedfsdp.planning.matching import (
    KeepFp32Matches,
    KeepFp32Rules,
    KeepRule,
    RuleKind,
    class_matches,
    find_frozen_modules,
    match_keep_fp32,
)
from lightning_mixedfsdp.planning.quantization import plan_quantization
from lightning_mixedfsdp.planning.types import (
    ROOT,
    BufferPlan,
    BufferSource,
    DtypeKey,
    ParamPlan,
    ReplicationReason,
    ShardGroup,
    ShardPlan,
)


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
    return plan_model(
        model,
        bulk,
        KeepFp32Rules.of(config),
        wrap_units=config.wrap_units,
        replicate_below_bytes=config.replicate_below_bytes,
        pin_frozen_modules=config.pin_frozen_modules,
        cast_buffers=config.cast_buffers,
        expert_parallel_size=config.expert_parallel_size,
        expert_parallel_plan=config.expert_parallel_plan,
        quantize_base=config.quantize_base,
        shard_ranks=shard_ranks,
        offload=config.offload,
        float8=Float8Options(
            config.float8, config.float8_skip_small, tuple(config.float8_include), tuple(config.float8_exclude)
        ),
        replica_groups=config.fault_tolerance.num_replica_groups if config.fault_tolerance is not None else None,
    )


def plan_model(
    model: nn.Module,
    bulk: BulkDtypes,
    rules: KeepFp32Rules,
    wrap_units: Optional[Sequence[str]] = None,
    replicate_below_bytes: int = 1 << 20,
    pin_frozen_modules: bool = True,
    cast_buffers: bool = False,
    expert_parallel_size: int = 1,
    expert_parallel_plan: Optional[Dict[str, str]] = None,
    mixed_dtype_groups: Optional[bool] = None,
    quantize_base: Optional[str] = None,
    shard_ranks: int = 1,
    offload: Optional[str] = None,
    float8: Optional["Float8Options"] = None,
    replica_groups: Optional[int] = None,
) -> ShardPlan:
    """:func:`plan_sharding` with plain, already validated values: one matching pass, one frozen-module pass. With
    ``expert_parallel_size > 1`` each experts module becomes its own unit (``ShardGroup.expert``).

    ``mixed_dtype_groups`` (default: :func:`fsdp_groups_can_mix_dtypes`) makes each unit one sharded group holding
    every dtype, where torch can; every param and buffer keeps the dtypes it has without.

    ``quantize_base`` picks the frozen base weights stored in 4 bits (``quantization.py``) for params sharded over
    ``shard_ranks``; ``offload`` is recorded for the report and the memory estimate; ``float8`` picks the Linear
    layers that train in float8 (``float8.py``); ``replica_groups`` (fault tolerance) records the torchft replica groups
    every gradient is also averaged across."""
    if mixed_dtype_groups is None:
        mixed_dtype_groups = fsdp_groups_can_mix_dtypes()
    index = ModuleIndex(model)
    matches = match_keep_fp32(model, rules, index)
    frozen = find_frozen_modules(model, index) if pin_frozen_modules else []
    units = find_wrap_units(index, wrap_units)
    experts = (
        plan_experts(model, index, expert_parallel_size, expert_parallel_plan) if expert_parallel_size > 1 else None
    )
    if experts is not None:
        order = {name: position for position, (name, _) in enumerate(index.named_modules())}
        units = sorted({*units, *experts.modules}, key=lambda name: -order[name])
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    keys = {name: param_key(p, name in matches, bulk, _inside(name, frozen)) for name, p in params.items()}
    groups, group_of = _plan_groups(index, params, keys, matches, units, bulk, replicate_below_bytes)
    if experts is not None:
        groups = _mark_expert_groups(groups, experts, type(model).__name__)
    group_by_name = {g.name: g for g in groups}
    quantized, not_quantized = plan_quantization(
        model,
        index,
        quantize_base,
        shard_ranks,
        pinned=matches.rule_of.keys(),
        replicated={name for g in groups if g.replicated for name in g.params},
        expert_modules=experts.modules if experts is not None else (),
    )
    param_plans = {
        name: ParamPlan(
            name=name,
            shape=tuple(p.shape),
            key=_effective_key(keys[name], group_by_name[group_of[name]]),
            requires_grad=p.requires_grad,
            group=group_of[name],
            replicated=group_by_name[group_of[name]].replicated,
            rule=matches.rule_of.get(name),
            init_dtype=torch.float32 if name in matches else p.dtype,
            quantized=quantized.get(name),
        )
        for name, p in params.items()
    }
    if mixed_dtype_groups:
        groups, param_plans = _one_group_per_unit(groups, param_plans)
    buffer_plans, unbuilt = _plan_buffers(model, index, matches, frozen, bulk, cast_buffers)
    float8 = float8 or Float8Options()
    float8_choices = plan_float8(
        model, index, float8.recipe, float8.skip_small, float8.include, float8.exclude, pinned=matches.rule_of.keys()
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
        offload=offload,
        float8_recipe=float8.recipe,
        float8=float8_choices,
        float8_left_experts=fused_experts(index) if float8.recipe is not None else (),
        replica_groups=replica_groups,
        non_persistent_buffers=frozenset(
            canonical_name(f"{module_name}.{buffer}" if module_name else buffer)
            for module_name, module in index.named_modules()
            for buffer in non_persistent_buffer_names(module)
        ),
        warnings=(
            *_rule_warnings(matches.unmatched_rules),
            *(
                f"could not rebuild {m} from its config to read its buffers' dtypes; they keep the dtypes they were"
                " built in (build the model under `init_module()` to give them the compute dtype)"
                for m in unbuilt
            ),
        ),
    )


@dataclass(frozen=True)
class Float8Options:
    """The config's float8 fields, as the planner takes them."""

    recipe: Optional[str] = None
    skip_small: bool = True
    include: Tuple[str, ...] = ()
    exclude: Tuple[str, ...] = ()


def _one_group_per_unit(
    groups: List[ShardGroup], param_plans: Dict[str, ParamPlan]
) -> Tuple[List[ShardGroup], Dict[str, ParamPlan]]:
    """Merge each unit's groups (minority, replicated, its own) into the unit's own group, for a torch whose
    ``fully_shard`` takes mixed dtypes. Each param keeps the dtypes the per-dtype groups gave it."""
    by_unit: Dict[str, List[ShardGroup]] = defaultdict(list)
    for group in groups:
        by_unit[group.unit].append(group)
    merged = []
    for unit, unit_groups in by_unit.items():  # units in application order, children first
        own = [g for g in unit_groups if g.modules == (unit,) and not g.replicated] or unit_groups[:1]
        params = tuple(name for g in unit_groups for name in g.params)
        merged.append(
            replace(own[0], name=unit or "<root>", modules=(unit,), params=params, replicated=False, reason=None)
        )
    group_of = {name: group.name for group in merged for name in group.params}
    plans = {name: replace(p, group=group_of[name], replicated=False) for name, p in param_plans.items()}
    return merged, plans


def _mark_expert_groups(groups: List[ShardGroup], experts: ExpertPlan, owner: str) -> List[ShardGroup]:
    """Each experts module's own group goes on the expert mesh; it must hold all of the module's params in one dtype
    (FSDP2 cannot group mixed dtypes, and a minority group inside would be sharded over the dense mesh)."""
    mixed = [g.unit for g in groups if g.unit in experts.modules and (g.replicated or g.modules != (g.unit,))]
    if mixed:
        raise ExpertParallelError(
            f"expert_parallel_size={experts.size}: the params of {mixed[0]} in {owner} would have more than one"
            " dtype (a keep-fp32 rule matches some of them). Expert params must share one dtype: narrow"
            " keep_fp32_modules / keep_fp32_params so they skip the experts, or leave expert_parallel_size=1."
        )
    return [replace(g, expert=True) if g.unit in experts.modules else g for g in groups]


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


def _plan_buffers(
    model: nn.Module,
    index: ModuleIndex,
    matches: KeepFp32Matches,
    frozen: Sequence[str],
    bulk: BulkDtypes,
    cast_buffers: bool,
) -> Tuple[Dict[str, BufferPlan], List[str]]:
    """Every floating buffer's plan, and the HF models whose construction could not be read (described)."""
    constructed: Dict[str, torch.dtype] = {}
    unbuilt: List[str] = []
    narrow_compute = bulk.compute is not None and bulk.compute != torch.float32
    if narrow_compute and bulk.compute is not None and any(b.is_floating_point() for b in model.buffers()):
        constructed, unbuilt = constructed_buffer_dtypes(model, index, bulk.compute)
    plans = {
        name: _initialised_as_built(
            _plan_buffer(name, buffer, matches, _inside(name, frozen), bulk, cast_buffers, constructed.get(name)),
            buffer,
        )
        for name, buffer in ((canonical_name(n), b) for n, b in model.named_buffers())
        if buffer.is_floating_point()
    }
    return plans, unbuilt


def _initialised_as_built(planned: BufferPlan, buffer: torch.Tensor) -> BufferPlan:
    """A buffer planned in fp32 is initialised in fp32; any other in the dtype it was built in."""
    return replace(planned, init_dtype=torch.float32 if planned.dtype == torch.float32 else buffer.dtype)


def _plan_buffer(
    name: str,
    buffer: torch.Tensor,
    matches: KeepFp32Matches,
    in_frozen_module: bool,
    bulk: BulkDtypes,
    cast_buffers: bool,
    constructed: Optional[torch.dtype] = None,
) -> BufferPlan:
    """Precedence: a keep-fp32 rule > fully frozen modules in the compute dtype > ``cast_buffers`` > the dtype HF's
    construction under the compute dtype gives it (``construction.py``) > as built."""
    shape = tuple(buffer.shape)
    if name in matches:
        return BufferPlan(name, shape, torch.float32, BufferSource.KEEP_FP32, matches.rule_of[name])
    if in_frozen_module and bulk.compute is not None:
        return BufferPlan(name, shape, bulk.compute, BufferSource.FROZEN)
    if cast_buffers and bulk.storage is not None:
        return BufferPlan(name, shape, bulk.storage, BufferSource.CAST)
    if constructed is not None:
        source = BufferSource.CONSTRUCTED if constructed != buffer.dtype else BufferSource.BUILT
        return BufferPlan(name, shape, constructed, source)
    return BufferPlan(name, shape, buffer.dtype, BufferSource.BUILT)


def find_wrap_units(index: ModuleIndex, wrap_units: Optional[Sequence[str]]) -> List[str]:
    """Canonical names of the FSDP units, children before parents; the root is never a unit here."""
    if wrap_units:
        chosen = [n for n, m in index.named_modules() if n and any(class_matches(m, r) for r in wrap_units)]
    else:
        no_split = {c for _, m in index.named_modules() for c in (getattr(m, "_no_split_modules", None) or [])}
        if no_split:
            chosen = [n for n, m in index.named_modules() if n and type(m).__name__ in no_split]
        else:
            chosen = _outermost_module_list_children(index)
    order = {name: position for position, (name, _) in enumerate(index.named_modules())}
    return sorted(set(chosen), key=lambda name: -order[name])


def _outermost_module_list_children(index: ModuleIndex) -> List[str]:
    """Children of ModuleLists not inside another unit: blocks, not the experts inside a block (an expert that gets
    no token on one rank must not be its own FSDP group, or that rank skips its collectives)."""
    chosen: List[str] = []
    for name, module in index.named_modules():
        if isinstance(module, nn.ModuleList) and not any(is_within(name, unit) for unit in chosen):
            chosen.extend(canonical_name(f"{name}.{child}" if name else child) for child, _ in module.named_children())
    return chosen


@dataclass(frozen=True)
class _ModelFacts:
    """What the planner reads of the model once, shared by every unit."""

    params: Dict[str, nn.Parameter]
    keys: Dict[str, DtypeKey]
    pinned: KeepFp32Matches
    module_owner: Dict[str, str]
    """Canonical module name -> the unit that owns it."""
    containers: FrozenSet[str]
    """ModuleList/ModuleDict names: never called, so never a group member."""
    bulk: BulkDtypes
    replicate_below_bytes: int


def _plan_groups(
    index: ModuleIndex,
    params: Dict[str, nn.Parameter],
    keys: Dict[str, DtypeKey],
    pinned: KeepFp32Matches,
    units: Sequence[str],
    bulk: BulkDtypes,
    replicate_below_bytes: int,
) -> Tuple[List[ShardGroup], Dict[str, str]]:
    """Group params unit by unit: the majority key owns the unit, each minority key gets one group."""
    unit_set = set(units)
    owner = {name: _owning_unit(_parent(name), unit_set) for name in params}
    module_owner = {name: _owning_unit(name, unit_set) for name, _ in index.named_modules()}
    containers = frozenset(n for n, m in index.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)))
    facts = _ModelFacts(params, keys, pinned, module_owner, containers, bulk, replicate_below_bytes)
    groups: List[ShardGroup] = []
    for unit in [*units, ROOT]:
        groups.extend(_plan_unit(unit, [n for n in params if owner[n] == unit], facts))
    group_of = {name: group.name for group in groups for name in group.params}
    return groups, group_of


def _rule_warnings(unmatched_rules: Sequence[KeepRule]) -> Tuple[str, ...]:
    """Every user rule that matched nothing; the default norm suffixes only when neither matched anything."""
    from lightning_mixedfsdp.config import DEFAULT_KEEP_FP32_MODULES, DEFAULT_KEEP_FP32_PARAMS

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


def _plan_unit(unit: str, unit_params: List[str], facts: _ModelFacts) -> List[ShardGroup]:
    params, keys, pinned = facts.params, facts.keys, facts.pinned
    # trainable params decide groups; frozen pinned params too, so a frozen norm still computes in fp32
    keyed = [n for n in unit_params if params[n].requires_grad or n in pinned]
    trainable = [n for n in keyed if params[n].requires_grad]
    size_by_key: Counter = Counter()
    # a fully frozen unit (a tower) is owned by the dtype most of its params have
    for name in trainable or unit_params:
        size_by_key[keys[name]] += params[name].numel()
    for name in keyed:
        size_by_key.setdefault(keys[name], 0)
    # first-seen order breaks ties deterministically
    majority = (
        max(size_by_key, key=lambda k: size_by_key[k]) if size_by_key else _default_key(unit_params, keys, facts.bulk)
    )

    groups: List[ShardGroup] = []
    taken: set = set()
    for key in size_by_key:
        if key == majority:
            continue
        key_params = [n for n in keyed if keys[n] == key]
        group_key = _returning(key, majority.compute)
        modules = _maximal_uniform_modules(unit, key, unit_params, keys, facts.module_owner, facts.containers)
        covered = [n for n in unit_params if any(is_within(n, m) for m in modules)]
        inseparable = tuple(n for n in key_params if n not in covered)
        if inseparable:
            label = f"{unit or '<root>'}:inseparable[{key}]"
            reason = ReplicationReason.INSEPARABLE
            groups.append(ShardGroup(label, unit, (), key, inseparable, replicated=True, reason=reason))
            taken.update(inseparable)
        if modules:
            name = f"{unit or '<root>'}[{','.join(_relative(m, unit) for m in modules)}]"
            nbytes = sum(params[n].numel() * key.storage.itemsize for n in covered)
            replicated = nbytes < facts.replicate_below_bytes
            small = ReplicationReason.SMALL if replicated else None
            groups.append(ShardGroup(name, unit, tuple(modules), group_key, tuple(covered), replicated, reason=small))
            taken.update(covered)
    rest = tuple(n for n in unit_params if n not in taken)
    if rest or unit == ROOT:
        groups.append(ShardGroup(unit or "<root>", unit, (unit,), majority, rest, is_root=unit == ROOT))
    return groups


def _maximal_uniform_modules(
    unit: str,
    key: DtypeKey,
    unit_params: List[str],
    keys: Dict[str, DtypeKey],
    module_owner: Dict[str, str],
    containers: FrozenSet[str],
) -> List[str]:
    """Largest submodules of ``unit`` (not the unit itself, not inside a nested unit) whose params all have ``key``.

    Frozen params count with their own dtypes: a frozen bf16 subtree holding one fp32 norm (a PEFT base model, a
    frozen tower) is not "uniformly fp32", so the norm's casts never wrap its bf16 matmuls.
    """
    keys_below: Dict[str, set] = defaultdict(set)
    for name in unit_params:
        module = _parent(name)
        while True:
            keys_below[module].add(keys[name])
            if module == unit:
                break
            module = _parent(module)
    # containers (ModuleList/ModuleDict) are never called, so hooks on them would never fire: use their children
    uniform = {
        m
        for m, ks in keys_below.items()
        if m != unit and ks == {key} and module_owner.get(m) == unit and m not in containers
    }
    return sorted(m for m in uniform if not _has_uniform_ancestor(m, uniform, unit))


def _has_uniform_ancestor(module: str, uniform: set, unit: str) -> bool:
    parent = _parent(module)
    while parent != unit and parent:
        if parent in uniform:
            return True
        parent = _parent(parent)
    return False


def _returning(key: DtypeKey, unit_compute: torch.dtype) -> DtypeKey:
    """A minority group returns its outputs in the dtype its unit computes in, so the next layer gets its own dtype
    (an fp32 norm in a model that arrived in bf16 under ``32-true`` returns bf16)."""
    if key.output is not None or key.compute == unit_compute:
        return key
    return DtypeKey(key.storage, key.compute, key.reduce, output=unit_compute)


def _effective_key(key: DtypeKey, group: ShardGroup) -> DtypeKey:
    """Frozen params ride with their group, so they all-gather in the group's compute dtype."""
    if group.replicated or key == group.key:
        return key
    return DtypeKey(key.storage, group.key.compute, group.key.reduce, group.key.output)


def _default_key(unit_params: List[str], keys: Dict[str, DtypeKey], bulk: BulkDtypes) -> DtypeKey:
    if unit_params:
        return Counter(keys[n] for n in unit_params).most_common(1)[0][0]
    storage = bulk.storage or torch.get_default_dtype()
    compute = bulk.compute or storage
    return DtypeKey(storage, compute, bulk.reduce or compute)


def _inside(name: str, modules: Sequence[str]) -> bool:
    return any(is_within(name, m) for m in modules)


def _owning_unit(module_name: str, units: set) -> str:
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in units:
            return prefix
    return ROOT


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _relative(module_name: str, unit: str) -> str:
    return module_name[len(unit) + 1 :] if unit else module_name
