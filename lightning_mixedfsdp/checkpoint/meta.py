"""Models built on the meta device: each module initialised by the model's own init, streamed into the shards.

Rank 0 walks an unsharded meta template in the order a single process initialises it, materialises one chunk at a
time on its CPU (a wrap unit, or one module outside the units), initialises it, and streams it into every rank's
shards (``checkpoint/stream.py``) before freeing it. The values equal a single-process :func:`init_meta_module_` with
the same seed, on CPU and on CUDA alike (DTensor's own RNG would give each shard other values than one process).

- Hugging Face models are initialised by HF itself: ``PreTrainedModel._initialize_weights`` per module, in the order
  of ``initialize_weights`` (children before parents, each module by its innermost PreTrainedModel), inside HF's
  ``guard_torch_init_functions``; tied weights are tied again afterwards. Rotary embeddings recompute ``inv_freq``.
- Other modules keep ``reset_parameters()``, called in module order.
- Every tensor is filled with a sentinel (NaN) before its init runs; one left untouched raises an error that names
  its module and says what to add. Non-persistent buffers travel with their chunk: they are never left empty.
"""

import copy
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.stream import stream_into
from lightning_mixedfsdp.sharding.matching import is_within
from lightning_mixedfsdp.sharding.names import canonical_name, user_class_name

Init = Optional[Callable[[nn.Module], None]]
InitStep = Tuple[str, nn.Module, Init]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def meta_template(module: nn.Module) -> nn.Module:
    """An unsharded copy of a meta module (cheap: meta tensors hold no data)."""
    return copy.deepcopy(module)


def init_order(model: nn.Module) -> List[InitStep]:
    """(canonical name, module, its init) in the order one process initialises ``model``."""
    steps: List[InitStep] = []
    _walk(model, "", steps)
    return steps


def _walk(module: nn.Module, prefix: str, steps: List[InitStep]) -> None:
    if _is_hf(module):
        _walk_hf(module, prefix, module, module.is_custom_code(), steps)
        return
    reset = (lambda m: m.reset_parameters()) if callable(getattr(module, "reset_parameters", None)) else None
    steps.append((prefix, module, _adapter_init(module) or reset))
    for name, child in module.named_children():
        _walk(child, _join(prefix, name), steps)


def _walk_hf(module: nn.Module, prefix: str, owner: nn.Module, is_custom_code: bool, steps: List[InitStep]) -> None:
    """``PreTrainedModel.initialize_weights``' order (transformers 5: ``smart_apply``): children first, each module by
    its innermost PreTrainedModel's ``_initialize_weights``."""
    for name, child in module.named_children():
        _walk_hf(child, _join(prefix, name), child if _is_hf(child) else owner, is_custom_code, steps)
    initialize = owner._initialize_weights
    steps.append((prefix, module, _adapter_init(module) or (lambda m: initialize(m, is_custom_code))))


def _adapter_init(module: nn.Module) -> Init:
    """peft's own init for a LoRA layer (A as nn.Linear's default, B zero), after its children got theirs: an
    untrained adapter leaves the base model's output unchanged."""
    if not callable(getattr(module, "reset_lora_parameters", None)):
        return None
    return lambda layer: [layer.reset_lora_parameters(adapter, True) for adapter in layer.lora_A]


def init_meta_module_(module: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Materialise and initialise a meta module in one process, by the model's own init: the reference the sharded
    meta init reproduces value for value."""
    steps = init_order(module)
    module.to_empty(device=device)
    with _init_context(module), torch.no_grad():
        for _, owner, _init in steps:
            _fill_sentinels(owner)
        for _, owner, init in steps:
            if init is not None:
                init(owner)
        _tie_again(module)
    problem = _uninitialised([(name, owner, _own_tensors(owner)) for name, owner, _ in steps], _is_hf_anywhere(module))
    if problem:
        raise RuntimeError(problem)
    return module


def materialize_sharded(
    sharded: nn.Module,
    template: Optional[nn.Module],
    units: Sequence[str],
    device: torch.device,
    initialise: bool,
) -> None:
    """Allocate the local shards of a model sharded on meta and fill them from rank 0's template, chunk by chunk.

    With ``initialise`` every param and buffer is initialised; without it (a load follows) only the non-persistent
    buffers, which no checkpoint holds. Rank 0 passes the unsharded meta ``template``; the others pass None.
    """
    import torch.distributed as dist

    sharded.to_empty(device=device)
    chunks = _plan_chunks(template, units, initialise) if template is not None else []
    names = [[chunk.names for chunk in chunks]]
    dist.broadcast_object_list(names, src=0)
    stream_into(sharded, names[0], _produce(template, chunks) if template is not None else None)


@dataclass
class _Chunk:
    """Modules materialised and initialised together on rank 0, and the tensors that then travel."""

    steps: List[InitStep] = field(default_factory=list)
    names: List[str] = field(default_factory=list)


def _plan_chunks(template: nn.Module, units: Sequence[str], initialise: bool) -> List[_Chunk]:
    """One chunk per outermost wrap unit (its modules are consecutive in the init order) and one per module outside
    the units; without ``initialise``, one per module holding non-persistent buffers, carrying only those."""
    outermost = [u for u in units if not any(u != o and is_within(u, o) for o in units)]
    chunks: List[_Chunk] = []
    current: Any = object()
    for name, module, init in init_order(template):
        if initialise:
            key: Any = next((u for u in outermost if is_within(name, u)), ("module", name))
            travelling = [_join(name, n) for n, _ in _own_tensors(module)]
        else:
            key = ("module", name)
            travelling = [_join(name, n) for n in sorted(module._non_persistent_buffers_set)]
            if not travelling:
                continue
        if key != current:
            chunks.append(_Chunk())
            current = key
        chunks[-1].steps.append((name, module, init))
        chunks[-1].names.extend(canonical_name(n) for n in travelling)
    return chunks


def _produce(template: nn.Module, chunks: List[_Chunk]) -> Iterator[Tuple[Optional[str], Dict[str, Tensor]]]:
    """Rank 0: materialise, initialise, check and hand over one chunk at a time, then free it."""
    hf = _is_hf_anywhere(template)
    with _init_context(template), torch.no_grad():
        for chunk in chunks:
            for _, module, _init in chunk.steps:
                _materialise(module, torch.device("cpu"))
                _fill_sentinels(module)
            for _, module, init in chunk.steps:
                if init is not None:
                    init(module)
            own = [(name, module, _own_tensors(module)) for name, module, _ in chunk.steps]
            tensors = {canonical_name(_join(name, n)): t for name, _, owned in own for n, t in owned}
            yield _uninitialised(own, hf, wanted=set(chunk.names)), tensors
            for _, module, _init in chunk.steps:
                _materialise(module, torch.device("meta"))


def _materialise(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` for the module's own params and buffers only (children stay as they are)."""
    for name, param in module._parameters.items():
        if param is not None:
            empty = torch.empty_like(param, device=device)
            module._parameters[name] = nn.Parameter(empty, requires_grad=param.requires_grad)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[name] = torch.empty_like(buffer, device=device)


def _own_tensors(module: nn.Module) -> List[Tuple[str, Tensor]]:
    params = [(n, p) for n, p in module._parameters.items() if p is not None]
    return params + [(n, b) for n, b in module._buffers.items() if b is not None]


def _fill_sentinels(module: nn.Module) -> None:
    for _, tensor in _own_tensors(module):
        sentinel = _sentinel(tensor.dtype)
        if sentinel is not None and not tensor.is_meta:
            tensor.data.fill_(sentinel)


def _sentinel(dtype: torch.dtype) -> Optional[float]:
    if dtype.is_floating_point:
        return math.nan
    if dtype == torch.bool or dtype.is_complex:
        return None
    return torch.iinfo(dtype).min


def _uninitialised(
    owned: Sequence[Tuple[str, nn.Module, List[Tuple[str, Tensor]]]], hf: bool, wanted: Optional[set] = None
) -> Optional[str]:
    """The error for tensors an init left at their sentinel, naming each module and the fix; None when all are set."""
    missing = []
    for module_name, module, tensors in owned:
        for name, tensor in tensors:
            full_name = canonical_name(_join(module_name, name))
            sentinel = _sentinel(tensor.dtype)
            if sentinel is None or (wanted is not None and full_name not in wanted):
                continue
            left = tensor.isnan() if math.isnan(sentinel) else tensor == sentinel
            if bool(left.any()):
                missing.append(f"{full_name} ({user_class_name(module)})")
    if not missing:
        return None
    fix = "a branch for the class in the model's `_init_weights`" if hf else "a `reset_parameters()` method"
    return (
        f"mixed_fsdp2 meta init: {len(missing)} tensor(s) were left uninitialised, because no init of the model"
        f" covers them: {', '.join(missing[:10])}{'...' if len(missing) > 10 else ''}. Give each class {fix}, or"
        " build the model on a real device instead of the meta device."
    )


def _tie_again(module: nn.Module) -> None:
    """``to_empty`` allocated tied weights one by one; HF ties them again, as its own ``init_weights`` does."""
    for submodule in module.modules():
        if _is_hf(submodule):
            submodule.tie_weights()
            return


def _init_context(module: nn.Module) -> ContextManager:
    if not _is_hf_anywhere(module):
        return nullcontext()
    from transformers import initialization

    return initialization.guard_torch_init_functions()


def _is_hf(module: nn.Module) -> bool:
    # a model built from transformers has imported it: no import (seconds) for other models
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def _is_hf_anywhere(module: nn.Module) -> bool:
    return any(_is_hf(m) for m in module.modules())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
