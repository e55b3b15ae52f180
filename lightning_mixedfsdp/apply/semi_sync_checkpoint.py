"""The outer state of semi-synchronous replicas (``semi_sync.py``) in checkpoints.

Checkpoints hold the outer state beside the optimizer's own, under each param's entry of the optimizer's state dict
(``outer_steps``, the cycle's position; for DiLoCo ``outer_global`` and ``outer_momentum``, fp32 and sharded like the
param), so DCP writes and reshards them as it does AdamW's moments, and a single-file checkpoint gathers them. They
are added only to the state dicts taken for a checkpoint (:attr:`OuterSync.in_checkpoint`), never to the optimizer's
live state (AdamW makes its state only where a param has none), and taken out of a loaded state dict before torch's
``load_state_dict`` (which would cast them to the param's dtype).
"""

import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import Tensor

from lightning_mixedfsdp.apply.semi_sync import OuterSync
from lightning_mixedfsdp.model.tensors import local_tensor

if TYPE_CHECKING:
    from torch.optim import Optimizer

STEPS_KEY, GLOBAL_KEY, MOMENTUM_KEY = "outer_steps", "outer_global", "outer_momentum"
OUTER_STATE_KEYS = (STEPS_KEY, GLOBAL_KEY, MOMENTUM_KEY)
"""The outer state's entries in a param's optimizer state, in checkpoints only."""


def attach_outer_state(outer: OuterSync, optimizer: "Optimizer") -> None:
    """``optimizer``'s state dicts carry ``outer``'s state for the params it holds (saved, loaded and resharded with
    its own) while ``outer.in_checkpoint``; nothing when it holds none of them."""
    if any(id(p) in outer.index for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(lambda opt, state_dict: add_outer_state(outer, opt, state_dict))
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: take_outer_state(outer, opt, state_dict))
        outer.optimizers.append(weakref.ref(optimizer))


def add_outer_state(outer: OuterSync, optimizer: "Optimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` (``optimizer``'s) with ``outer``'s state under each synced param's entry, for a checkpoint."""
    if not outer.in_checkpoint:
        return state_dict
    outer.before_step()  # DiLoCo's global copy, if no step took it yet
    state = dict(state_dict["state"])  # its entries are the optimizer's live state dicts: replaced, not changed
    for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=True):
        for saved_id, param in zip(saved_group["params"], group["params"], strict=True):
            index = outer.index.get(id(param))
            if index is None:
                continue
            entry = {**state.get(saved_id, {}), STEPS_KEY: torch.tensor(outer.steps, dtype=torch.int64)}
            if outer.method == "diloco":
                entry[GLOBAL_KEY] = _shaped_like(outer.global_copy[index], param)
                entry[MOMENTUM_KEY] = _shaped_like(outer.momentum[index], param)
            state[saved_id] = entry
    return {**state_dict, "state": state}


def take_outer_state(outer: OuterSync, optimizer: "Optimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A loaded ``state_dict`` of ``optimizer`` without the outer state, which ``outer`` takes (before torch's load
    would cast it to the params' dtype)."""
    state = dict(state_dict["state"])
    steps: Optional[int] = None
    for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=False):
        for saved_id, param in zip(saved_group["params"], group["params"], strict=False):
            saved = state.get(saved_id)
            if saved is None or not any(key in saved for key in OUTER_STATE_KEYS):
                continue
            entry = {key: value for key, value in saved.items() if key not in OUTER_STATE_KEYS}
            index = outer.index.get(id(param))
            if index is not None and STEPS_KEY in saved:
                steps = int(saved[STEPS_KEY])
                if outer.method == "diloco" and GLOBAL_KEY in saved and MOMENTUM_KEY in saved:
                    outer.before_step()
                    outer.global_copy[index].copy_(local_tensor(saved[GLOBAL_KEY]))
                    outer.momentum[index].copy_(local_tensor(saved[MOMENTUM_KEY]))
            if entry:
                state[saved_id] = entry
            else:
                del state[saved_id]
    if steps is not None:  # saved right after a sync (the save's own, if mid-cycle)
        outer.steps, outer.synced_at, outer.loaded = steps, steps, True
    return {**state_dict, "state": state}


def without_outer_state(optimizer: "Optimizer", state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A loaded optimizer state dict without the outer state (a semi-synchronous run's checkpoint loaded by one that
    syncs every step, or into an optimizer whose params do not sync)."""
    state = {
        key: {name: value for name, value in entry.items() if name not in OUTER_STATE_KEYS}
        for key, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": {key: entry for key, entry in state.items() if entry}}


def _shaped_like(local: Tensor, param: Tensor) -> Tensor:
    """This rank's part of an outer state tensor as the param is held (a DTensor sharded like it), on its device."""
    from torch.distributed.tensor import DTensor

    local = local.to(local_tensor(param).device)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
