"""The model setup: one torch-only entry that turns a model into a sharded, initialised, hooked one (not to be
confused with pipeline parallelism, which lives in ``pipelining/``).

``shard_model`` runs, in order: plan (pure) -> apply (casts, the user's ``parallelize_fn``, AC, compile, FSDP,
replicated params and their hooks) -> materialise (a meta model initialised by its own init, or the non-persistent
buffers rebuilt for a load that follows) -> replicas made identical on every data-parallel rank -> the optional
dtype-leak check. It imports nothing from Lightning: the strategies, the recipes and the benchmarks all call it.
"""

import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple
from weakref import WeakKeyDictionary, WeakSet

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mixedfsdp.apply.applier import AppliedPlan, apply_buffer_sync, apply_plan, sync_replicas
from lightning_mixedfsdp.apply.conditional import conditional_problems
from lightning_mixedfsdp.apply.context_parallel import ContextParallel, context_parallel_problems
from lightning_mixedfsdp.apply.cross_replica import CrossReplicaReduce
from lightning_mixedfsdp.apply.options import ApplyOptions
from lightning_mixedfsdp.apply.semi_sync import OuterExchange, OuterSync, semi_sync_problems
from lightning_mixedfsdp.apply.semi_sync_checkpoint import attach_outer_state
from lightning_mixedfsdp.apply.tensor_parallel import (
    TENSOR_PARALLEL_DIM,
    apply_hf_tensor_parallel,
    describe_split,
    hf_tensor_parallel_plan,
    tensor_parallel_problems,
)
from lightning_mixedfsdp.config import BulkDtypes, MixedFSDPConfig
from lightning_mixedfsdp.diagnostics.leaks import install_leak_check
from lightning_mixedfsdp.materialize.meta import has_meta_tensors, materialize_sharded
from lightning_mixedfsdp.mesh import ParallelizeFn, ParallelMeshes
from lightning_mixedfsdp.model.names import canonical_name, is_within, unwrap_model, user_class_name
from lightning_mixedfsdp.planning.planner import plan_validated
from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.planning.types import ShardPlan

log = logging.getLogger(__name__)

# every module set up by any mixed_fsdp2 strategy: its params are sharded and hooked, a second setup cannot work
_SET_UP: "WeakSet[nn.Module]" = WeakSet()


@dataclass
class ShardedModel:
    """What :func:`shard_model` returns: the (possibly new) module, and the applied plan, or None when the user's
    ``parallelize_fn`` sharded it with FSDP itself."""

    module: nn.Module
    applied: Optional[AppliedPlan]


def shard_model(
    module: nn.Module,
    config: MixedFSDPConfig,
    bulk: BulkDtypes,
    meshes: ParallelMeshes,
    device: torch.device,
    parallelize: Optional[ParallelizeFn] = None,
    cross_replica_reduce: Optional[CrossReplicaReduce] = None,
    context_parallel: Optional[ContextParallel] = None,
    outer_exchange: Optional[OuterExchange] = None,
    split_in: str = "parallelize_fn",
) -> ShardedModel:
    """Plan, apply, materialise, sync and check ``module`` (``config`` validated), with the same model on every
    data-parallel rank. ``cross_replica_reduce`` averages gradients across fault-tolerant replica groups after the
    group's reduction. ``context_parallel``: the run's one (the strategy's; else made from ``meshes``).
    ``outer_exchange``: semi-synchronous replicas' link across replica groups. ``split_in``: where the user splits
    the model (``parallelize_fn``; the Trainer's ``configure_model``), named when its own plan cannot split it."""
    if module in _SET_UP:
        raise RuntimeError(
            f"mixed_fsdp2: this {user_class_name(module)} is already set up (sharded, with hooks installed); a second"
            " setup would shard it again. Keep using the module the first setup returned, or build a fresh model to"
            " set up."
        )
    float8 = config.float8.recipe is not None
    parallelize, model_problems = _parallelize_or_own_plan(module, parallelize, meshes, split_in, float8)
    model_problems += context_parallel_problems(module, config.parallelism.context_parallel_size)
    if model_problems:  # the same model on every rank: every rank raises the same, before any collective
        raise ValueError(f"mixed_fsdp2 ({user_class_name(module)}): " + " ".join(model_problems))
    on_meta = has_meta_tensors(module)
    rng_state = torch.random.get_rng_state() if on_meta else None
    plan = plan_validated(module, config, bulk, shard_ranks=meshes.fsdp.shape[-1])
    problems = setup_problems(plan, config, cross_replica_reduce is not None or outer_exchange is not None)
    if problems:  # the same plan on every rank: every rank raises the same, before any collective
        raise ValueError(f"mixed_fsdp2 ({user_class_name(module)}): " + " ".join(problems))
    _on_rank_zero(lambda: [warnings.warn(f"mixed_fsdp2: {w}", stacklevel=3) for w in plan.warnings])
    if config.diagnostics.print_report:
        _on_rank_zero(lambda: _log_report(plan, module, parallelize is apply_hf_tensor_parallel, meshes))
    options = ApplyOptions.of(config)
    parallelize = parallelize or _identity
    module, applied = apply_plan(
        module, plan, meshes, device, parallelize, options, cross_replica_reduce, context_parallel, outer_exchange
    )
    if applied is None and (cross_replica_reduce is not None or outer_exchange is not None):
        raise ValueError(
            "mixed_fsdp2: fault_tolerance reduces every gradient across replica groups through the dtype plan's FSDP"
            " groups, but `parallelize_fn` (or `configure_model`) sharded the model with `fully_shard` itself. Remove"
            " `fully_shard` from it (tensor parallelism and wrappers may stay), or set fault_tolerance=None."
        )
    units: Sequence[str] = plan.outermost_units if applied is not None else ()
    if on_meta:
        initialise = config.weights.init_meta_params
        materialize_sharded(module, units, device, initialise=initialise, dtypes=plan.init_dtypes, rng_state=rng_state)
    elif applied is not None:
        sync_replicas(applied, meshes)
    if applied is not None:
        apply_buffer_sync(module, applied, config.buffers.sync, config.buffers.names, meshes)
    if applied is not None and config.diagnostics.check_dtype_leaks and plan.bulk.compute is not None:
        applied.handles.extend(install_leak_check(module, plan.bulk.compute, plan.keep_fp32_modules))
    _SET_UP.add(module)
    return ShardedModel(module, applied)


def setup_problems(plan: ShardPlan, config: MixedFSDPConfig, fault_tolerant: bool) -> List[str]:
    """What the plan cannot run with the config's parallelism: modules that run for some inputs only
    (``conditional.py``), semi-synchronous replicas (``semi_sync.py``)."""
    parallelism = config.parallelism
    problems = conditional_problems(plan, parallelism.context_parallel_size, fault_tolerant)
    return problems + semi_sync_problems(
        parallelism.replicate_sync,
        parallelism.context_parallel_size,
        parallelism.expert_parallel_size,
        config.memory.offload,
        config.float8.recipe,
        config.memory.quantize_base,
        config.sharding.compile,
    )


class ShardedModels:
    """The models one strategy set up, with their applied plans; the gradient-sync switch of gradient accumulation."""

    def __init__(self) -> None:
        self._applied: "WeakKeyDictionary[nn.Module, AppliedPlan]" = WeakKeyDictionary()

    def add(self, sharded: ShardedModel) -> nn.Module:
        if sharded.applied is not None:
            self._applied[sharded.module] = sharded.applied
        return sharded.module

    def modules(self) -> List[nn.Module]:
        """The models set up with a plan, in setup order."""
        return list(self._applied.keys())

    def plan_of(self, module: nn.Module) -> ShardPlan:
        module = unwrap_model(module)
        if module not in self._applied:
            raise KeyError(f"{type(module).__name__} was not set up by the mixed_fsdp2 strategy.")
        return self._applied[module].plan

    @contextmanager
    def no_sync(self, modules: Sequence[nn.Module], enabled: bool = True) -> Iterator[None]:
        """FSDP groups and replicated params skip their reduction; grads accumulate locally until a syncing
        backward reduces them once."""
        for module in modules:
            self.set_requires_gradient_sync(module, not enabled)
        try:
            yield
        finally:
            for module in modules:
                self.set_requires_gradient_sync(module, True)

    def after_optimizer_step(self) -> None:
        """What follows each optimizer step (the strategies call this): with ``buffer_sync="average"`` the floating
        buffers of every model become their mean over the data-parallel ranks; the float8 all-gather's scales are
        computed for the next step's all-gathers."""
        for applied in list(self._applied.values()):
            if applied.buffers is not None and applied.buffers.mode == "average":
                applied.buffers.average()
            for action in applied.after_step:
                action()

    def before_save(self) -> None:
        """Before a checkpoint is taken (the strategies call this on every rank): semi-synchronous replicas differ (in
        params mid-cycle, in their inner optimizers' states always), and a checkpoint keeps one copy of a replicated
        tensor, so they are made equal now (an early outer step, the next one still after step ``k * sync_every``;
        the optimizers' states averaged)."""
        for outer in self.outer_syncs():
            outer.before_save()

    def attach_optimizer(self, optimizer: Optimizer) -> None:
        """``optimizer``'s checkpoints carry the outer state of the semi-synchronous params it holds."""
        for applied in list(self._applied.values()):
            if applied.outer is not None:
                attach_outer_state(applied.outer, optimizer)

    def outer_syncs(self) -> List[OuterSync]:
        """The semi-synchronous models' outer syncs, in setup order."""
        return [applied.outer for applied in self._applied.values() if applied.outer is not None]

    @contextmanager
    def outer_state_in_checkpoint(self, enabled: bool = True) -> Iterator[None]:
        """Inside, the optimizers' state dicts carry the outer state (a save; a load of a checkpoint holding it)."""
        syncs = self.outer_syncs()
        for outer in syncs:
            outer.in_checkpoint = enabled
        try:
            yield
        finally:
            for outer in syncs:
                outer.in_checkpoint = False

    def before_optimizer_step(self) -> None:
        """What precedes each optimizer step (the strategies call this): semi-synchronous replicas take their outer
        state's starting point."""
        for applied in list(self._applied.values()):
            if applied.outer is not None:
                applied.outer.before_step()

    def set_requires_gradient_sync(self, module: nn.Module, requires_sync: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.set_requires_gradient_sync(requires_sync, recurse=False)
        applied = self._applied.get(unwrap_model(module))
        if applied is not None:
            applied.reducer.requires_gradient_sync = requires_sync


def mixed_dtype_fsdp_groups(module: nn.Module) -> List[str]:
    """FSDP modules (sharded by someone else) whose own trainable params mix dtypes, described
    (``layers.0: bfloat16, float32``): FSDP2 would refuse them at the first forward."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    fsdp_names = [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    for name in fsdp_names:
        owned = module.get_submodule(name)
        nested = [n for n in fsdp_names if n != name and is_within(n, name)]
        dtypes = {
            p.dtype
            for param_name, p in owned.named_parameters(prefix=name)
            if p.requires_grad and not any(is_within(param_name, n) for n in nested)
        }
        if len(dtypes) > 1:
            found.append(
                f"{canonical_name(name) or '<root>'}: {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}"
            )
    return found


def _log_report(plan: ShardPlan, module: nn.Module, own_split: bool, meshes: ParallelMeshes) -> None:
    """The dtype report, and the split the model's own tensor-parallel plan makes when it makes one."""
    log.info(format_plan(plan))
    if own_split:
        log.info(describe_split(module, _tensor_parallel_size(meshes)))


def _parallelize_or_own_plan(
    module: nn.Module, parallelize: Optional[ParallelizeFn], meshes: ParallelMeshes, split_in: str, float8: bool
) -> Tuple[Optional[ParallelizeFn], List[str]]:
    """The user's ``parallelize_fn``; without one, at ``tensor_parallel_size > 1``, a module the user split already
    (DTensor params: ``configure_model``) as it is, else the model's own HF plan and why it cannot split the model
    (one without a plan would compute the same whole projections on every TP rank). ``split_in``: where the user
    splits a model (``parallelize_fn``; the Trainer's ``configure_model``, where Lightning lets a model stay whole:
    a warning there, not a refusal)."""
    from torch.distributed.tensor import DTensor

    tensor_parallel = _tensor_parallel_size(meshes)
    if parallelize is not None or tensor_parallel == 1 or any(isinstance(p, DTensor) for p in module.parameters()):
        return parallelize, []
    problems = tensor_parallel_problems(module, tensor_parallel, split_in, float8)
    if problems and split_in == "configure_model" and hf_tensor_parallel_plan(module) is None and not float8:
        _on_rank_zero(lambda: warnings.warn(f"mixed_fsdp2 ({user_class_name(module)}): {problems[0]}", stacklevel=4))
        return parallelize, []
    return apply_hf_tensor_parallel, problems


def _tensor_parallel_size(meshes: ParallelMeshes) -> int:
    names = meshes.root.mesh_dim_names or ()
    return meshes.root[TENSOR_PARALLEL_DIM].size() if TENSOR_PARALLEL_DIM in names else 1


def _identity(module: nn.Module, _: Any) -> nn.Module:
    return module


def _on_rank_zero(action: Callable[[], Any]) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        action()
