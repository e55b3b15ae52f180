"""Models built on the meta device: each module initialised by the model's own init, streamed into the shards.

After sharding, rank 0 walks the model in the order a single process initialises it, one chunk at a time (a wrap
unit, or one module outside the units): it swaps full-size CPU tensors into the chunk's modules (in the dtypes the
model was built with, since random draws depend on the dtype), runs their init, streams the values into every
rank's shards (``materialize/stream.py``) and swaps the shards back. No copy of the model is made, so this works
whoever sharded it: our plan, a ``parallelize_fn`` that calls ``fully_shard`` or applies tensor parallelism, or a
Trainer ``configure_model``. The values equal a single-process :func:`init_meta_module_` with
the same seed, on CPU and on CUDA alike (DTensor's own RNG would give each shard other values than one process).

- Hugging Face models are initialised by HF itself: ``PreTrainedModel._initialize_weights`` per module, in the order
  of ``initialize_weights`` (children before parents, each module by its innermost PreTrainedModel), inside HF's
  ``guard_torch_init_functions``; tied weights are tied again afterwards. Rotary embeddings recompute ``inv_freq``.
- Other modules keep ``reset_parameters()``, called in module order.
- Every tensor is filled with a sentinel (NaN) before its init runs; one left untouched raises an error that names
  its module and says what to add. Non-persistent buffers travel with their chunk: they are never left empty.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ContextManager,
    Dict,
    Generator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
)

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.compat.torch import (
    non_persistent_buffer_names,
    own_buffers,
    own_parameters,
    replace_buffer,
    replace_parameter,
)
from lightning_mixedfsdp.materialize.stream import stream_into
from lightning_mixedfsdp.model.names import (
    canonical_name,
    is_hf_model,
    is_within,
    join_name,
    user_class,
    user_class_name,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Init = Optional[Callable[[nn.Module], None]]
InitStep = Tuple[str, nn.Module, Init]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def init_order(model: nn.Module) -> List[InitStep]:
    """(canonical name, module, its init) in the order one process initialises ``model``."""
    steps: List[InitStep] = []
    _walk(model, "", steps)
    return steps


def _walk(module: nn.Module, prefix: str, steps: List[InitStep]) -> None:
    if is_hf_model(module):
        # asked of the model's own class: FSDP's dynamic `FSDP<Name>` subclass lives in torch, and HF would take it
        # for custom code and skip the init of every module without params of its own
        _walk_hf(module, prefix, module, user_class(module).is_custom_code(), steps)  # type: ignore[attr-defined]
        return
    reset_parameters = getattr(module, "reset_parameters", None)
    reset: Init = (lambda _: reset_parameters()) if callable(reset_parameters) else None
    steps.append((prefix, module, _adapter_init(module) or reset))
    for name, child in module.named_children():
        _walk(child, canonical_name(join_name(prefix, name)), steps)


def _walk_hf(
    module: nn.Module, prefix: str, owner: "PreTrainedModel", is_custom_code: bool, steps: List[InitStep]
) -> None:
    """``PreTrainedModel.initialize_weights``' order (transformers 5: ``smart_apply``): children first, each module by
    its innermost PreTrainedModel's ``_initialize_weights``."""
    for name, child in module.named_children():
        child_prefix = canonical_name(join_name(prefix, name))
        _walk_hf(child, child_prefix, child if is_hf_model(child) else owner, is_custom_code, steps)
    initialize = owner._initialize_weights
    steps.append((prefix, module, _adapter_init(module) or (lambda m: initialize(m, is_custom_code))))


def _adapter_init(module: nn.Module) -> Init:
    """peft's own init for a LoRA layer (A as nn.Linear's default, B zero), after its children got theirs: an
    untrained adapter leaves the base model's output unchanged."""
    reset = getattr(module, "reset_lora_parameters", None)
    if not callable(reset):
        return None

    def init(layer: nn.Module) -> None:
        for adapter in cast(nn.ModuleDict, layer.lora_A):  # adapter names
            reset(adapter, True)

    return init


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
    units: Sequence[str],
    device: torch.device,
    initialise: bool,
    dtypes: Optional[Dict[str, torch.dtype]] = None,
    rng_state: Optional[Tensor] = None,
) -> None:
    """Allocate the local shards of a model sharded on meta and fill them, chunk by chunk, from rank 0.

    With ``initialise`` every param and buffer is initialised by the model's own init, in ``dtypes`` (the dtypes the
    model was built with; default: as it is now), drawing from the CPU generator as it was at ``rng_state`` (the
    state when setup began: sharding itself may draw random numbers on some torch versions), so the values equal a
    single-process init from the same seed; without ``initialise`` (a load follows) only the non-persistent buffers,
    which no checkpoint holds. Every rank calls it.
    """
    import torch.distributed as dist

    sharded.to_empty(device=device)
    rank_zero = dist.get_rank() == 0
    chunks = _plan_chunks(sharded, units, initialise) if rank_zero else []
    names = [[chunk.names for chunk in chunks]]
    dist.broadcast_object_list(names, src=0)
    produce: Optional[Generator[Tuple[Optional[str], Dict[str, Tensor]], None, None]] = None
    if rank_zero:
        if rng_state is not None:
            torch.random.set_rng_state(rng_state)
        produce = _produce(sharded, chunks, dtypes or {})
    try:
        stream_into(sharded, names[0], produce)
    finally:
        if produce is not None:
            produce.close()  # puts the last chunk's shards back
    if initialise:
        # every rank's generator where rank 0's init left it, as if each had run the init (as Lightning's own
        # materialisation does): data drawn next (a dataset, dropout) stays the same on every rank
        state: List[Any] = [torch.random.get_rng_state() if rank_zero else None]
        dist.broadcast_object_list(state, src=0)
        torch.random.set_rng_state(state[0])


@dataclass
class _Chunk:
    """Modules materialised and initialised together on rank 0, and the tensors that then travel."""

    steps: List[InitStep] = field(default_factory=list)
    names: List[str] = field(default_factory=list)


def _plan_chunks(model: nn.Module, outermost_units: Sequence[str], initialise: bool) -> List[_Chunk]:
    """One chunk per outermost wrap unit (its modules are consecutive in the init order) and one per module outside
    the units; without ``initialise``, one per module holding non-persistent buffers, carrying only those."""
    chunks: List[_Chunk] = []
    current: Any = object()
    for name, module, init in init_order(model):
        if initialise:
            key: Any = next((u for u in outermost_units if is_within(name, u)), ("module", name))
            travelling = [join_name(name, n) for n, _ in _own_tensors(module)]
        else:
            key = ("module", name)
            travelling = [join_name(name, n) for n in sorted(non_persistent_buffer_names(module))]
            if not travelling:
                continue
        if key != current:
            chunks.append(_Chunk())
            current = key
        chunks[-1].steps.append((name, module, init))
        chunks[-1].names.extend(canonical_name(n) for n in travelling)
    return chunks


def _produce(
    model: nn.Module, chunks: List[_Chunk], dtypes: Dict[str, torch.dtype]
) -> Generator[Tuple[Optional[str], Dict[str, Tensor]], None, None]:
    """Rank 0: swap full tensors into one chunk at a time, initialise, check and hand them over, swap the shards
    back. An init that raises becomes the chunk's error, which reaches every rank (none waits on a collective)."""
    hf = _is_hf_anywhere(model)
    with _init_context(model), torch.no_grad():
        for chunk in chunks:
            swapped = [_swap_in_full(module, name, dtypes) for name, module, _ in chunk.steps]
            try:
                error: Optional[str] = None
                try:
                    for name, module, init in chunk.steps:  # noqa: B007 - `name` names the module that raised
                        if init is not None:
                            init(module)
                except Exception as raised:  # noqa: BLE001 - reported on every rank, with the module that raised
                    error = f"mixed_fsdp2 meta init: initialising {name or '<root>'} raised {raised!r}"
                own = [(name, module, _own_tensors(module)) for name, module, _ in chunk.steps]
                tensors = {canonical_name(join_name(name, n)): t for name, _, owned in own for n, t in owned}
                yield error or _uninitialised(own, hf, wanted=set(chunk.names)), tensors
            finally:
                for restore in swapped:
                    restore()


def _swap_in_full(module: nn.Module, prefix: str, dtypes: Dict[str, torch.dtype]) -> Callable[[], None]:
    """Replace ``module``'s own params and buffers (shards, or meta tensors) with full-size CPU tensors filled with a
    sentinel, in their built dtypes; return what puts the originals back."""
    params, buffers = own_parameters(module), own_buffers(module)
    flag = module.__dict__.get("_is_hf_initialized", _ABSENT)
    for name, param in params.items():
        if param is not None:
            full = _full_like(param, dtypes.get(join_name(prefix, name), param.dtype))
            replace_parameter(module, name, nn.Parameter(full, requires_grad=param.requires_grad))
    for name, buffer in buffers.items():
        if buffer is not None:
            replace_buffer(module, name, _full_like(buffer, dtypes.get(join_name(prefix, name), buffer.dtype)))

    def restore() -> None:
        for name, param in params.items():
            replace_parameter(module, name, param)
        for name, buffer in buffers.items():
            replace_buffer(module, name, buffer)
        # HF marks each module it initialised; the shards hold what rank 0 computed, so its own init may run again
        if flag is _ABSENT:
            module.__dict__.pop("_is_hf_initialized", None)
        else:
            module.__dict__["_is_hf_initialized"] = flag

    return restore


def _full_like(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """A CPU tensor of ``tensor``'s full (global) shape, filled with the sentinel of ``dtype``."""
    full = torch.empty(tuple(tensor.shape), dtype=dtype, device="cpu")
    sentinel = _sentinel(dtype)
    if sentinel is not None:
        full.fill_(sentinel)
    return full


_ABSENT = object()


def _own_tensors(module: nn.Module) -> List[Tuple[str, Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


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
            full_name = canonical_name(join_name(module_name, name))
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
        if is_hf_model(submodule):
            submodule.tie_weights()
            return


def _init_context(module: nn.Module) -> ContextManager:
    if not _is_hf_anywhere(module):
        return nullcontext()
    from transformers import initialization

    return initialization.guard_torch_init_functions()


def _is_hf_anywhere(module: nn.Module) -> bool:
    return any(is_hf_model(m) for m in module.modules())
