"""Dtype boundaries: where a module computes in another dtype than the layers around it (a keep-fp32 norm among
bf16 blocks), its floating inputs are cast to its compute dtype and its outputs back to the caller's.

FSDP's ``MixedPrecisionPolicy`` does this for sharded groups; these boundaries do it for modules FSDP does not
wrap: replicated groups, and every minority group of a model that is not sharded at all (``load_weights``).
"""

from typing import List, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.sharding.names import ModuleIndex
from lightning_mixedfsdp.sharding.plan import ShardGroup, ShardPlan
from lightning_mixedfsdp.sharding.tensors import cast_floating


def install_cast_hooks(
    module: nn.Module, input_dtype: torch.dtype, output_dtype: Optional[torch.dtype]
) -> List[RemovableHandle]:
    """What FSDP's MixedPrecisionPolicy does at a group boundary, for a module that is not an FSDP group."""

    def cast_inputs(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return cast_floating((args, kwargs), input_dtype)

    handles = [module.register_forward_pre_hook(cast_inputs, with_kwargs=True)]
    if output_dtype is not None:
        handles.append(module.register_forward_hook(lambda _m, _a, output: cast_floating(output, output_dtype)))
    return handles


def install_group_boundaries(index: ModuleIndex, group: ShardGroup) -> List[RemovableHandle]:
    """The boundaries of one group's modules: inputs in the group's compute dtype, outputs in its output dtype."""
    handles: List[RemovableHandle] = []
    for module_name in group.modules:
        handles.extend(install_cast_hooks(index.inner[module_name], group.key.compute, group.key.output))
    return handles


def is_minority(group: ShardGroup) -> bool:
    """A group carved out of its unit for its own dtypes (the unit's own group covers the unit itself)."""
    return group.modules != (group.unit,) and bool(group.modules)


def apply_dtype_boundaries(model: nn.Module, plan: ShardPlan) -> List[RemovableHandle]:
    """Every minority group's boundaries, on a model that is not sharded (no FSDP casts anything)."""
    index = ModuleIndex(model)
    return [handle for group in plan.groups if is_minority(group) for handle in install_group_boundaries(index, group)]
