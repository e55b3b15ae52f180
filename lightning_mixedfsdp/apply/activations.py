"""What a keep-fp32 region keeps for backward: never an fp32 copy of an input that arrived in bf16.

- :func:`narrow_saves` (the default): autograd saves the region's fp32 upcast of a bf16 input as the bf16 input
  itself and casts it up again in backward. bf16 -> fp32 is exact, so the math is bit for bit the same, and an HF
  RMSNorm keeps the bytes a bf16 one keeps (it upcasts its input itself). No recompute, one cast per saved use.
- :func:`recomputed` (``recompute_keep_fp32_modules=True``): the region keeps only its inputs and is re-run in
  backward. ``torch.utils.checkpoint`` (non-reentrant) costs a few hundred microseconds of Python per call, so in
  eager mode a small autograd function does it (same RNG state, same kernels on the same values); under
  ``torch.compile`` the region goes through ``torch.utils.checkpoint``, which dynamo traces as one op. Like
  reentrant checkpointing, the region's param grads are accumulated by an inner ``backward``, so
  ``torch.autograd.grad`` over them is not supported (``loss.backward()`` is).

Both compose with saved-tensor hooks already in force (a user's CPU offload, an activation checkpoint's): what
they pack is then the bf16 input. Inside an activation checkpoint the recompute is skipped (the unit is recomputed
already).
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mixedfsdp.compat.torch import (
    active_saved_tensor_hooks,
    inside_activation_checkpoint,
    tree_flatten,
    tree_unflatten,
)

Region = Callable[[nn.Module, Tuple[Any, ...], dict], Any]


@dataclass
class _Narrow:
    """A saved fp32 upcast, kept as (what the hooks in force packed of) the input it was cast from."""

    packed: Any
    dtype: torch.dtype
    version: Optional[int]
    """The input's version when saved; None when other hooks own what is kept (a checkpoint recomputes it)."""
    wide: Optional[Tensor] = None
    """The upcast again, made by the first unpack and shared by the others (one cast per backward, not per use)."""


class narrow_saves:
    """While inside, a tensor autograd saves that is one of the ``(narrow, wide)`` pairs' ``wide`` upcast is kept as
    ``narrow`` and cast up in backward; other saved tensors go to the hooks in force, if any. A no-op under
    torch.compile (its partitioner chooses what to save). ``owner`` names the module in errors.

    Autograd keeps the pack hook as long as what it saved, so the hook must not hold the upcasts: the pairs are
    dropped on leaving, or the fp32 copies would live until backward. A class rather than a generator context, and a
    pack hook that first asks whether the saved tensor is the upcast object itself: it runs for every tensor a
    keep-fp32 module saves, in every eager step.
    """

    __slots__ = ("_owner", "_pairs", "_saved_wide", "_outer_pack", "_outer_unpack", "_outer", "_hooks")

    def __init__(self, upcasts: Sequence[Tuple[Tensor, Tensor]], owner: str) -> None:
        self._owner = owner
        self._pairs = list(upcasts)
        self._saved_wide: List[Tuple[Tensor, int, _Narrow]] = []
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._outer = False
        self._outer_pack: Callable[[Tensor], Any] = _identity
        self._outer_unpack: Callable[[Any], Tensor] = _identity

    def __enter__(self) -> None:
        if not self._pairs or torch.compiler.is_compiling():
            return
        outer = active_saved_tensor_hooks()
        if outer is not None:
            self._outer = True
            self._outer_pack, self._outer_unpack = outer
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self._hooks is None:
            return
        try:
            self._hooks.__exit__(None, None, None)
            if kind is None and any(wide._version != version for wide, version, _ in self._saved_wide):
                raise RuntimeError(
                    f"mixed_fsdp2: {self._owner} modified its upcast input in place after autograd saved it; its"
                    " gradient would be wrong. Set recompute_keep_fp32_modules=True, or keep_fp32_modules without"
                    " this module."
                )
        finally:
            self._pairs.clear()
            self._saved_wide.clear()

    def _pack(self, tensor: Tensor) -> Any:
        for narrow, wide in self._pairs:
            if tensor is wide or _same_tensor(tensor, wide):
                # several ops save the same upcast (an RMSNorm's pow and mul): one record, cast up once in backward
                for seen, _, record in self._saved_wide:
                    if seen is wide:
                        return record
                version = None if self._outer else narrow._version
                record = _Narrow(self._outer_pack(narrow), wide.dtype, version)
                self._saved_wide.append((wide, wide._version, record))
                return record
        return self._outer_pack(tensor)

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Narrow):
            return self._outer_unpack(saved)
        if saved.wide is None:
            narrow = self._outer_unpack(saved.packed)
            if saved.version is not None and narrow._version != saved.version:
                raise RuntimeError(
                    f"mixed_fsdp2: the input of {self._owner} was modified in place after its forward, so its"
                    " gradient cannot be computed (autograd's own error for a saved tensor). Avoid the in-place op"
                    " on it."
                )
            saved.wide = narrow.to(saved.dtype)
        return saved.wide


def _identity(value: Any) -> Any:
    return value


def _same_tensor(tensor: Tensor, other: Tensor) -> bool:
    """The same values in the same memory (another Python object viewing it): cheapest checks first."""
    return (
        tensor.dtype == other.dtype
        and tensor.shape == other.shape
        and tensor.storage_offset() == other.storage_offset()
        and tensor.stride() == other.stride()
        and tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
    )


def recomputed(region: Region, module: nn.Module, args: Tuple[Any, ...], kwargs: dict) -> Any:
    """``region(module, args, kwargs)``, its activations recomputed in backward (not inside an activation
    checkpoint, which recomputes the unit already)."""
    if torch.compiler.is_compiling():
        return checkpoint(region, module, args, kwargs, use_reentrant=False)
    if inside_activation_checkpoint():
        return region(module, args, kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    outputs = _Outputs()
    tensors = _RecomputedRegion.apply(region, module, leaves, spec, positions, outputs, *(leaves[i] for i in positions))
    return outputs.rebuild(tensors)


class _Outputs:
    """How the region's output is laid out (the autograd function returns its tensors only)."""

    def __init__(self) -> None:
        self.leaves: List[Any] = []
        self.spec: Any = None
        self.positions: List[int] = []

    def split(self, output: Any) -> Tuple[Tensor, ...]:
        self.leaves, self.spec = tree_flatten(output)
        self.positions = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, Tensor)]
        return tuple(self.leaves[i] for i in self.positions)

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors, strict=True):
            leaves[position] = tensor
        return tree_unflatten(leaves, self.spec)


class _RecomputedRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        region: Region,
        module: nn.Module,
        leaves: List[Any],
        spec: Any,
        positions: List[int],
        outputs: _Outputs,
        *tensors: Tensor,
    ) -> Tuple[Tensor, ...]:
        ctx.region, ctx.module, ctx.leaves, ctx.spec, ctx.positions = region, module, leaves, spec, positions
        ctx.rng = _RngStash(tensors)
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            result = outputs.split(region(module, *_call_args(leaves, spec, positions, tensors)))
        ctx.mark_non_differentiable(*(t for t in result if not t.is_floating_point()))
        return result

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with ctx.rng.restored(), torch.enable_grad():
            output = ctx.region(ctx.module, *_call_args(ctx.leaves, ctx.spec, ctx.positions, inputs))
        leaves, _ = tree_flatten(output)
        pairs = [
            (tensor, grad)
            for tensor, grad in zip((x for x in leaves if isinstance(x, Tensor)), grads, strict=True)
            if grad is not None and tensor.requires_grad
        ]
        if pairs:
            torch.autograd.backward([tensor for tensor, _ in pairs], [grad for _, grad in pairs])
        return (None, None, None, None, None, None, *(x.grad if x.requires_grad else None for x in inputs))


def _call_args(leaves: List[Any], spec: Any, positions: List[int], tensors: Sequence[Tensor]) -> Tuple[Any, dict]:
    leaves = list(leaves)
    for position, tensor in zip(positions, tensors, strict=True):
        leaves[position] = tensor
    args, kwargs = tree_unflatten(leaves, spec)
    return args, kwargs


class _RngStash:
    """The CPU and CUDA generator states at forward, put back for the recompute (a region with dropout recomputes
    the same mask), and the states of the moment restored after it."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.cpu = torch.get_rng_state()
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        self.cuda = (device, torch.cuda.get_rng_state(device)) if device is not None else None

    def restored(self) -> "_RngStash":
        return self

    def __enter__(self) -> None:
        self._now_cpu = torch.get_rng_state()
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            device, state = self.cuda
            self._now_cuda = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *_: Any) -> None:
        torch.set_rng_state(self._now_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self._now_cuda, self.cuda[0])
