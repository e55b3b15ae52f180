"""Float8 training of the Linear layers the plan chose: torchao's ``convert_to_float8_training`` before sharding, as
torchtitan converts a model before parallelising it. Names and params stay (``Float8Linear`` keeps ``weight`` and
``bias`` in their dtypes), so the rest of the plan, checkpoints and exports are unchanged: only the matmuls cast to
float8. With the tensorwise recipe on CUDA the FSDP2 all-gather carries float8 too, and every optimizer step is
followed by one all-reduce of the weights' scales (``AppliedPlan.after_step``)."""

from typing import Callable, Collection, Optional

import torch
from torch import nn

from lightning_mixedfsdp.compat.torchao import convert_to_float8, float8_linear_config, precompute_float8_scales
from lightning_mixedfsdp.model.names import canonical_name

FLOAT8_CAPABILITY = (8, 9)
"""The CUDA compute capability of the first GPUs with float8 matmuls (Ada, Hopper)."""


def apply_float8(
    model: nn.Module, modules: Collection[str], recipe: Optional[str], emulate: bool, device: torch.device
) -> Optional[Callable[[], None]]:
    """Convert the Linear ``modules`` (canonical names) to float8 training; returns what must run after each
    optimizer step (FSDP2's float8 all-gather), or None."""
    if recipe is None:
        return None
    if not emulate:  # whatever the plan's size filter chose: a float8 run on a device without float8 is refused
        check_float8_matmuls(device, recipe)
    if not modules:
        return None
    all_gather = recipe == "tensorwise" and not emulate and device.type == "cuda"
    wanted = set(modules)
    config = float8_linear_config(recipe, emulate, fsdp_float8_all_gather=all_gather)
    convert_to_float8(model, config, lambda _module, fqn: canonical_name(fqn) in wanted)
    return (lambda: precompute_float8_scales(model)) if all_gather else None


def check_float8_matmuls(device: torch.device, recipe: str) -> None:
    """Refuse, with the fix, a device without float8 matmuls."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLOAT8_CAPABILITY:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
    raise ValueError(
        f"mixed_fsdp2: float8.recipe={recipe!r} needs float8 matmuls, which {name} lacks (CUDA compute capability 8.9"
        " or later: L4, L40S, H100, H200, B200). Set float8.emulate=True to emulate them in the compute dtype (the"
        " numerics of float8, no speed gain), or leave float8 off."
    )
