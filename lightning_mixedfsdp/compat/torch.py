"""Every private torch API the library uses, each behind one small function.

Each access notes the torch versions it was checked on. Where versions differ, the branch is chosen by feature
(``hasattr``), not by version number, so a release that back-ports a change takes the right path. The test suite runs
on every version in ``pyproject.toml``'s range (2.11 to 2.15); ``tests/compat/test_torch_compat.py`` exercises each
function on the installed version.
"""

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.compat.versions import gone

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# ---- FSDP2 internals ------------------------------------------------------------------------------------------------


def fsdp_param_groups(module: nn.Module) -> List[Any]:
    """The ``FSDPParamGroup``s of one ``FSDPModule`` (the module's own group; list-form ``fully_shard`` shares one).

    ``FSDPModule._get_fsdp_state()`` is private; see :func:`fsdp_param_groups_of_state`.
    """
    return fsdp_param_groups_of_state(module._get_fsdp_state())  # type: ignore[operator]


def fsdp_param_groups_of_state(state: Any) -> List[Any]:
    """The param groups of an ``FSDPState`` (private): torch 2.11 and 2.12 hold one group or None in
    ``_fsdp_param_group``; 2.13 to 2.15 hold a list in ``_fsdp_param_groups``."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if not hasattr(state, "_fsdp_param_group"):
        raise gone("torch", "FSDPState._fsdp_param_groups (2.13+) or ._fsdp_param_group (2.11, 2.12)")
    group = state._fsdp_param_group
    return [group] if group is not None else []


def fsdp_group_params(group: Any) -> List[nn.Parameter]:
    """The sharded params of an ``FSDPParamGroup`` (private ``fsdp_params`` and ``FSDPParam.sharded_param``, checked
    on torch 2.11 to 2.15)."""
    return [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]


def refresh_fsdp_group_dtypes(group: Any) -> None:
    """Recompute an ``FSDPParamGroup``'s original and reduce dtypes from the params that require grad now.

    FSDP2 fixes them at its lazy init from the trainable params (private ``FSDPParamGroup._init_mp_dtypes``, idempotent;
    checked on torch 2.11 to 2.15): a group with none then keeps no original dtype, and grads of params unfrozen later
    reach the reduce-scatter without their cast back to the param's dtype."""
    group._init_mp_dtypes()


def fsdp_post_forward_mesh_infos(module: nn.Module) -> List[Any]:
    """Whether (and onto what) each of ``module``'s own FSDP groups reshards after forward: private
    ``FSDPParamGroup.post_forward_mesh_info`` (None: kept unsharded), which the public
    ``set_reshard_after_forward`` writes but nothing reads back; checked on torch 2.11 to 2.15. The root's is None
    once FSDP initialised it lazily (the root is not resharded after forward)."""
    return [group.post_forward_mesh_info for group in fsdp_param_groups(module)]


def fsdp_lazy_init(root: nn.Module) -> None:
    """FSDP's lazy init of the root ``root`` (which modules are root and not, the root's no-reshard-after-forward),
    which otherwise runs at its first forward: private ``FSDPState._lazy_init``, idempotent, checked on torch 2.11 to
    2.15."""
    root._get_fsdp_state()._lazy_init()  # type: ignore[operator]


def set_fsdp_post_forward_mesh_infos(module: nn.Module, infos: Sequence[Any]) -> None:
    """Restore what :func:`fsdp_post_forward_mesh_infos` read (private, as there)."""
    for group, info in zip(fsdp_param_groups(module), infos, strict=True):
        group.post_forward_mesh_info = info


def gradient_divide_factor(module: nn.Module) -> Optional[float]:
    """The factor ``FSDPModule.set_gradient_divide_factor`` set on ``module``'s own groups, if any.

    Private ``FSDPParamGroup.gradient_divide_factor`` (no public getter), checked on torch 2.11 to 2.15.
    """
    groups = fsdp_param_groups(module)
    return groups[0].gradient_divide_factor if groups else None


def reset_fsdp_iter_state(root: nn.Module) -> None:
    """Recover FSDP2's state after a forward or backward that raised, then drop the grads the failed backward left.

    ``FSDPModule.reset_iter_state`` is public from torch 2.13; on 2.11 and 2.12 the same reset is made here on the
    private state 2.13's ``FSDPState._reset_iter_state`` clears (checked against 2.11.0's ``FSDPState``,
    ``FSDPParamGroup`` and ``FSDPCommContext``, which hold one reduce-scatter state instead of a list). The unsharded
    grads of a partial backward (``FSDPParam._unsharded_param.grad``, and on 2.11 to 2.14 the separate
    ``unsharded_accumulated_grad``) survive the reset of 2.13 and 2.14 and are dropped here on every version. 2.15's
    reset drops them itself (and the sharded grads too) and makes ``unsharded_accumulated_grad`` a read-only view of
    ``_unsharded_param.grad``, which has no setter: it is cleared only where it is a plain attribute (checked on
    2.11.0, 2.13.0, 2.14.1 and 2.15.0).
    """
    from torch.distributed.fsdp import FSDPModule

    reset = getattr(root, "reset_iter_state", None)
    if reset is not None:
        reset()
    else:
        _reset_iter_state_before_2_13(root)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module):
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
                    if not isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property):
                        fsdp_param.unsharded_accumulated_grad = None


def _reset_iter_state_before_2_13(root: nn.Module) -> None:
    """2.13's ``FSDPState._reset_iter_state`` on 2.11/2.12's private attributes (checked on 2.11.0)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()  # type: ignore[operator]
    stream = state._device_handle.current_stream()
    comm_ctx = state._comm_ctx
    all_gather, reduce_scatter = comm_ctx.all_gather_state, comm_ctx.reduce_scatter_state
    for pending in (all_gather, reduce_scatter):
        if pending is not None and pending.event is not None:
            stream.wait_event(pending.event)
    comm_ctx.all_gather_state = comm_ctx.reduce_scatter_state = None
    comm_ctx.post_forward_order.clear()
    for module_state in state._state_ctx.all_states:
        module_state._modules_to_run_forward.clear()
        module_state._training_state = TrainingState.IDLE
        for group in fsdp_param_groups_of_state(module_state):
            result = group._all_gather_result
            if result is not None and result.all_gather_event is not None:
                stream.wait_event(result.all_gather_event)
            if result is not None and isinstance(result.all_gather_work, torch.distributed.distributed_c10d.Work):
                result.all_gather_work.wait()
            for event in (group._post_reduce_event, getattr(group._all_reduce_state, "event", None)):
                if event is not None:
                    stream.wait_event(event)
            group._all_gather_result = group._post_reduce_event = group._all_reduce_state = None
            group._reshard_after_forward_event = group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


# ---- device meshes --------------------------------------------------------------------------------------------------


def flatten_mesh(mesh: "DeviceMesh", name: str) -> "DeviceMesh":
    """All dims of ``mesh`` flattened into one named dim. ``DeviceMesh._flatten`` is private and has no public
    replacement on torch 2.11 to 2.15. Keep the returned object: slicing the flattened dim back out of the root mesh
    is deprecated."""
    if mesh.ndim == 1:
        return mesh
    return mesh._flatten(name)


# ---- autograd engine ------------------------------------------------------------------------------------------------


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward finishes. ``Variable._execution_engine.queue_callback`` is private,
    checked on torch 2.11 to 2.15; FSDP2 queues its own post-backward callback the same way."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def inside_backward() -> bool:
    """Whether the autograd engine is running (a forward inside a backward, e.g. an activation-checkpoint
    recompute). ``torch._C._current_graph_task_id`` is private, checked on torch 2.11 to 2.15: -1 outside."""
    return torch._C._current_graph_task_id() != -1


def active_saved_tensor_hooks() -> Optional[Tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]]:
    """The (pack, unpack) saved-tensor hooks in force right now (an activation checkpoint's, a user's), if any.
    ``torch._C._autograd._top_saved_tensors_default_hooks`` is private, checked on torch 2.11 to 2.15."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def inside_activation_checkpoint() -> bool:
    """Whether the hooks in force are ``torch.utils.checkpoint``'s (non-reentrant: its forward or its recompute),
    told by the module that defines them (checked on torch 2.11 to 2.15)."""
    hooks = active_saved_tensor_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


# ---- activation checkpointing ---------------------------------------------------------------------------------------


def checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """torch's non-reentrant ``checkpoint_wrapper``; its module path (``torch.distributed.algorithms._checkpoint``)
    is private, checked on torch 2.11 to 2.15. torchtitan imports it from the same place."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module)


# ---- foreach kernels ------------------------------------------------------------------------------------------------


def foreach_norm(tensors: Sequence[Tensor], norm_type: float) -> Sequence[Tensor]:
    """Per-tensor norms in fp32, one kernel per call. ``torch._foreach_norm`` is private (``clip_grad_norm_`` uses
    it), checked on torch 2.11 to 2.15."""
    return torch._foreach_norm(list(tensors), norm_type, dtype=torch.float32)


def foreach_mul_(tensors: Sequence[Tensor], scalar: Tensor) -> None:
    """In-place multiply of every tensor by a 0-dim tensor, one kernel. ``torch._foreach_mul_`` is private,
    checked on torch 2.11 to 2.15."""
    torch._foreach_mul_(list(tensors), scalar)


def assert_on_device(condition: Tensor, message: str) -> None:
    """Assert a boolean device tensor without waiting for it: ``torch._assert_async`` (private, checked on torch 2.11
    to 2.15). On CUDA a failed assert aborts the kernels queued after it and surfaces as a RuntimeError
    ("device-side assert triggered") at the next call that waits for the device."""
    torch._assert_async(condition, message)


# ---- pytrees ---------------------------------------------------------------------------------------------------------


def tree_flatten(tree: Any) -> Tuple[List[Any], Any]:
    """Leaves and structure of nested tuples, lists, dicts and registered containers (HF ``ModelOutput``).
    ``torch.utils._pytree`` is private, checked on torch 2.11 to 2.15."""
    from torch.utils._pytree import tree_flatten as flatten

    return flatten(tree)


def tree_unflatten(leaves: List[Any], spec: Any) -> Any:
    """The inverse of :func:`tree_flatten` (``torch.utils._pytree``, private, checked on torch 2.11 to 2.15)."""
    from torch.utils._pytree import tree_unflatten as unflatten

    return unflatten(leaves, spec)


# ---- module internals -----------------------------------------------------------------------------------------------


def replace_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
    """Set ``module``'s own param ``name`` without ``nn.Module.__setattr__``'s checks (which refuse a plain tensor
    where a param was, and would route through a class property). ``Module._parameters`` is private, stable on
    torch 2.11 to 2.15; FSDP2 writes it the same way."""
    module._parameters[name] = param


def replace_buffer(module: nn.Module, name: str, buffer: Optional[Tensor]) -> None:
    """Set ``module``'s own buffer ``name``, keeping its persistence. ``Module._buffers`` is private, stable on
    torch 2.11 to 2.15."""
    module._buffers[name] = buffer


def own_parameters(module: nn.Module) -> dict:
    """``module``'s own params by attribute name, ``None`` entries included (``Module._parameters``; read-only)."""
    return dict(module._parameters)


def own_parameter(module: nn.Module, name: str) -> Optional[Tensor]:
    """``module``'s own param ``name`` as it is stored (``Module._parameters``; read-only, no copy of the dict)."""
    return module._parameters[name]


def own_buffers(module: nn.Module) -> dict:
    """``module``'s own buffers by attribute name, ``None`` entries included (``Module._buffers``; read-only)."""
    return dict(module._buffers)


def non_persistent_buffer_names(module: nn.Module) -> frozenset:
    """Names of ``module``'s own buffers that no state dict holds (``Module._non_persistent_buffers_set``, private,
    stable on torch 2.11 to 2.15)."""
    return frozenset(module._non_persistent_buffers_set)


# ---- DTensor internals ----------------------------------------------------------------------------------------------


def dtensor_storage(tensor: Tensor) -> Tensor:
    """The local tensor a DTensor holds (``DTensor._local_tensor``): the object its in-place ops write to, so an
    autograd leaf made of it stays the param's own storage. ``to_local()`` would give a fresh view through an autograd
    function (about 150 us of Python per call and backward). Private, the same on torch 2.11 to 2.15."""
    return tensor._local_tensor  # type: ignore[attr-defined]


def dtensor_with_local(template: Tensor, local: Tensor) -> Tensor:
    """A DTensor with ``template``'s mesh, placements and metadata holding ``local`` (shape, stride and dtype equal to
    ``template``'s local tensor, or for a 4-bit template its nominal ones): ``DTensor(local, spec,
    requires_grad=False)``, the constructor ``from_local`` ends in, without recomputing the spec (about 70 us of
    Python). Private, the same on torch 2.11 to 2.15."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, template._spec, requires_grad=False)  # type: ignore[attr-defined]


# ---- distributed checkpoint -----------------------------------------------------------------------------------------


def local_chunk(tensor: Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(offsets, sizes)`` of this rank's part of ``tensor`` in the global tensor (all of it for a plain tensor).

    ``DTensor.__create_chunk_list__`` is the protocol DCP's planners use (not public API; the same on 2.11 to 2.15).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        chunks = tensor.__create_chunk_list__()
        if chunks:
            return tuple(chunks[0].offsets), tuple(chunks[0].sizes)
        return tuple(0 for _ in tensor.shape), tuple(0 for _ in tensor.shape)
    return tuple(0 for _ in tensor.shape), tuple(tensor.shape)


def collective_process_group(args: Sequence[Any]) -> Any:
    """The process group of a c10d op seen by a dispatch mode: ``c10d.*`` ops carry it as a boxed ``ScriptObject``
    (``ProcessGroup.unbox``), ``_c10d_functional.*`` ops by name (``_resolve_process_group``); None when neither is
    among ``args``. Private: both checked on torch 2.11 to 2.15."""
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):  # a ScriptObject of another kind (a ReduceOp)
                continue
    for arg in args:
        if isinstance(arg, str):
            try:
                return _resolve_process_group(arg)  # type: ignore[arg-type]  # a group name
            except (RuntimeError, ValueError, KeyError):
                continue
    return None


def group_backend_for(group: Any, device_type: str) -> Optional[str]:
    """The name of the backend ``group`` runs ``device_type`` tensors' collectives on, or None when it has none
    (``ProcessGroup._get_backend``, private; raises without one on torch 2.11 to 2.15)."""
    try:
        return type(group._get_backend(torch.device(device_type))).__name__
    except RuntimeError:
        return None


# ---- context parallelism: torch's ring attention (torch.distributed.tensor.experimental._context_parallel), all of
# it private; checked on torch 2.11, 2.13 and 2.15. torch maps only the CUDA attention ops (flash, efficient, cuDNN)
# to ring attention; the CPU op's handler below runs torch's own ring on the local tensors, so CPU/gloo runs context
# parallelism too. Layout: head-tail load balancing (rank r holds chunks r and 2cp-1-r of 2cp), as torch's
# _HeadTailLoadBalancer; torch's ring then skips the causal blocks a rank does not need.

ATTENTION_SEQUENCE_DIM = 2
"""The sequence dim of scaled-dot-product attention's query, key and value: (batch, heads, sequence, head dim)."""


def register_ring_attention() -> None:
    """Route scaled-dot-product attention on sequence-sharded DTensors to torch's ring attention, causal with
    head-tail load balancing. Stays on for the process; attention on plain tensors is untouched."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    aten = torch.ops.aten
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_ring_handler
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _cpu_ring_handler
    _attention._cp_options.enable_load_balance = True
    _attention._enable_cp_dtensor_dispatcher()


def set_ring_rotate_method(rotate_method: str) -> None:
    """How the ring moves the key/value parts (``"allgather"`` or ``"alltoall"``) from the next attention call on: a
    process-wide setting of torch's, so each context-parallel pass sets its own before it runs."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.set_rotate_method(rotate_method)


def backward_keeping_modes(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: Optional[bool] = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward``'s body below its torch-function check, for a torch-function mode that handles
    ``Tensor.backward`` itself: torch takes a mode off the stack while it handles a call, and the autograd engine runs
    the whole backward (activation checkpointing's recompute included) with the thread-local state of its start, so
    the mode puts itself back and starts the engine here. Private: ``torch.autograd._make_grads``,
    ``_tensor_or_tensors_to_tuple`` and ``torch.autograd.graph._engine_run_backward``; checked on torch 2.11, 2.13
    and 2.15."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    outputs = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
    wanted = () if inputs is None else (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    grads = _make_grads(outputs, _tensor_or_tensors_to_tuple(grad_tensors, len(outputs)), is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    _engine_run_backward(outputs, grads, retain, create_graph, wanted, allow_unreachable=True, accumulate_grad=True)


def ring_rotate_method() -> str:
    """How the ring moves key/value parts now (``"allgather"`` or ``"alltoall"``)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    names = {_attention._RotateMethod.ALL_GATHER: "allgather", _attention._RotateMethod.ALL_TO_ALL: "alltoall"}
    return names[_attention._cp_options.rotate_method]


def _cpu_ring_handler(op_call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """DTensor's handler of the CPU attention op (forward and backward): torch's templated ring attention on the
    local parts, the outputs wrapped with the query's layout (``Shard(2)`` on the context-parallel mesh)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention

    aten = torch.ops.aten
    backward = op_call is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    query = args[1] if backward else args[0]
    if query.device_mesh.ndim != 1 or tuple(query.placements) != (Shard(ATTENTION_SEQUENCE_DIM),):
        raise NotImplementedError(f"ring attention needs a 1-D mesh and Shard(2), got {query.placements}")
    local = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
    inputs = ("grad_out", "query", "key", "value", "out", "logsumexp") if backward else ("query", "key", "value")
    names: Tuple[str, ...] = (*inputs, "dropout_p", "is_causal")
    named: Dict[str, Any] = dict(zip(names, local, strict=False))
    named.update({k: v._local_tensor if isinstance(v, DTensor) else v for k, v in kwargs.items()})
    if named.get("attn_mask") is not None or named.get("dropout_p", 0.0):
        raise NotImplementedError("ring attention takes no attention mask and no dropout")
    group = query.device_mesh.get_group()
    if not backward:
        out, logsumexp = _attention._templated_ring_attention(group, ATTENTION_SEQUENCE_DIM, op_call, **named)[:2]
        return _dtensor_like(out, query), _dtensor_like(logsumexp, query)
    grads = _attention._templated_ring_attention_backward(
        group, ATTENTION_SEQUENCE_DIM, op_call, grad_out_name="grad_out", **named
    )
    return tuple(_dtensor_like(g, like) for g, like in zip(grads[:3], args[1:4], strict=True))


def _dtensor_like(local: Tensor, like: Any) -> Any:
    """``local`` as a DTensor with ``like``'s mesh and placements (its global shape computed from them)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    shape, stride = compute_global_tensor_info(local, like.device_mesh, like.placements)
    spec = DTensorSpec(like.device_mesh, like.placements, TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def reduce_unused_params(module: nn.Module) -> bool:
    """Make ``module``'s own FSDP groups reduce zeros for the trainable params that got no grad on this rank (the
    public ``FSDPModule.set_reduce_scatter_unused_params``, torch 2.13 to 2.15; absent from 2.11). False where the
    installed torch lacks it."""
    setter = getattr(module, "set_reduce_scatter_unused_params", None)
    if setter is None:
        return False
    setter(True, recurse=False)
    return True


def can_reduce_unused_params() -> bool:
    """Whether the installed torch's FSDP2 has ``set_reduce_scatter_unused_params`` (2.13 to 2.15 do, 2.11 not)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


# ---- optimizers -----------------------------------------------------------------------------------------------------


def muon_orthogonalise(
    update: Tensor, ns_coefficients: Tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """``torch.optim.Muon``'s orthogonalisation of one whole 2-D update: bf16 Newton-Schulz, the tall case transposed
    (``torch.optim._muon._zeropower_via_newtonschulz``, private; the same on torch 2.11 to 2.15)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """The lr ``torch.optim.Muon`` applies to a matrix of ``shape`` (``torch.optim._muon._adjust_lr``, private; the
    same on torch 2.11 to 2.15): ``original`` scales by sqrt(max(1, rows / cols)), ``match_rms_adamw`` by 0.2 x
    sqrt(max(rows, cols))."""
    from torch.optim._muon import _adjust_lr

    return float(_adjust_lr(lr, adjust_lr_fn, torch.Size(shape)))


# ---- pipeline parallelism -------------------------------------------------------------------------------------------


def finish_fsdp_backward(root: nn.Module) -> None:
    """After the micro-batches of one pipeline step ran their backwards with gradient sync off: every FSDP group of
    ``root``'s tree reduces its accumulated grads, once, and FSDP's end-of-backward runs (what torch's own
    ``PipelineStage.perform_reduce_grad`` does for a stage whose module is the FSDP root; checked on torch 2.11 to
    2.15). Private: ``fully_shard.state``, ``FSDPState._state_ctx.all_states``, ``FSDPParamGroup.post_backward``,
    ``FSDPState._root_post_backward_final_callback``."""
    from torch.distributed.fsdp import fully_shard

    root.set_is_last_backward(True)  # type: ignore[operator]
    root.set_reshard_after_backward(True)  # type: ignore[operator]
    root.set_requires_gradient_sync(True)  # type: ignore[operator]
    state = fully_shard.state(root)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in fsdp_param_groups_of_state(each):
            group.post_backward()
    state._root_post_backward_final_callback()


def schedule_step_without_outputs(schedule: Any) -> Dict[str, Any]:
    """The keyword that stops a schedule's last stage from keeping every micro-batch's output and concatenating them
    at the end of ``step`` (``return_outputs=False``, what torchtitan passes; public, the default True on torch 2.13
    to 2.15), or none where the installed torch's ``step`` has no such parameter."""
    import inspect

    return {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}


def reshard_fsdp_tree(root: nn.Module) -> None:
    """Free every FSDP unit's unsharded params in ``root``'s tree (public ``FSDPModule.reshard``, torch 2.11 to
    2.15): a forward with ``reshard_after_forward=False`` (pipeline stages) leaves them gathered, and an optimizer step
    then updates the shards while the next forward would read the stale gathered copy."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def pipeline_schedule_class(name: str) -> Any:
    """torch's schedule class for ``name`` (``"1F1B"`` -> ``Schedule1F1B``; public, checked on torch 2.11 to
    2.15)."""
    from torch.distributed import pipelining

    return getattr(pipelining, f"Schedule{name}")


# ---- profiler --------------------------------------------------------------------------------------------------------


def profiled_host_memory_changes(profile: Any) -> List[Tuple[int, int]]:
    """Every host allocation (+bytes) and free (-bytes) a finished ``torch.profiler.profile(profile_memory=True)``
    recorded, as ``(time in ns, bytes)``: its ``profiler.kineto_results`` events named ``[memory]`` (the raw records;
    ``profile.events()`` folds them into ops, and counts a child on another thread in its parent too). Attributes
    without an underscore but undocumented, checked on torch 2.11, 2.13 and 2.15."""
    changes = []
    for event in profile.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
            changes.append((int(event.start_ns()), int(event.nbytes())))
    return changes


# ---- process groups outside the default world ------------------------------------------------------------------------


def rendezvous_store(host: str, port: int, size: int, hosting: bool, timeout_s: float) -> Any:
    """A TCP store for ``size`` processes at ``host:port`` (``hosting``: this process serves it; port 0 picks a free
    one, read back as ``store.port``). Public ``torch.distributed.TCPStore``, checked on torch 2.11, 2.13, 2.15."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        host, port, size, is_master=hosting, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def standalone_gloo_group(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A gloo process group of ``size`` processes over ``store``, outside the default world: GRPO's generator ranks
    and the trainer that feeds them (what vLLM's StatelessProcessGroup does). Its collectives are the group object's
    own methods (``broadcast``, ``send``, ``recv``): ``torch.distributed``'s functions look a group up in the default
    world. ``PrefixStore`` and ``ProcessGroupGloo``'s constructor, public names without documentation, checked on
    torch 2.11, 2.13 and 2.15."""
    import datetime

    import torch.distributed as dist

    prefixed = dist.PrefixStore("generator_ranks", store)
    return dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=timeout_s))


def broadcast_options(root: int) -> Any:
    """``BroadcastOptions`` from ``root`` for a group object's own ``broadcast`` (public name, checked on torch 2.11,
    2.13 and 2.15)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = root
    return options
