"""Models built on the meta device: rank 0 initialises an unsharded copy, the shards are filled from it."""

import copy
import warnings
from typing import Optional, Union

import torch
from torch import nn

from lightning_mixedfsdp.checkpoint.load import broadcast_full_state


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def init_meta_module_(module: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Materialize a meta module on one process: allocate, then each module's ``reset_parameters`` in module order.

    This is the reference a sharded meta init reproduces: rank 0 runs exactly this on an unsharded copy.
    """
    module.to_empty(device=device)
    uninitialised = []
    with torch.no_grad():
        for name, submodule in module.named_modules():
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset):
                reset()
            elif any(True for _ in submodule.parameters(recurse=False)) or any(
                True for _ in submodule.buffers(recurse=False)
            ):
                uninitialised.append(f"{name or '<root>'} ({type(submodule).__name__})")
    if uninitialised:
        warnings.warn(
            f"init_meta_module_: {len(uninitialised)} module(s) hold params or buffers but define no"
            f" reset_parameters(), so they keep uninitialised memory: {', '.join(uninitialised[:10])}."
            " Give them a reset_parameters() or load weights after setup (init_meta_params=False).",
            stacklevel=2,
        )
    return module


def materialize_sharded(
    sharded: nn.Module, template: Optional[nn.Module], device: torch.device, initialise: bool
) -> None:
    """Allocate the local shards of a model sharded on meta. With ``initialise``, rank 0 (the only one passing the
    unsharded meta ``template``) initialises it with single-process values and broadcasts them into the shards."""
    sharded.to_empty(device=device)
    if not initialise:
        return
    import torch.distributed as dist

    full_state = init_meta_module_(template).state_dict() if dist.get_rank() == 0 else None
    broadcast_full_state(sharded, full_state)


def meta_template(module: nn.Module) -> nn.Module:
    """An unsharded copy of a meta module (cheap: meta tensors hold no data)."""
    return copy.deepcopy(module)
