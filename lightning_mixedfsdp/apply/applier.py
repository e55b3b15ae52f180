"""Execute a ShardPlan on a model, in torchtitan's order: the planned dtypes, the model conversions (the 4-bit base,
float8 Linear layers), the user's ``parallelize_fn`` (tensor parallelism), activation checkpointing, per-unit
compile, the replicated params and every dtype boundary, one ``fully_shard`` per sharded group (children before
parents, the root last), then the step tracking that reduces the replicated grads. The ``apply_*`` leaves are the
library's side effects on a model; ``shard_model`` (``model_setup.py``) orchestrates them."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.apply.adapt import ClassRestore
from lightning_mixedfsdp.apply.boundaries import apply_module_adaptations, is_minority
from lightning_mixedfsdp.apply.bucketed import broadcast_from_first_rank
from lightning_mixedfsdp.apply.buffers import BufferSync
from lightning_mixedfsdp.apply.conditional import apply_conditional_reduction
from lightning_mixedfsdp.apply.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    apply_ring_attention_span,
    attention_modules,
)
from lightning_mixedfsdp.apply.cross_replica import CrossReplicaReduce, apply_cross_replica_reduction
from lightning_mixedfsdp.apply.experts import apply_expert_parallel, set_expert_reduction
from lightning_mixedfsdp.apply.float8 import apply_float8
from lightning_mixedfsdp.apply.options import ApplyOptions
from lightning_mixedfsdp.apply.quantize import apply_checkpoint_exclusion, apply_quantization
from lightning_mixedfsdp.apply.recovery import StepTracker, reset_fsdp_step
from lightning_mixedfsdp.apply.replicate import (
    ReplicatedGradReducer,
    ReplicatedParam,
    as_dtensor,
    fsdp_gradient_divide_factor,
    replicate_params,
)
from lightning_mixedfsdp.apply.semi_sync import GroupExchange, OuterExchange, OuterSync
from lightning_mixedfsdp.apply.unfreeze import apply_unfreeze_check
from lightning_mixedfsdp.compat.torch import checkpoint_wrapper, replace_buffer
from lightning_mixedfsdp.config import BufferSyncMode, Parallelism
from lightning_mixedfsdp.mesh import ExpertMeshes, ParallelMeshes
from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name, is_hf_model, is_peft_model
from lightning_mixedfsdp.planning.planner import fsdp_groups_can_mix_dtypes
from lightning_mixedfsdp.planning.types import ShardGroup, ShardPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass
class AppliedPlan:
    """A plan as applied to one model: its replicas, their reducer, and every hook installed (removable)."""

    plan: ShardPlan
    replicas: List[ReplicatedParam]
    reducer: ReplicatedGradReducer
    tracker: StepTracker
    handles: List[RemovableHandle] = field(default_factory=list)
    restores: List[ClassRestore] = field(default_factory=list)
    """What undoes the class adaptations (boundaries, local views) of modules FSDP does not wrap itself."""
    buffers: Optional[BufferSync] = None
    """The buffers kept equal on every data-parallel rank, and how."""
    after_step: List[Callable[[], None]] = field(default_factory=list)
    """What runs after every optimizer step (the float8 all-gather's scales, the outer sync)."""
    outer: Optional[OuterSync] = None
    """Semi-synchronous replicas' outer sync (``replicate_sync``), None when every step syncs."""

    def remove_hooks(self) -> None:
        """Remove every hook the plan installed and undo the adaptations of modules that are no FSDP group."""
        for handle in self.handles:
            handle.remove()
        for restore in self.restores:
            restore.remove()
        self.handles.clear()
        self.restores.clear()


def apply_plan(
    model: nn.Module,
    plan: ShardPlan,
    meshes: ParallelMeshes,
    device: torch.device,
    parallelize: Callable[[nn.Module, Any], nn.Module],
    options: Optional[ApplyOptions] = None,
    cross_replica_reduce: Optional[CrossReplicaReduce] = None,
    context_parallel: Optional[ContextParallel] = None,
    outer_exchange: Optional[OuterExchange] = None,
) -> Tuple[nn.Module, Optional[AppliedPlan]]:
    """Shard ``model`` as ``plan`` says, with the config's ``options`` (resharding, activation checkpointing, compile,
    offload, emulated float8). Returns the (possibly new) model and the applied plan, or None for the plan when the
    model was sharded with FSDP already (a Trainer's ``configure_model``) or the user's ``parallelize`` shards it
    itself. Fault tolerance's links: ``cross_replica_reduce`` averages every gradient across replica groups after its
    reduction within the group; ``outer_exchange`` syncs semi-synchronous groups. ``context_parallel``: the run's
    (the strategy's), made from ``meshes`` when not given."""
    options = options or ApplyOptions()
    if _already_sharded(model):
        return model, None
    apply_dtypes(model, plan)
    if plan.quantized_params:
        tensor_parallel = meshes.root.size() // meshes.replicas.size()
        apply_quantization(model, plan.quantized_params, tensor_parallel, device)
    float8_after_step = apply_float8(model, plan.float8_modules, plan.float8_recipe, options.float8.emulate, device)
    model = apply_parallelize(model, parallelize, meshes.root)
    if _already_sharded(model):
        check_experts_not_sharded_by_user(plan)
        return model, None
    check_plan_fits(model, plan)
    check_groups_supported(plan)
    if plan.experts is not None:
        experts = expert_meshes(plan, meshes)
        apply_expert_parallel(model, plan.experts, experts.expert_parallel, experts.tensor_parallel)
    top_units = list(plan.outermost_units)
    sharding = options.sharding
    if sharding.checkpoint_every:
        apply_activation_checkpointing(model, top_units[::-1][:: sharding.checkpoint_every])
    index = ModuleIndex(model)
    if sharding.compile:
        apply_compile(index, top_units)
    restores: List[ClassRestore] = []
    replicas = replicate_params(index, plan, meshes.fsdp, device, sharding.recompute_keep_fp32_modules, restores)
    restores += apply_module_adaptations(index, plan, sharding.recompute_keep_fp32_modules)
    ignored = {replica.param for replica in replicas}
    apply_fully_shard_groups(index, plan, meshes, options, ignored)
    handles: List[RemovableHandle] = apply_checkpoint_exclusion(model, plan.quantized_params)
    reducer, tracker = apply_step_tracking(model, replicas, meshes, handles)
    handles.extend(apply_conditional_tracking(plan, index, meshes, reducer, tracker))
    handles.extend(apply_unfreeze_check(model, plan.frozen_pinned, plan.bulk))
    if meshes.context_parallel is not None:
        rotate = options.parallelism.context_parallel_rotate
        context = context_parallel or ContextParallel(meshes.context_parallel, rotate)
        handles.extend(apply_context_parallel_hooks(model, tracker, context))
    if cross_replica_reduce is not None:
        apply_cross_replica_reduction(model, reducer, cross_replica_reduce)
    applied = AppliedPlan(plan, replicas, reducer, tracker, handles=handles, restores=restores)
    applied.after_step.extend([float8_after_step] if float8_after_step is not None else [])
    applied.outer = apply_outer_sync(model, outer_exchange, meshes.outer, options.parallelism, device, applied)
    return model, applied


def apply_outer_sync(
    model: nn.Module,
    exchange: Optional[OuterExchange],
    outer: Optional["DeviceMesh"],
    parallelism: Parallelism,
    device: torch.device,
    applied: AppliedPlan,
) -> Optional[OuterSync]:
    """Local SGD or DiLoCo for the model's trainable params (after ``fully_shard``: its shards), over ``exchange``
    (fault-tolerant replica groups) or the semi-synchronous meshes' replicate dim ``outer``, after ``applied``'s
    other steps; the outer state where ``outer_state`` says. None when replicas sync every step."""
    if exchange is None and outer is not None:
        exchange = GroupExchange(outer.get_group())
    if exchange is None:
        return None
    method = parallelism.replicate_sync
    assert method != "every_step"  # an exchange or an outer mesh exists only when asked
    trainable = [p for p in model.parameters() if p.requires_grad]
    sync = OuterSync(
        trainable,
        exchange,
        method,
        parallelism.sync_every,
        parallelism.outer_lr,
        parallelism.outer_momentum,
        parallelism.outer_nesterov,
        torch.device("cpu") if parallelism.outer_state == "cpu" else device,
    )
    applied.after_step.append(sync.after_step)
    if exchange.deferred:  # fault-tolerant groups meet before their first step
        applied.handles.append(model.register_forward_pre_hook(sync.join, prepend=True))
    return sync


def apply_context_parallel_hooks(
    model: nn.Module, tracker: StepTracker, context: ContextParallel
) -> List[RemovableHandle]:
    """Ring attention from a forward's ``split`` to its backward's end, each split forward's ring calls checked against
    the model's attention modules; an HF causal LM's calls split at each call."""
    handles = apply_ring_attention_span(model, tracker, context, attention_modules(model))
    if is_hf_model(model) or is_peft_model(model):
        handles.extend(apply_context_parallel(model, context))
    return handles


def check_experts_not_sharded_by_user(plan: ShardPlan) -> None:
    """Expert parallelism is applied by the plan: a ``parallelize_fn`` that shards with FSDP itself cannot have it."""
    if plan.experts is not None:
        raise ValueError(
            f"mixed_fsdp2: expert_parallel_size={plan.experts.size} is applied by the dtype plan, but"
            " `parallelize_fn` sharded the model with `fully_shard` itself. Remove `fully_shard` from it (tensor"
            " parallelism and wrappers may stay), or leave expert_parallel_size=1 and apply EP yourself."
        )


def expert_meshes(plan: ShardPlan, meshes: ParallelMeshes) -> ExpertMeshes:
    """The expert meshes a plan with expert parallelism needs."""
    if meshes.experts is None:
        assert plan.experts is not None
        raise ValueError(
            f"mixed_fsdp2: the plan splits experts over {plan.experts.size} ranks, but the meshes hold no expert"
            " mesh. Pass `shard_model` the meshes of `ParallelDims(..., expert_parallel=E).build_meshes(...)` (the"
            " strategies build them from their expert_parallel_size), or plan with expert_parallel_size=1."
        )
    return meshes.experts


@torch.no_grad()
def apply_dtypes(model: nn.Module, plan: ShardPlan) -> nn.Module:
    """Cast every param and floating buffer to the dtype the plan gave it: the one cast the library makes."""
    for name, param in model.named_parameters():
        storage = plan.params[canonical_name(name)].key.storage
        if param.dtype != storage:
            param.data = param.data.to(storage)
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            planned = plan.buffers.get(canonical_name(f"{module_name}.{buffer_name}" if module_name else buffer_name))
            if planned is not None and buffer.dtype != planned.dtype:
                replace_buffer(module, buffer_name, buffer.to(planned.dtype))
    return model


def apply_parallelize(
    model: nn.Module, parallelize: Callable[[nn.Module, Any], nn.Module], mesh: "DeviceMesh"
) -> nn.Module:
    """The user's ``parallelize_fn`` (tensor parallelism, or their own wrappers) on the full mesh."""
    parallelized = parallelize(model, mesh)
    if not isinstance(parallelized, nn.Module):
        # Lightning's own words (ModelParallelStrategy.setup_module)
        raise TypeError(
            f"The `parallelize_fn` must return a `nn.Module` instance, but got: {type(parallelized).__name__}"
        )
    return parallelized


def apply_step_tracking(
    model: nn.Module, replicas: List[ReplicatedParam], meshes: ParallelMeshes, handles: List[RemovableHandle]
) -> Tuple[ReplicatedGradReducer, StepTracker]:
    """The replicated-grad reduction at the end of every backward, and recovery after a step that raised."""
    from torch.distributed.fsdp import FSDPModule

    reducer = ReplicatedGradReducer(
        replicas, meshes.replicas.get_group(), divide_factor=lambda: fsdp_gradient_divide_factor(model)
    )
    tracker = StepTracker()
    if reducer.has_replicas:
        tracker.on_backward_end(reducer.on_backward_end)
        tracker.on_reset(reducer.drop_local_grads)
    if isinstance(model, FSDPModule):
        tracker.on_reset(lambda: reset_fsdp_step(model))
    handles.extend(tracker.attach(model))
    return reducer, tracker


def apply_conditional_tracking(
    plan: ShardPlan, index: ModuleIndex, meshes: ParallelMeshes, reducer: ReplicatedGradReducer, tracker: StepTracker
) -> List[RemovableHandle]:
    """Trainable params of modules that run for some inputs only reduce zeros where they did not run, and get no grad
    after a step no rank ran them (``conditional.py``); gradient sync follows the replicated reducer's switch."""
    synced = lambda: reducer.requires_gradient_sync  # noqa: E731  the strategy's gradient-sync switch
    conditional = apply_conditional_reduction(plan, index, meshes.replicas.get_group(), synced)
    if conditional is None:
        return []
    tracker.on_backward_end(conditional.on_backward_end)
    tracker.on_reset(conditional.reset)
    return conditional.attach(index)


def apply_activation_checkpointing(model: nn.Module, units: Sequence[str]) -> None:
    """Wrap each unit in torch's ``checkpoint_wrapper`` (non-reentrant), in place in its parent."""
    wanted = set(units)
    # outermost module of each canonical name: a unit the user already wrapped is wrapped again, around the wrapper
    seen: Set[str] = set()
    for name, module in list(model.named_modules()):
        canonical = canonical_name(name)
        if canonical in wanted and canonical not in seen:
            seen.add(canonical)
            parent_name, _, attribute = name.rpartition(".")
            model.get_submodule(parent_name).register_module(attribute, checkpoint_wrapper(module))


def apply_compile(index: ModuleIndex, units: Sequence[str]) -> None:
    """``module.compile()`` per unit (torchtitan's per-block compile): in place, so names and hooks stay."""
    for unit in units:
        index.outer[unit].compile()


def check_plan_fits(model: nn.Module, plan: ShardPlan) -> None:
    """The plan is made before ``parallelize_fn``; wrappers and tensor parallelism keep canonical names, anything that
    adds or removes params would leave some without a planned dtype."""
    names = {canonical_name(n) for n, _ in model.named_parameters()}
    added, removed = sorted(names - set(plan.params)), sorted(set(plan.params) - names)
    if added or removed:
        raise ValueError(
            f"mixed_fsdp2 planned dtypes before `parallelize_fn`, which then added params {added[:5]} and removed"
            f" {removed[:5]}. Change the model's params before `setup` (and keep `parallelize_fn` to tensor"
            " parallelism and wrappers)."
        )


def check_groups_supported(plan: ShardPlan) -> None:
    """A plan made for a torch whose ``fully_shard`` groups mixed dtypes cannot be applied on one that cannot."""
    mixed = plan.mixed_dtype_groups
    if mixed and not fsdp_groups_can_mix_dtypes():
        raise ValueError(
            f"mixed_fsdp2: the plan shards groups of mixed dtypes ({', '.join(mixed[:3])}), one `fully_shard`"
            f" each, which torch {torch.__version__}'s FSDP2 cannot hold (one original dtype per group). Plan with"
            " `mixed_dtype_groups=False`, the default on this torch."
        )


def apply_buffer_sync(
    model: nn.Module, applied: AppliedPlan, mode: BufferSyncMode, names: Optional[Sequence[str]], meshes: ParallelMeshes
) -> None:
    """Buffers start as data-parallel rank 0 has them and stay in step as ``mode`` says (``buffers.py``)."""
    if mode == "none":
        return
    sync = BufferSync(model, mode, names, meshes.replicas.get_group())
    sync.broadcast()
    applied.handles.extend(sync.attach(model))
    applied.buffers = sync


@torch.no_grad()
def sync_replicas(applied: AppliedPlan, meshes: ParallelMeshes) -> None:
    """Replicas start identical on every data-parallel rank (rank 0's values), however each rank initialised them."""
    if applied.replicas:
        replicas = [as_dtensor(r.param).to_local() for r in applied.replicas]
        broadcast_from_first_rank(replicas, meshes.replicas.get_group())


def mp_policy(group: ShardGroup) -> "MixedPrecisionPolicy":
    """FSDP's casts for a group: a unit's own group casts its inputs; a minority group's modules cast at their own
    dtype boundary (``boundaries.py``), so FSDP only all-gathers and reduces in the group's dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    key, own_casts = group.key, not is_minority(group)
    return MixedPrecisionPolicy(
        param_dtype=key.compute,
        reduce_dtype=key.reduce,
        output_dtype=key.output if own_casts else None,
        cast_forward_inputs=own_casts,
    )


def apply_fully_shard_groups(
    index: ModuleIndex, plan: ShardPlan, meshes: ParallelMeshes, options: ApplyOptions, ignored: Set[nn.Parameter]
) -> None:
    """One ``fully_shard`` per sharded group; its shards on the host under ``memory.offload``, or under
    ``memory.offload_frozen`` for a group with no trainable param."""
    memory = options.memory
    for group in plan.sharded_groups:
        trains = plan.trains(group)
        offload = memory.offload == "cpu" or (memory.offload_frozen == "cpu" and not trains)
        reshard = options.sharding.resolved_reshard_after_forward(options.parallelism.pipeline_parallel_size)
        apply_fully_shard(index, group, meshes, reshard, ignored, offload, trains)


def apply_fully_shard(
    index: ModuleIndex,
    group: ShardGroup,
    meshes: ParallelMeshes,
    reshard_after_forward: bool,
    ignored: Set[nn.Parameter],
    offload_to_cpu: bool = False,
    trainable: bool = True,
) -> None:
    """One ``fully_shard``: over the data-parallel shard ranks, or for an experts group over the ranks holding the
    same experts, with the divide factor that averages its grads over all data-parallel ranks. ``trainable``: whether
    any of the group's params requires grad at setup."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # on the outermost module of each name: a checkpoint or compile wrapper, as torchtitan shards them
    modules = [index.outer[name] for name in group.modules]
    # None lets FSDP keep the root unsharded after forward (it is all-gathered again at once in backward); a root with
    # no trainable param (a frozen teacher or backbone set up on its own) runs no backward that would reshard it, so it
    # would hold its whole unsharded params from its first forward on (and hand them to an optimizer that unfreezes it)
    keep_root = group.is_root and reshard_after_forward and trainable
    reshard: Optional[bool] = None if keep_root else reshard_after_forward
    target = modules[0] if len(modules) == 1 else modules
    experts = meshes.experts if group.expert else None
    mesh = experts.fsdp if experts is not None else meshes.fsdp
    # pinned host memory makes the copies asynchronous; it needs an accelerator
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if offload_to_cpu else OffloadPolicy()
    fully_shard(
        target,
        mesh=mesh,
        reshard_after_forward=reshard,
        mp_policy=mp_policy(group),
        offload_policy=offload,
        ignored_params=ignored,
    )
    if experts is not None:
        set_expert_reduction(modules[0], experts.gradient_divide_factor, experts.shard_size)


def _already_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
