"""Updates that round away: for each trainable bf16 (or fp16) param, the share of its elements an optimizer step did
not change although their gradient was non-zero. bf16 holds 8 significant bits: near 7 its numbers are 0.03 apart, so
an update below half that (an aux-loss-free router bias moving by 1e-3) rounds back to the value it started from,
and the param silently stops learning.

On a sampled step, :meth:`StalledUpdates.before_step` copies each such param's local shard (a DTensor's local part:
no gather), writing NaN where the gradient is zero, so the copy is the only memory it takes (one shard-sized copy of
the bf16 params); :meth:`StalledUpdates.after_step` counts the elements equal to their copy (NaN equals nothing) and
frees it. The counts, with each param's value range and update size, are summed over the ranks in one all-reduce:
a sharded param's shards add up to the whole, a replicated param counts on every rank alike, so the share is the
same as in one process. The update size is the optimizer's intended step where its state says it (Adam and AdamW:
``lr * m_hat / (sqrt(v_hat) + eps)``; SGD: ``lr * grad``), measured after the step."""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mixedfsdp.apply.bf16_updates import bf16_update_methods
from lightning_mixedfsdp.model.tensors import local_tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
FIELDS = 6
"""Per param: stalled elements, eligible elements, sum of |value|, max |value|, min |value| (negated for a max
reduction), sum of the intended |update|."""


@dataclass(frozen=True)
class StalledShare:
    """One param on one sampled step."""

    name: str
    dtype: torch.dtype
    share: float
    """Elements unchanged by the step among those with a non-zero gradient."""
    eligible: int
    """Elements with a non-zero gradient (all ranks)."""
    mean_abs_value: float
    value_range: Tuple[float, float]
    """Smallest and largest ``|value|``."""
    mean_abs_update: Optional[float]
    """The optimizer's intended ``|update|`` per element, on average; None when its state does not say it."""

    @property
    def spacing(self) -> float:
        """The spacing of the param's dtype at its mean ``|value|``: updates below half of it round away."""
        return dtype_spacing(self.mean_abs_value, self.dtype)


def dtype_spacing(value: float, dtype: torch.dtype) -> float:
    """The distance between ``value`` and the next larger number of ``dtype`` (``value > 0``)."""
    if value <= 0:
        return 0.0
    return 2.0 ** math.floor(math.log2(value)) * torch.finfo(dtype).eps


class StalledUpdates:
    """The measurement around one optimizer step. ``named_params()``: the params to watch by canonical name, read
    when a step is measured (FSDP2 swaps a root module's unsharded params back for the sharded ones only in the
    backward after a forward, so the objects a model holds change); the trainable ones in a low-precision dtype are
    measured (one kept fp32 loses nothing to rounding)."""

    def __init__(self, named_params: Callable[[], Iterable[Tuple[str, nn.Parameter]]]) -> None:
        self.named_params = named_params
        self.params: List[Tuple[str, nn.Parameter]] = []
        self._before: Optional[List[Optional[Tensor]]] = None

    def before_step(self, optimizer: Optional[Optimizer] = None) -> None:
        """Copy each param's local shard (under ``bf16_updates="kahan"``, in fp32 with its compensation added: the
        value it stands for), NaN where its gradient is zero (or absent)."""
        self.params = [(n, p) for n, p in self.named_params() if p.requires_grad and p.dtype in LOW_PRECISION]
        methods = bf16_update_methods(optimizer) if optimizer is not None else {}
        copies: List[Optional[Tensor]] = []
        for _, param in self.params:
            if param.grad is None:
                copies.append(None)
                continue
            value, grad = _measured(param, optimizer, methods), local_tensor(param.grad)
            copies.append(torch.where(grad != 0, value, torch.full_like(value, float("nan"))))
        self._before = copies

    @property
    def pending(self) -> bool:
        return self._before is not None

    def after_step(self, optimizer: Optimizer) -> List[StalledShare]:
        """The shares of this step, the same on every rank (one all-reduce when a process group runs)."""
        assert self._before is not None, "after_step without before_step"
        counts = torch.zeros(len(self.params), FIELDS, dtype=torch.float64)
        per_element = _intended_updates(optimizer)
        methods = bf16_update_methods(optimizer)
        for index, ((_, param), before) in enumerate(zip(self.params, self._before, strict=True)):
            if before is None:
                continue
            value = local_tensor(param.detach())
            eligible = ~torch.isnan(before)
            magnitude = value.abs().double()
            intended = per_element.get(id(param))
            update = intended.sum() if intended is not None else None
            if methods.get(id(param)) == "stochastic" and intended is not None:
                # rounded at random, an element moves by its update in expectation: stalled only if that is zero
                unchanged = (eligible & (intended == 0)).sum().double()
            else:
                unchanged = (_measured(param, optimizer, methods) == before).sum().double()
            counts[index] = torch.stack(
                [
                    unchanged,
                    eligible.sum().double(),
                    magnitude.sum(),
                    magnitude.max() if magnitude.numel() else torch.zeros((), dtype=torch.float64),
                    -magnitude.min() if magnitude.numel() else torch.full((), -math.inf, dtype=torch.float64),
                    update if update is not None else torch.full((), math.nan, dtype=torch.float64),
                ]
            )
        self._before = None
        numel = torch.tensor([float(local_tensor(p.detach()).numel()) for _, p in self.params], dtype=torch.float64)
        counts, numel = _summed(counts, numel)
        return [self._share(name, param, counts[index], numel[index]) for index, (name, param) in
                enumerate(self.params) if counts[index, 1] > 0]  # fmt: skip

    @staticmethod
    def _share(name: str, param: Tensor, row: Tensor, numel: Tensor) -> StalledShare:
        stalled, eligible, total, largest, smallest, update = row.tolist()
        return StalledShare(
            name=name,
            dtype=param.dtype,
            share=stalled / eligible,
            eligible=int(eligible),
            mean_abs_value=total / float(numel),
            value_range=(-smallest, largest),
            mean_abs_update=None if math.isnan(update) else update / float(numel),
        )


def _summed(counts: Tensor, numel: Tensor) -> Tuple[Tensor, Tensor]:
    """Sums over the ranks (max for the largest value, and for the negated smallest)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts, numel
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    summed = torch.cat([counts[:, [0, 1, 2, 5]], numel[:, None]], dim=1).to(device)
    extremes = counts[:, [3, 4]].to(device)
    dist.all_reduce(summed)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    summed, extremes = summed.cpu(), extremes.cpu()
    counts = torch.stack(
        [summed[:, 0], summed[:, 1], summed[:, 2], extremes[:, 0], extremes[:, 1], summed[:, 3]], dim=1
    )
    return counts, summed[:, 4]


def _measured(param: Tensor, optimizer: Optional[Optimizer], methods: Dict[int, str]) -> Tensor:
    """The local value a step moves: the param's, plus its compensation under ``bf16_updates="kahan"``."""
    value = local_tensor(param.detach())
    if optimizer is None or methods.get(id(param)) != "kahan":
        return value
    compensation = optimizer.state.get(param, {}).get("compensation")
    if not isinstance(compensation, Tensor):
        return value.float()
    return value.float() + local_tensor(compensation).float()


def _intended_updates(optimizer: Optimizer) -> Dict[int, Tensor]:
    """The intended ``|update|`` of each param's local elements, from the optimizer's state after its step: Adam and
    AdamW (bias-corrected moments), SGD (``lr * |grad|``, momentum's buffer when it has one)."""
    updates: Dict[int, Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            lr = float(group["lr"])
            if "exp_avg" in state and "exp_avg_sq" in state:
                step = float(state["step"])
                beta1, beta2 = group["betas"]
                m_hat = local_tensor(state["exp_avg"]).double() / (1 - beta1**step)
                v_hat = local_tensor(state["exp_avg_sq"]).double() / (1 - beta2**step)
                updates[id(param)] = (lr * m_hat / (v_hat.sqrt() + group["eps"])).abs()
            elif "momentum_buffer" in state and state["momentum_buffer"] is not None:
                updates[id(param)] = lr * local_tensor(state["momentum_buffer"]).double().abs()
            elif param.grad is not None and isinstance(optimizer, torch.optim.SGD):
                updates[id(param)] = lr * local_tensor(param.grad).double().abs()
    return updates
