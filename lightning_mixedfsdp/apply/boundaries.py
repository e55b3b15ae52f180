"""Dtype boundaries: where a module computes in another dtype than the layers around it (a keep-fp32 norm among
bf16 blocks), its floating inputs are cast to its compute dtype and its outputs back to the caller's, and (with
``recompute``) the fp32 region is recomputed in backward instead of saving fp32 activations.

Every minority group's modules get one, whether FSDP shards them (their ``MixedPrecisionPolicy`` then casts nothing),
replicates them, or the model is not sharded at all (``load_weights``). The mechanism is ``apply/adapt.py``.
"""

from typing import List, Optional, Sequence

from torch import nn

from lightning_mixedfsdp.apply.adapt import Adaptation, Boundary, ClassRestore, adapt
from lightning_mixedfsdp.model.names import ModuleIndex
from lightning_mixedfsdp.planning.types import ShardGroup, ShardPlan


def is_minority(group: ShardGroup) -> bool:
    """A group carved out of its unit for its own dtypes (the unit's own group covers the unit itself)."""
    return group.modules != (group.unit,) and bool(group.modules)


def group_boundary(group: ShardGroup, recompute: bool) -> Optional[Boundary]:
    """The boundary of a minority group's modules; None for a unit's own group (FSDP casts its inputs). Recompute
    only pays where the group computes wider than it returns."""
    if not is_minority(group):
        return None
    output = group.key.output
    widening = output is not None and output.itemsize < group.key.compute.itemsize
    return Boundary(group.key.compute, output, recompute=recompute and widening)


def apply_boundaries(index: ModuleIndex, groups: Sequence[ShardGroup], recompute: bool) -> List[ClassRestore]:
    """Each minority group's boundary on its modules (the inner, user's module of each name)."""
    restores: List[ClassRestore] = []
    for group in groups:
        boundary = group_boundary(group, recompute)
        if boundary is not None:
            restores.extend(adapt(index.inner[name], Adaptation(boundary=boundary)) for name in group.modules)
    return restores


def apply_fp32_compute(index: ModuleIndex, modules: Sequence[str]) -> List[ClassRestore]:
    """``modules`` (``nn.Linear``, planned by ``dtypes.fp32_compute_modules``) multiply in fp32 whatever dtype their
    weight is stored and gathered in."""
    return [adapt(index.inner[name], Adaptation(fp32_compute=True)) for name in modules]


def apply_module_adaptations(
    index: ModuleIndex, plan: ShardPlan, recompute: bool, groups: Optional[Sequence[ShardGroup]] = None
) -> List[ClassRestore]:
    """The boundaries of ``groups`` (default: the sharded ones; FSDP casts a unit's own inputs) and the fp32-compute
    modules, before ``fully_shard``."""
    groups = plan.sharded_groups if groups is None else groups
    return apply_boundaries(index, groups, recompute) + apply_fp32_compute(index, tuple(plan.fp32_compute))


def apply_dtype_boundaries(model: nn.Module, plan: ShardPlan, recompute: bool = False) -> List[ClassRestore]:
    """Every minority group's boundary and the fp32-compute modules, on a model that is not sharded (nothing else
    casts)."""
    return apply_module_adaptations(ModuleIndex(model), plan, recompute, plan.groups)
