"""Modules that run for some inputs only: a vision tower and its projector run for rows with images, an audio encoder
for rows with audio. Ranks that see different inputs run different modules, so such a module must issue no collective
of its own: it is never an FSDP unit, and its params ride in the unit around it, which every rank runs. Pure: reads
module names."""

import re
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_mixedfsdp.config import DEFAULT_CONDITIONAL_MODULES
from lightning_mixedfsdp.model.names import ModuleIndex, is_within
from lightning_mixedfsdp.planning.types import ShardPlan


def find_conditional_modules(index: ModuleIndex, patterns: Optional[Sequence[str]]) -> List[str]:
    """Canonical names of the outermost modules a pattern (``re.search`` in the name) matches; ``None``: the
    multimodal towers and projectors HF models name (:data:`DEFAULT_CONDITIONAL_MODULES`). The root never matches:
    it always runs."""
    compiled = [re.compile(p) for p in (DEFAULT_CONDITIONAL_MODULES if patterns is None else patterns)]
    found: List[str] = []
    for name, _ in index.named_modules():
        if name and not any(is_within(name, outer) for outer in found) and any(p.search(name) for p in compiled):
            found.append(name)
    return found


def without_conditional_units(units: Sequence[str], conditional: Sequence[str]) -> List[str]:
    """``units`` less those inside (or equal to) a conditional module: a unit all-gathers when it runs, so a unit that
    runs on some ranks only would pair its collectives with another rank's next ones."""
    return [unit for unit in units if not any(is_within(unit, module) for module in conditional)]


def conditional_trainable(plan: ShardPlan) -> Dict[str, Tuple[str, ...]]:
    """Each conditional module of ``plan`` holding trainable sharded params, with those params (the replicated ones
    reduce with presence flags of their own)."""
    found = {}
    for module in plan.conditional_modules:
        params = [plan.params[name] for name in plan.params_in(module)]
        names = tuple(p.name for p in params if p.requires_grad and not p.replicated)
        if names:
            found[module] = names
    return found
