"""Updates of bf16 params computed in fp32 and written back without rounding them away (``dtypes.bf16_updates``).

Under ``bf16-true`` a trainable param is stored in bf16 with no fp32 master, and an optimizer step that rounds its
result to nearest loses every update below half the param's spacing. With ``stochastic`` or ``kahan``,
:func:`install_bf16_updates` takes the bf16 params of a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` over: the
optimizer's own step runs on its other params (keep-fp32 norms, ...), and after it each bf16 param's update is
computed in fp32 from the group's hyperparameters (weight decay included, as the same optimizer defines it) and
written back stochastically rounded (:func:`~lightning_mixedfsdp.model.rounding.round_stochastically`) or
compensated (:func:`~lightning_mixedfsdp.model.rounding.compensated_write`). No fp32 copy of a param outlives the
step.

The states, per element of a bf16 param (the optimizer's, in its ``state`` under torch's own names, so checkpoints
hold them as they hold any optimizer state, sharded like the param):

- Adam and AdamW: ``exp_avg`` in bf16, stochastically rounded (a bf16 first moment rounded to nearest stalls short
  of a steady gradient); ``exp_avg_sq`` in fp32 (in bf16 its ``(1 - beta2) g**2`` increments round away at
  torch's default ``beta2=0.999`` and every step runs about 20 % long): 6 bytes;
- SGD with momentum: ``momentum_buffer`` in fp32: 4 bytes (none without momentum);
- ``kahan`` adds ``compensation``, bf16: 2 bytes.

Random bits come from a generator per param and step, seeded from the run's seed, the step, the param's index in
the optimizer and the shard it holds: replicas of a shard round alike (bitwise equal), and a resumed run draws what
the uninterrupted one drew. Torch's ``load_state_dict`` casts every floating state to the param's dtype; the fp32
states are put back in fp32 after it. Each param group records the method (``bf16_updates``), so a checkpoint says
which one ran."""

import math
from typing import Any, Callable, Dict, Literal, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, Optimizer

from lightning_mixedfsdp.apply.step_takeover import StepAround
from lightning_mixedfsdp.compat.torchao import is_nf4
from lightning_mixedfsdp.model.rounding import compensated_write, generator_for, round_stochastically
from lightning_mixedfsdp.model.tensors import local_tensor

Bf16Updates = Literal["nearest", "stochastic", "kahan"]
BF16_UPDATES: Tuple[Bf16Updates, ...] = ("nearest", "stochastic", "kahan")
SUPPORTED = (AdamW, Adam, SGD)
FP32_STATES = ("exp_avg_sq", "momentum_buffer")
"""States kept in fp32 whatever the param's dtype (torch's loading casts them to it; they are put back)."""
GROUP_KEY = "bf16_updates"
"""The param-group entry that records the method (saved with the optimizer's state)."""


def state_bytes_per_element(method: Bf16Updates, optimizer: str, momentum: bool = True) -> int:
    """The optimizer's state bytes per element of a bf16 param (``optimizer``: ``AdamW``, ``Adam`` or ``SGD``)."""
    if optimizer in ("AdamW", "Adam"):
        own = 4 if method == "nearest" else 6  # torch's two bf16 moments; a bf16 first and an fp32 second moment
    else:
        own = (2 if method == "nearest" else 4) if momentum else 0
    return own + (2 if method == "kahan" else 0)


def install_bf16_updates(
    optimizer: Optimizer, method: Bf16Updates, seed: Callable[[], int], owner: str
) -> Optional["Bf16Writer"]:
    """Take ``optimizer``'s trainable bf16 params over with ``method`` (nothing for ``nearest``); ``seed()``: the
    run's seed, read at every step (a run may seed after its optimizer is set up). Raises, naming ``owner``, for
    another optimizer, an option this does not reproduce, or no bf16 param to take."""
    if method == "nearest" or any(GROUP_KEY in group for group in optimizer.param_groups):
        return None
    kind = type(optimizer)
    if kind not in SUPPORTED:
        raise ValueError(
            f"{owner}: bf16_updates={method!r} computes each update itself, as torch.optim.AdamW, Adam and SGD define"
            f" it, and {kind.__module__}.{kind.__name__} is none of them. Use one of those, or"
            " bf16_updates='nearest' (or keep fp32 masters: precision='bf16-mixed')."
        )
    for group in optimizer.param_groups:
        for option in ("amsgrad", "differentiable"):
            if group.get(option):
                raise ValueError(
                    f"{owner}: bf16_updates={method!r} does not reproduce {kind.__name__}({option}=True); set"
                    f" {option}=False, or bf16_updates='nearest'."
                )
    if not any(p.requires_grad and _stored_in_bf16(p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            f"{owner}: bf16_updates={method!r} writes the updates of trainable params stored in bf16, and this"
            f" {kind.__name__} holds none: its params have fp32 masters already (a precision other than"
            " 'bf16-true', or keep-fp32 rules). Leave bf16_updates='nearest', or train with precision='bf16-true'."
        )
    return Bf16Writer(optimizer, method, seed)


class Bf16Writer:
    """The hooks around ``optimizer``'s step and state loading; see the module's docstring."""

    def __init__(self, optimizer: Optimizer, method: Bf16Updates, seed: Callable[[], int]) -> None:
        self.optimizer, self.method, self.seed = optimizer, method, seed
        self.index: Dict[int, int] = {}
        """Each taken param (by identity) at its position among the optimizer's params."""
        self.taken: Set[int] = set()
        self._take_new_groups()
        self._loading: Dict[Tuple[int, str], Tensor] = {}
        # the optimizer's own step over its other params, then (its first post hook: others see the written params)
        # the taken ones written here
        StepAround(optimizer, keep=lambda p: id(p) not in self.taken, after=self._write, before=self._take_new_groups)
        optimizer.register_load_state_dict_pre_hook(self._before_load)
        optimizer.register_load_state_dict_post_hook(self._after_load)

    # -- the step: the optimizer runs on its other params, then the taken ones are written here

    def _take_new_groups(self) -> None:
        """The trainable bf16 params of the groups not taken yet (all at install; later, a group added by
        ``add_param_group``, as Lightning's ``BaseFinetuning`` adds the layers it unfreezes)."""
        position = 0
        for group in self.optimizer.param_groups:
            fresh = GROUP_KEY not in group
            group[GROUP_KEY] = self.method
            for param in group["params"]:
                if fresh and param.requires_grad and _stored_in_bf16(param):
                    self.index[id(param)] = position
                    self.taken.add(id(param))
                position += 1

    def _write(self, optimizer: Optimizer) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in self.taken and param.grad is not None:
                    self._update(param, group)

    def _update(self, param: Tensor, group: Dict[str, Any]) -> None:
        state = self.optimizer.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        step = int(state["step"].item())
        value = local_tensor(param)
        grad = local_tensor(param.grad).float()  # type: ignore[arg-type]  # checked by the caller
        if group.get("maximize", False):
            grad = -grad
        generator = generator_for(self.seed(), step, self.index[id(param)], _shard_of(param), value.device)
        compensation = _state(state, "compensation", param, torch.bfloat16) if self.method == "kahan" else None
        # what the param stands for: weight decay shrinks that, not the rounded value alone
        represented = value.float() if compensation is None else value.float() + compensation.float()
        if isinstance(self.optimizer, SGD):
            update = self._sgd(param, state, group, grad, represented)
        else:
            update = self._adam(param, state, group, grad, represented, step, generator)
        if compensation is None:
            value.copy_(round_stochastically(value.float() + update, generator))
        else:
            compensated_write(value, update, compensation)

    def _adam(
        self,
        param: Tensor,
        state: Dict[str, Any],
        group: Dict[str, Any],
        grad: Tensor,
        value: Tensor,
        step: int,
        generator: torch.Generator,
    ) -> Tensor:
        lr, (beta1, beta2), eps, decay = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        decoupled = isinstance(self.optimizer, AdamW) or group.get("decoupled_weight_decay", False)
        if decay and not decoupled:  # Adam's L2: part of the gradient
            grad = grad + decay * value
        first = _state(state, "exp_avg", param, torch.bfloat16)
        second = _state(state, "exp_avg_sq", param, torch.float32)
        moment = first.float().lerp_(grad, 1 - beta1)
        first.copy_(round_stochastically(moment, generator))
        second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (second.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        update = moment.div_(denominator).mul_(-lr / (1 - beta1**step))
        if decay and decoupled:  # AdamW's decay: part of the same update, not a bf16 write of its own
            update.add_(value, alpha=-lr * decay)
        return update

    def _sgd(self, param: Tensor, state: Dict[str, Any], group: Dict[str, Any], grad: Tensor, value: Tensor) -> Tensor:
        decay, momentum = group["weight_decay"], group["momentum"]
        if decay:
            grad = grad + decay * value
        if momentum:
            fresh = "momentum_buffer" not in state or state["momentum_buffer"] is None
            buffer = _state(state, "momentum_buffer", param, torch.float32)
            if fresh:
                buffer.copy_(grad)
            else:
                buffer.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            grad = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer.clone()
        return grad.mul_(-float(group["lr"]))

    # -- loading: torch casts the fp32 states to the param's dtype; they are put back

    def _before_load(self, optimizer: Optimizer, state_dict: Dict[str, Any]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        self._loading = {}
        for param, saved_id in zip(params, saved_ids, strict=False):
            if id(param) not in self.taken:
                continue
            for key in FP32_STATES:
                value = state_dict["state"].get(saved_id, {}).get(key)
                if isinstance(value, Tensor) and value.dtype == torch.float32:
                    self._loading[self.index[id(param)], key] = value

    def _after_load(self, optimizer: Optimizer) -> None:
        position = 0
        for group in optimizer.param_groups:
            group[GROUP_KEY] = self.method  # this run's method, whichever the checkpoint's was
            for param in group["params"]:
                for key in FP32_STATES:
                    saved = self._loading.get((position, key))
                    if saved is not None and id(param) in self.taken:
                        optimizer.state[param][key] = saved.to(device=param.device, dtype=torch.float32)
                position += 1
        self._loading = {}


def bf16_update_methods(optimizer: Optimizer) -> Dict[int, str]:
    """The write-back of each param ``optimizer`` took over (by identity): ``stochastic`` or ``kahan``."""
    return {
        id(param): group[GROUP_KEY]
        for group in optimizer.param_groups
        if group.get(GROUP_KEY, "nearest") != "nearest"
        for param in group["params"]
        if param.requires_grad and _stored_in_bf16(param)
    }


def _stored_in_bf16(param: Tensor) -> bool:
    local = local_tensor(param)
    return not is_nf4(local) and local.dtype == torch.bfloat16


def _state(state: Dict[str, Any], key: str, param: Tensor, dtype: torch.dtype) -> Tensor:
    """The local part of ``state[key]``, made (zeros, like ``param``: a DTensor for a DTensor) or converted to
    ``dtype`` first (a checkpoint of another method, or weights loaded without optimizer state)."""
    held = state.get(key)
    if not isinstance(held, Tensor):
        held = state[key] = torch.zeros_like(param, dtype=dtype)
    elif held.dtype != dtype:
        held = state[key] = held.to(dtype)
    return local_tensor(held)


def _shard_of(param: Tensor) -> Tuple[int, ...]:
    """The mesh coordinates of the shard ``param`` holds, on the dims that split it (replicas share them)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return ()
    coordinate: Sequence[int] = param.device_mesh.get_coordinate() or ()
    return tuple(c for c, placement in zip(coordinate, param.placements, strict=False) if isinstance(placement, Shard))
