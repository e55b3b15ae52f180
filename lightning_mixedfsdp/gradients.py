"""Gradient reduction for replicated params, and gradient-norm clipping over mixed placements and dtypes."""

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn


class ReplicatedGradReducer:
    """Averages the grads of replicated params over all data-parallel ranks once per backward.

    One all-reduce per grad dtype, each bucket carrying a presence flag per param, so a param that got no grad on some
    rank (an unused expert) is averaged as zero there, and one that got no grad anywhere keeps ``grad=None``. Every
    rank issues the same collectives whatever its grads, so nothing deadlocks.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any) -> None:
        self._buckets: Dict[torch.dtype, List[nn.Parameter]] = {}
        for param in params:
            if param.requires_grad:
                self._buckets.setdefault(param.dtype, []).append(param)
        self._group = group
        self.requires_gradient_sync = True
        self._callback_queued = False

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def attach(self, root: nn.Module) -> None:
        """Reduce at the end of every backward that flows through ``root``'s outputs."""
        if self._buckets:
            root.register_forward_hook(self._hook_outputs)

    @torch.no_grad()
    def reduce(self) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for params in self._buckets.values():
            locals_ = [p.grad.to_local() if p.grad is not None else None for p in params]
            flags = torch.tensor(
                [g is not None for g in locals_], dtype=params[0].dtype, device=_local(params[0]).device
            )
            grads = [g if g is not None else _local(p).new_zeros(p.shape) for g, p in zip(locals_, params, strict=True)]
            flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self._group)
            # the flags are read on the host only when this rank lacks a grad: no device sync in the common case
            missing = any(g is None for g in locals_)
            present = flat[-len(params) :].tolist() if missing else [1.0] * len(params)
            offset = 0
            for param, local, anywhere in zip(params, locals_, present, strict=True):
                chunk = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                if local is not None:
                    local.copy_(chunk)
                elif anywhere > 0:
                    param.grad = DTensor.from_local(chunk.clone(), param.device_mesh, param.placements, run_check=False)

    def _hook_outputs(self, _module: nn.Module, _args: Any, output: Any) -> None:
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, _grad: Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            _queue_after_backward(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if self.requires_gradient_sync:
            self.reduce()


def _queue_after_backward(callback: Any) -> None:
    # Private engine API, checked on torch 2.13.0; FSDP2 queues its own post-backward callback the same way.
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def tensors_in(obj: Any) -> Iterable[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placement_key(param: Tensor) -> Tuple[Any, Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.device_mesh, tuple(param.placements)
    return None, None


@torch.no_grad()
def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The global grad norm in fp32, identical on every rank.

    Grads are grouped by (mesh, placements); each group's local contribution is reduced over the mesh dims it is
    sharded on, then the groups are combined. Params without a grad contribute zero, so every rank issues the same
    collectives.
    """
    import torch.distributed as dist

    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    contributions: Dict[Tuple[Any, Any], Tensor] = {}
    for param in parameters:
        key = _placement_key(param)
        grad = param.grad
        local = _local(grad) if grad is not None else None
        device = _local(param).device
        if local is None or local.numel() == 0:
            value = torch.zeros((), dtype=torch.float32, device=device)
        else:
            value = torch.linalg.vector_norm(local, norm_type, dtype=torch.float32)
            value = value if is_inf else value.pow(norm_type)
        previous = contributions.get(key)
        contributions[key] = (
            value if previous is None else (torch.maximum(previous, value) if is_inf else previous + value)
        )

    total: Optional[Tensor] = None
    for (mesh, placements), value in contributions.items():
        if mesh is not None:
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():
                    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                    dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = value if total is None else (torch.maximum(total, value) if is_inf else total + value)
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for grads that mix Shard/Replicate placements, meshes and dtypes."""
    params = [p for p in parameters]
    total = total_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite ({total.item()}), so it cannot be"
            " clipped. Set `error_if_nonfinite=False` to clip anyway."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            local = _local(param.grad)
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
    return total
