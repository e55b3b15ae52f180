"""What a restarted replica group receives from a live one, rank by rank: each rank's own part of every model's
params and buffers (every dtype group, replicated params and params that never got a grad alike), every optimizer's
state (DTensor states sent as their local shards, step counters included) and any other stateful object (the
Trainer's LR schedulers). Groups have the same layout, so rank ``r`` of one group holds exactly the parts rank ``r``
of another needs; the transfer is torchft's checkpoint transport.

Everything is copied to host memory when the heal is served, so the live group trains on while a peer reads it.
Left out: 4-bit (NF4) frozen base weights, which never change and which a restarted group loads as it did at start.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mixedfsdp.compat.torch import dtensor_storage


@dataclass
class HealSources:
    """The objects a heal reads and writes, in the same order on every group."""

    models: Sequence[nn.Module]
    optimizers: Sequence[Optimizer]
    others: Sequence[Any] = ()
    """Objects with ``state_dict()`` and ``load_state_dict()`` (LR schedulers)."""


def heal_state(sources: HealSources) -> Dict[str, Any]:
    """This rank's state for a peer to heal from: plain host tensors and Python values."""
    return {
        "models": [_module_state(model) for model in sources.models],
        "optimizers": [_optimizer_state(optimizer) for optimizer in sources.optimizers],
        "others": [other.state_dict() for other in sources.others],
    }


@torch.no_grad()
def load_heal_state(state: Dict[str, Any], sources: HealSources) -> int:
    """Write a live peer's ``heal_state`` into this rank's objects, in place; returns the tensor bytes received."""
    counts = (len(state["models"]), len(state["optimizers"]), len(state["others"]))
    expected = (len(sources.models), len(sources.optimizers), len(sources.others))
    if counts != expected:
        raise RuntimeError(
            f"mixed_fsdp2 fault tolerance: the live group sent {counts} (models, optimizers, other states) but this"
            f" group set up {expected}; every replica group must run the same script with the same setup calls."
        )
    received = 0
    for model, saved in zip(sources.models, state["models"], strict=True):
        received += _load_module_state(model, saved)
    for optimizer, saved in zip(sources.optimizers, state["optimizers"], strict=True):
        received += _load_optimizer_state(optimizer, saved)
    for other, saved in zip(sources.others, state["others"], strict=True):
        other.load_state_dict(saved)
    return received


def _local(tensor: Tensor) -> Optional[Tensor]:
    """The plain tensor holding this rank's values of a param, buffer or state (a DTensor's local part; a float8
    training weight's high-precision tensor); None for a 4-bit weight, which heals nothing."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = dtensor_storage(tensor)
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return tensor
    inner = getattr(tensor, "_tensor", None)  # torchao's float8 training weight wraps its high-precision tensor
    return inner if type(inner) in (torch.Tensor, nn.Parameter) else None


def _to_host(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)


def _resharded(model: nn.Module) -> nn.Module:
    """``model`` with every FSDP group holding its shards as its params: after a forward without backward (an
    evaluation) the root group still holds its all-gathered params, which are no rank's own part."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def _module_state(model: nn.Module) -> Dict[str, Dict[str, Tensor]]:
    model = _resharded(model)
    params = {name: _local(p) for name, p in model.named_parameters()}
    buffers = {name: _local(b) for name, b in model.named_buffers()}
    return {
        "params": {name: _to_host(t) for name, t in params.items() if t is not None},
        "buffers": {name: _to_host(t) for name, t in buffers.items() if t is not None},
    }


def _load_module_state(model: nn.Module, saved: Dict[str, Dict[str, Tensor]]) -> int:
    model = _resharded(model)
    received = 0
    for kind, named in (("params", model.named_parameters()), ("buffers", model.named_buffers())):
        values = saved[kind]
        for name, tensor in named:
            local = _local(tensor)
            if local is None:
                continue
            value = values.get(name)
            if value is None or value.shape != local.shape:
                raise RuntimeError(
                    f"mixed_fsdp2 fault tolerance: the live group sent no {kind[:-1]} {name!r} of this rank's shape"
                    f" {tuple(local.shape)}; every replica group must build the same model with the same sizes."
                )
            local.copy_(value)
            received += value.nbytes
    return received


def _optimizer_state(optimizer: Optimizer) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    saved = optimizer.state_dict()
    state = {
        index: {
            key: _to_host(dtensor_storage(value) if isinstance(value, DTensor) else value)
            if isinstance(value, Tensor)
            else value
            for key, value in entries.items()
        }
        for index, entries in saved["state"].items()
    }
    return {"state": state, "param_groups": saved["param_groups"]}


def _load_optimizer_state(optimizer: Optimizer, saved: Dict[str, Any]) -> int:
    from torch.distributed.tensor import DTensor

    params: List[Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    received = 0
    state: Dict[int, Dict[str, Any]] = {}
    for index, entries in saved["state"].items():
        param = params[index]
        restored = {}
        for key, value in entries.items():
            if isinstance(value, Tensor):
                received += value.nbytes
                if isinstance(param, DTensor) and value.dim() > 0:
                    local = dtensor_storage(param)
                    value = DTensor.from_local(
                        value.to(local.device),
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
            restored[key] = value
        state[index] = restored
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    return received
