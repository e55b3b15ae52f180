"""Which modules compute in fp32 while stored in the bulk dtype (``dtypes.fp32_compute_modules``): an LM head whose
logits are token probabilities for RL. Storage, sharding and the all-gather stay the group's; only the module's
forward runs in fp32 (``apply/fp32_compute.py``). Pure: reads the model, changes nothing."""

import re
from typing import Dict, List, Sequence, Tuple

from torch import nn

from lightning_mixedfsdp.model.names import ModuleIndex
from lightning_mixedfsdp.planning.matching import class_matches


class Fp32ComputeError(ValueError):
    """An ``fp32_compute_modules`` entry matches a module that cannot compute in fp32 this way."""


def entry_matches(entry: str, name: str, module: nn.Module) -> bool:
    """A module matches an entry by its class (a class-name suffix, or a dotted qualified class path, as
    ``keep_fp32_modules``) or by its qualified name (the entry as a regex searched in it)."""
    return class_matches(module, entry) or re.search(entry, name) is not None


def plan_fp32_compute(
    index: ModuleIndex, entries: Sequence[str], pinned: Sequence[str]
) -> Tuple[Dict[str, str], Tuple[str, ...]]:
    """Each matched module (canonical name) with the entry that matched it, and warnings: an entry that matches no
    module, a module a keep-fp32 rule stores in fp32 already (``pinned``: its params; nothing to upcast). Raises
    :class:`Fp32ComputeError` for a matched module that is not an ``nn.Linear``, naming each."""
    matched: Dict[str, str] = {}
    warnings: List[str] = []
    wrong: List[str] = []
    pinned_set = set(pinned)
    for entry in entries:
        hits = [(name, module) for name, module in index.named_modules() if name and entry_matches(entry, name, module)]
        if not hits:
            warnings.append(f"fp32_compute_modules entry {entry!r} matched no module")
        for name, module in hits:
            if not isinstance(module, nn.Linear):
                wrong.append(f"{entry!r} matches {name!r} ({type(module).__name__})")
            elif f"{name}.weight" in pinned_set:
                warnings.append(f"{name} is kept fp32 by a keep-fp32 rule; fp32_compute_modules has nothing to add")
            else:
                matched.setdefault(name, entry)
    if wrong:
        more = f"; and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        raise Fp32ComputeError(
            "mixed_fsdp2: dtypes.fp32_compute_modules computes nn.Linear modules (an LM head) in fp32, and "
            + "; ".join(wrong[:4])
            + more
            + ". Anchor the regex to the head's name (e.g. '^lm_head$'), or name the Linear's class."
        )
    return matched, tuple(warnings)
