"""Modules the plan singles out, adapted by class: dtype boundaries and local views of replicated params.

- **Dtype boundary**: a module computing in another dtype than its caller (a keep-fp32 norm among bf16 blocks)
  gets its floating inputs cast to its compute dtype and its outputs cast back. Autograd saves the bf16 input
  instead of its fp32 upcast (``activations.py``: bit for bit the same math, no fp32 copy of the activation kept);
  with ``recompute`` the whole region is recomputed in backward instead.
- **fp32 compute** (``dtypes.fp32_compute_modules``): an ``nn.Linear`` stored and gathered in its group's dtype
  multiplies in fp32 (weight, bias and input upcast after the all-gather) and returns fp32: an LM head's logits.
- **Local views**: a replicated param is a Replicate DTensor in ``_parameters`` (what optimizers, clipping and DCP
  see); reading the attribute (``norm.weight``) gives its local tensor in the compute dtype, which unmodified module
  code (HF's included) can mix with plain activations. In eager mode that is the DTensor's own local tensor as an
  autograd leaf (no DTensor autograd function per read and per backward); its grad reaches ``param.grad`` through
  the reducer (``replicate.py``).

Both are one subclass of the module's own class per (class, adaptation), shared by every block, with the same name:
no hooks, no per-module state. ``torch.compile`` sees the same code and guards in every layer (N identical layers
compile to one graph) and traces it without a break; an activation-checkpoint recompute re-runs it like any forward.
FSDP's own dynamic class subclasses this one when the module is sharded afterwards.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mixedfsdp.apply.activations import narrow_saves, recomputed
from lightning_mixedfsdp.compat.torch import dtensor_storage, own_parameter
from lightning_mixedfsdp.model.tensors import cast_floating, map_tensors


@dataclass(frozen=True)
class Boundary:
    """Inputs cast to ``compute``, outputs to ``output`` (None: left as computed); ``recompute`` the region in
    backward instead of saving its activations."""

    compute: torch.dtype
    output: Optional[torch.dtype]
    recompute: bool = True


@dataclass(frozen=True)
class Adaptation:
    boundary: Optional[Boundary] = None
    views: Tuple[Tuple[str, torch.dtype], ...] = ()
    """(attribute, compute dtype) of each replicated param the module owns."""
    fp32_compute: bool = False
    """An ``nn.Linear`` that multiplies in fp32: its (gathered) weight, bias and input upcast, its output fp32."""

    def merged(self, other: "Adaptation") -> "Adaptation":
        views = tuple(sorted({*self.views, *other.views}))
        return Adaptation(other.boundary or self.boundary, views, self.fp32_compute or other.fp32_compute)


class ClassRestore:
    """Undoes an adaptation (the ``remove()`` of a hook handle, so the applied plan keeps one list)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def remove(self) -> None:
        original = original_class(self._module)
        if original is not type(self._module) and not _is_fsdp_class(type(self._module)):
            self._module.__class__ = original


def adapt(module: nn.Module, adaptation: Adaptation) -> ClassRestore:
    """Give ``module`` the class of ``adaptation`` (merged with one it already has). Before ``fully_shard`` of the
    module itself: FSDP's class then subclasses this one."""
    if _is_fsdp_class(type(module)):
        raise RuntimeError(f"mixed_fsdp2: {type(module).__name__} is sharded already; adapt modules before sharding")
    current = getattr(type(module), "_mixed_fsdp_adaptation", Adaptation())
    module.__class__ = _adapted_class(original_class(module), current.merged(adaptation))
    return ClassRestore(module)


def original_class(module: nn.Module) -> type:
    """The module's own class under FSDP's and our adaptations."""
    return next(c for c in type(module).__mro__ if "_mixed_fsdp_adaptation" not in c.__dict__ and not _is_fsdp_class(c))


def is_adapted(module: nn.Module) -> bool:
    return hasattr(type(module), "_mixed_fsdp_adaptation")


_CLASSES: Dict[Tuple[type, Adaptation], type] = {}


def _adapted_class(cls: type, adaptation: Adaptation) -> type:
    key = (cls, adaptation)
    if key not in _CLASSES:
        namespace: Dict[str, Any] = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_mixed_fsdp_adaptation": adaptation,
        }
        namespace.update({name: property(_local_view(name, dtype)) for name, dtype in adaptation.views})
        if adaptation.boundary is not None:
            namespace["forward"] = _boundary_forward(cls.forward, adaptation.boundary)  # type: ignore[attr-defined]
        if adaptation.fp32_compute:
            namespace["forward"] = _fp32_linear_forward
        _CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _CLASSES[key]


def _local_view(name: str, dtype: torch.dtype) -> Any:
    def get(module: nn.Module) -> Tensor:
        local = replica_local(own_parameter(module, name))
        # an autograd-tracked cast: the grad arrives in the storage dtype, as with FSDP's param_dtype
        return local if local.dtype == dtype else local.to(dtype)

    return get


def replica_local(param: Optional[Tensor]) -> Tensor:
    """What module code reads for a replicated param. Eager: the DTensor's own local tensor, an autograd leaf whose
    grad the reducer moves into ``param.grad`` (``replicate.py``). Compiled: ``to_local()``, which dynamo traces into
    the graph. A plain tensor (rank 0's full value while it initialises a meta model) as it is."""
    from torch.distributed.tensor import DTensor

    assert param is not None
    if not isinstance(param, DTensor):
        return param
    if torch.compiler.is_compiling():
        return param.to_local()
    local = dtensor_storage(param)
    if local.requires_grad != param.requires_grad:
        # set here, not once: materialising a meta model (to_empty) or a load swaps in another local tensor, and a
        # user may freeze or unfreeze the param
        local.requires_grad_(param.requires_grad)
    return local


def _boundary_forward(forward: Any, boundary: Boundary) -> Any:
    def run(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        # the region runs with its compute dtype as the default dtype: tensors it creates are in the dtype it
        # computes in, and a recompute in backward (outside Lightning's bf16 forward context) creates the same ones
        previous = torch.get_default_dtype()
        torch.set_default_dtype(boundary.compute)
        try:
            upcasts: List[Tuple[Tensor, Tensor]] = []

            def cast_in(tensor: Tensor) -> Tensor:
                if not tensor.is_floating_point() or tensor.dtype == boundary.compute:
                    return tensor
                wide = tensor.to(boundary.compute)
                if wide.element_size() > tensor.element_size():
                    upcasts.append((tensor, wide))
                return wide

            if not kwargs and all(isinstance(arg, Tensor) for arg in args):  # a norm's (hidden_states,)
                args = tuple(cast_in(arg) for arg in args)
            else:
                args, kwargs = map_tensors((args, kwargs), cast_in)
            with narrow_saves(upcasts, type(module).__name__):
                output = forward(module, *args, **kwargs)
            if boundary.output is None:
                return output
            if isinstance(output, Tensor):
                return output.to(boundary.output) if output.is_floating_point() else output
            return cast_floating(output, boundary.output)
        finally:
            torch.set_default_dtype(previous)

    def adapted_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if boundary.recompute and torch.is_grad_enabled():
            return recomputed(run, self, args, kwargs)
        return run(self, args, kwargs)

    return adapted_forward


def _fp32_linear_forward(self: nn.Linear, input: Tensor) -> Tensor:
    # the weight read here is what FSDP gathered (the group's compute dtype): upcast after the all-gather, so storage,
    # sharding and communication stay the group's; autocast off, or it would cast the matmul back down
    bias = self.bias.float() if self.bias is not None else None
    with torch.autocast(input.device.type, enabled=False):
        return F.linear(input.float(), self.weight.float(), bias)


def _is_fsdp_class(cls: type) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return issubclass(cls, FSDPModule)


def adapted_modules(model: nn.Module) -> List[str]:
    """Names of the modules of ``model`` that carry an adaptation."""
    return [name for name, module in model.named_modules() if is_adapted(module)]
