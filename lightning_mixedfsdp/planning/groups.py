"""Group forming: the wrap units, and inside each unit the majority dtype key owning the unit's own FSDP group, each
minority key one grouped ``fully_shard([m1, m2, ...])`` over its maximal uniform submodules, and what no module
boundary can separate (or what is too small to shard) replicated. Pure: reads the model's names and dtype keys."""

from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_mixedfsdp.config import BulkDtypes
from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name, is_within
from lightning_mixedfsdp.planning.experts import ExpertParallelError, ExpertPlan
from lightning_mixedfsdp.planning.matching import KeepFp32Matches, class_matches
from lightning_mixedfsdp.planning.types import ROOT, DtypeKey, ParamPlan, ReplicationReason, ShardGroup


def find_wrap_units(index: ModuleIndex, wrap_units: Optional[Sequence[str]]) -> List[str]:
    """Canonical names of the FSDP units, children before parents; the root is never a unit here."""
    if wrap_units:
        chosen = [n for n, m in index.named_modules() if n and any(class_matches(m, r) for r in wrap_units)]
    else:
        no_split = {c for _, m in index.named_modules() for c in (getattr(m, "_no_split_modules", None) or [])}
        if no_split:
            # by the class or a base: FSDP2's FSDPLlamaDecoderLayer is a LlamaDecoderLayer (a set-up model, planned)
            chosen = [n for n, m in index.named_modules() if n and any(c.__name__ in no_split for c in type(m).__mro__)]
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
    holds_units: FrozenSet[str]
    """Modules with a nested unit: a dtype boundary on one would wrap that unit's compute too."""
    conditional: Tuple[str, ...]
    """Modules that run for some inputs only (``conditional.py``)."""
    bulk: BulkDtypes
    replicate_below_bytes: int


def plan_groups(
    index: ModuleIndex,
    params: Dict[str, nn.Parameter],
    keys: Dict[str, DtypeKey],
    pinned: KeepFp32Matches,
    units: Sequence[str],
    bulk: BulkDtypes,
    replicate_below_bytes: int,
    conditional: Sequence[str] = (),
) -> Tuple[List[ShardGroup], Dict[str, str]]:
    """Group params unit by unit: the majority key owns the unit, each minority key gets one group; inside the
    ``conditional`` modules (which no unit is inside) a minority key is replicated."""
    unit_set = set(units)
    owner = {name: _owning_unit(_parent(name), unit_set) for name in params}
    module_owner = {name: _owning_unit(name, unit_set) for name, _ in index.named_modules()}
    containers = frozenset(n for n, m in index.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)))
    holds_units = frozenset(n for n, _ in index.named_modules() if any(u != n and is_within(u, n) for u in units))
    facts = _ModelFacts(
        params, keys, pinned, module_owner, containers, holds_units, tuple(conditional), bulk, replicate_below_bytes
    )
    groups: List[ShardGroup] = []
    for unit in [*units, ROOT]:
        groups.extend(_plan_unit(unit, [n for n in params if owner[n] == unit], facts))
    group_of = {name: group.name for group in groups for name in group.params}
    return groups, group_of


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
    always = [n for n in unit_params if not inside(n, facts.conditional)]
    for key in size_by_key:
        if key == majority:
            continue
        group_key = _returning(key, majority.compute)
        groups.extend(_conditional_minority(unit, key, group_key, unit_params, keyed, facts, taken))
        key_params = [n for n in keyed if keys[n] == key and n not in taken]
        if not key_params:
            continue
        modules = _maximal_uniform_modules(unit, key, always, keys, facts)
        covered = [n for n in always if any(is_within(n, m) for m in modules)]
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


def _conditional_minority(
    unit: str,
    key: DtypeKey,
    group_key: DtypeKey,
    unit_params: List[str],
    keyed: List[str],
    facts: _ModelFacts,
    taken: set,
) -> List[ShardGroup]:
    """The ``key`` params of ``unit`` inside conditional modules, replicated (a sharded group would all-gather only on
    the ranks that run them), with their dtype boundary on the largest uniform modules inside the conditional ones."""
    key_params = tuple(n for n in keyed if facts.keys[n] == key and inside(n, facts.conditional))
    if not key_params:
        return []
    within = [n for n in unit_params if inside(n, facts.conditional)]
    uniform = _maximal_uniform_modules(unit, key, within, facts.keys, facts)
    modules = [m for m in uniform if inside(m, facts.conditional)]
    taken.update(key_params)
    label = f"{unit or '<root>'}:conditional[{key}]"
    reason = ReplicationReason.CONDITIONAL
    return [ShardGroup(label, unit, tuple(modules), group_key, key_params, replicated=True, reason=reason)]


def _maximal_uniform_modules(
    unit: str, key: DtypeKey, unit_params: List[str], keys: Dict[str, DtypeKey], facts: _ModelFacts
) -> List[str]:
    """Largest submodules of ``unit`` (not the unit itself, not inside a nested unit, not holding one) whose params
    all have ``key``.

    Frozen params count with their own dtypes: a frozen bf16 subtree holding one fp32 norm (a PEFT base model, a
    frozen tower) is not "uniformly fp32", so the norm's casts never wrap its bf16 matmuls. A module holding a unit
    is never a member: its casts would wrap that unit's compute too.
    """
    module_owner, containers = facts.module_owner, facts.containers
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
        if m != unit
        and ks == {key}
        and module_owner.get(m) == unit
        and m not in containers
        and m not in facts.holds_units
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


def effective_key(key: DtypeKey, group: ShardGroup) -> DtypeKey:
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


def inside(name: str, modules: Sequence[str]) -> bool:
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


def one_group_per_unit(
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


def mark_expert_groups(groups: List[ShardGroup], experts: ExpertPlan, owner: str) -> List[ShardGroup]:
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
