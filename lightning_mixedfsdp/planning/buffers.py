"""Buffer planning: every floating buffer's dtype, by precedence (a keep-fp32 rule > a frozen module > ``cast_buffers``
> the dtype HF's own construction gives it > as built), and the dtype it is initialised in. Pure."""

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_mixedfsdp.config import BulkDtypes
from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name
from lightning_mixedfsdp.planning.construction import constructed_buffer_dtypes
from lightning_mixedfsdp.planning.groups import inside
from lightning_mixedfsdp.planning.matching import KeepFp32Matches
from lightning_mixedfsdp.planning.types import BufferPlan, BufferSource


def plan_buffers(
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
            _plan_buffer(name, buffer, matches, inside(name, frozen), bulk, cast_buffers, constructed.get(name)),
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
