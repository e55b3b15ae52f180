"""What the Fabric and Trainer strategies share: config intake, precision adoption, meshes, sharding a module (the
orchestration of plan -> apply -> materialise), atomic checkpoints and export."""

import uuid
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union
from weakref import WeakKeyDictionary, WeakSet

import torch
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.atomic import commit, is_sharded_checkpoint, recover, temp_sibling
from lightning_mixedfsdp.checkpoint.export import export_adapter, export_model
from lightning_mixedfsdp.checkpoint.meta import has_meta_tensors, materialize_sharded, meta_template
from lightning_mixedfsdp.config import BulkDtypes, MixedFSDPConfig, precision_problem
from lightning_mixedfsdp.diagnostics.leaks import install_leak_check
from lightning_mixedfsdp.precision import MixedFSDPPrecision
from lightning_mixedfsdp.sharding.apply import AppliedPlan, apply_plan, sync_replicas
from lightning_mixedfsdp.sharding.mesh import ParallelMeshes, build_parallel_meshes
from lightning_mixedfsdp.sharding.names import unwrap_model, user_class_name
from lightning_mixedfsdp.sharding.plan import ShardPlan, plan_validated
from lightning_mixedfsdp.strategies.process_group import destroy_process_group_at_exit

STRATEGY_NAME = "mixed_fsdp2"

ConfigInput = Union[MixedFSDPConfig, Mapping[str, Any], None]
# every module set up by any mixed_fsdp2 strategy: its params are sharded and hooked, a second setup cannot work
_SET_UP: "WeakSet[nn.Module]" = WeakSet()
ParallelizeFn = Callable[[nn.Module, Any], nn.Module]


def make_config(config: ConfigInput, fields: Dict[str, Any], owner: str) -> MixedFSDPConfig:
    """Merge a config object (or mapping, e.g. an OmegaConf block) with keyword fields; validate once."""
    if config is not None and not isinstance(config, (MixedFSDPConfig, Mapping)):
        raise TypeError(f"{owner}(config={config!r}) must be a MixedFSDPConfig or a mapping of its fields.")
    base = dict(config) if isinstance(config, Mapping) else asdict(config or MixedFSDPConfig())
    if fields.get("wrap_units") == "auto":
        fields = {**fields, "wrap_units": None}
    return MixedFSDPConfig.from_kwargs(**{**base, **fields}).validate()


def adopt_precision(
    plugin: Optional[Precision],
    config: MixedFSDPConfig,
    owner: str,
    plugin_class: Type[MixedFSDPPrecision],
    translatable: Tuple[type, ...],
) -> Optional[Precision]:
    """``plugin_class`` for the plugin's precision flag, with the bulk dtypes resolved from ``config``.

    Lightning's plugins built from a flag (exactly the ``translatable`` classes) are translated, and a
    :class:`MixedFSDPPrecision` passed by the user is rebuilt, so plugin and plan can never disagree; any other
    plugin is refused.
    """
    if plugin is None:
        return None
    flag = getattr(plugin, "precision", None)
    if not isinstance(plugin, MixedFSDPPrecision) and (
        type(plugin) not in translatable or precision_problem(flag) is not None
    ):
        raise ValueError(
            f"{owner} does not support the precision plugin {type(plugin).__name__} (precision={flag!r})."
            f" {precision_problem(flag) or 'Pass a precision flag instead of a custom plugin.'}"
        )
    return plugin_class(flag, config.bulk_dtypes(flag))


def validate_mesh_sizes(owner: str, data_parallel_size: Any, replicate_size: Any, tensor_parallel_size: Any) -> None:
    problems = []
    if data_parallel_size != "auto" and not (isinstance(data_parallel_size, int) and data_parallel_size >= 1):
        problems.append(f"data_parallel_size={data_parallel_size!r} must be 'auto' or an int >= 1")
    for name, value in (
        ("data_parallel_replicate_size", replicate_size),
        ("tensor_parallel_size", tensor_parallel_size),
    ):
        if not (isinstance(value, int) and value >= 1):
            problems.append(f"{name}={value!r} must be an int >= 1")
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems) + ".")


def no_parallelize(module: nn.Module, _: Any) -> nn.Module:
    """The default ``parallelize_fn``: no tensor parallelism, only the dtype plan."""
    return module


def shard_size(data_parallel_size: Any, replicate_size: int, tensor_parallel_size: int, world_size: int) -> int:
    if data_parallel_size != "auto":
        return data_parallel_size
    return max(world_size // (replicate_size * tensor_parallel_size), 1)


class ShardedModules:
    """Plans applied by one strategy, per module; also the gradient-sync switch for gradient accumulation."""

    def __init__(self) -> None:
        self._applied: "WeakKeyDictionary[nn.Module, AppliedPlan]" = WeakKeyDictionary()

    def shard(
        self,
        module: nn.Module,
        config: MixedFSDPConfig,
        bulk: BulkDtypes,
        meshes: ParallelMeshes,
        device: torch.device,
        parallelize: ParallelizeFn,
    ) -> nn.Module:
        """Plan, then apply the plan (casts, the user's parallelize_fn, FSDP, replicas), then materialise a meta model
        and install the optional leak check."""
        import torch.distributed as dist

        if module in _SET_UP:
            raise RuntimeError(
                f"{STRATEGY_NAME}: this {user_class_name(module)} is already set up (sharded, with hooks installed); a"
                " second setup would shard it again. Keep using the module the first setup returned, or build a"
                " fresh model to set up."
            )
        on_meta = has_meta_tensors(module)
        plan = plan_validated(module, config, bulk)
        for warning in plan.warnings:
            rank_zero_warn(f"{STRATEGY_NAME}: {warning}")
        if config.print_report:
            rank_zero_info(plan.report())
        # rank 0 alone initialises a meta model, on an unsharded copy in the dtypes it was built with, so values
        # match a single-process init (random draws depend on the dtype)
        template = meta_template(module) if on_meta and dist.get_rank() == 0 else None
        module, applied = apply_plan(
            module,
            plan,
            meshes,
            device,
            parallelize,
            reshard_after_forward=config.reshard_after_forward,
            checkpoint_every=config.checkpoint_every,
            compile_units=config.compile,
        )
        if applied is None:
            rank_zero_info(f"{STRATEGY_NAME}: the model is already sharded by the user; applying no dtype plan.")
            if on_meta:
                materialize_sharded(module, template, (), device, initialise=False)
            return module
        if on_meta:
            materialize_sharded(module, template, plan.units, device, initialise=config.init_meta_params)
        else:
            sync_replicas(applied, meshes)
        if config.check_dtype_leaks and plan.bulk.compute is not None:
            applied.handles.extend(install_leak_check(module, plan.bulk.compute, plan.keep_fp32_modules))
        self._applied[module] = applied
        _SET_UP.add(module)
        return module

    def plan_of(self, module: nn.Module) -> ShardPlan:
        module = unwrap_model(module)
        if module not in self._applied:
            raise KeyError(f"{type(module).__name__} was not set up by the {STRATEGY_NAME} strategy.")
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

    def set_requires_gradient_sync(self, module: nn.Module, requires_sync: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.set_requires_gradient_sync(requires_sync, recurse=False)
        applied = self._applied.get(module)
        if applied is not None:
            applied.reducer.requires_gradient_sync = requires_sync


class MixedFSDP2Mixin:
    """The parts of the Fabric and Trainer strategies that are the same: meshes, sampler, atomic checkpoints, plans
    and export. Mixed in before Lightning's ModelParallelStrategy of either package (``_lightning_strategy``)."""

    _lightning_strategy: type
    _config: MixedFSDPConfig
    _meshes: Optional[ParallelMeshes]
    _sharded: ShardedModules
    _replicate_size: int

    def _intake(
        self, config: ConfigInput, fields: Dict[str, Any], data_parallel_size: Any, replicate_size: int, tp_size: int
    ) -> None:
        """Before Lightning's ``__init__``, which already calls the precision setter that needs the config."""
        self._config = make_config(config, fields, type(self).__name__)
        validate_mesh_sizes(type(self).__name__, data_parallel_size, replicate_size, tp_size)
        self._replicate_size = replicate_size
        self._meshes = None
        self._sharded = ShardedModules()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="FSDP2 with dtype-grouped sharding for mixed-dtype models"
            )

    def _plugin_or_default(self, plugin: Optional[Precision], plugin_class: Type[MixedFSDPPrecision]) -> Any:
        """The adopted plugin; Lightning's default flag, ``"32-true"``, before the connector hands one over."""
        return plugin if plugin is not None else plugin_class("32-true", self._config.bulk_dtypes("32-true"))

    def _adopted(
        self, plugin: Optional[Precision], plugin_class: Type[MixedFSDPPrecision], translatable: Tuple[type, ...]
    ) -> Optional[Precision]:
        return adopt_precision(plugin, self._config, type(self).__name__, plugin_class, translatable)

    @property
    def config(self) -> MixedFSDPConfig:
        return self._config

    @property
    def meshes(self) -> ParallelMeshes:
        if self._meshes is None:
            raise RuntimeError(f"{type(self).__name__}: the device meshes exist only once the processes are launched.")
        return self._meshes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        mesh = self.meshes.data_parallel
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def setup_environment(self) -> None:
        # Lightning's ModelParallelStrategy would build its own 2-D mesh; ours adds the replicate dim (HSDP)
        super(self._lightning_strategy, self).setup_environment()  # the accelerator's device setup
        self._setup_distributed()
        destroy_process_group_at_exit()
        self._build_meshes()

    def _build_meshes(self) -> ParallelMeshes:
        shard = shard_size(self._data_parallel_size, self._replicate_size, self._tensor_parallel_size, self.world_size)
        self._data_parallel_size = shard
        self._meshes = build_parallel_meshes(
            self.root_device.type,
            self._replicate_size,
            shard,
            self._tensor_parallel_size,
            self.world_size,
            owner=type(self).__name__,
        )
        self._device_mesh = self._meshes.root
        return self._meshes

    def plan_of(self, module: nn.Module) -> ShardPlan:
        """The dtype plan applied to ``module`` (a model set up by this strategy)."""
        return self._sharded.plan_of(module)

    def export_safetensors(
        self,
        module: nn.Module,
        directory: Any,
        dtype: torch.dtype = torch.bfloat16,
        keep_fp32_patterns: Optional[Sequence[str]] = None,
        max_shard_bytes: int = 5 * 2**30,
    ) -> Optional[List[Path]]:
        """Consolidate ``module``'s weights into HF-style safetensors in ``dtype``; the plan's keep-fp32 params (or
        names matching ``keep_fp32_patterns``) and its fp32 buffers stay fp32. Every rank calls it; rank 0 writes."""
        keep = self.plan_of(module).fp32_names
        return export_model(module, directory, dtype, keep, keep_fp32_patterns, max_shard_bytes)

    def export_adapter(self, module: nn.Module, directory: Any) -> Optional[List[Path]]:
        """Write the active adapter of a PEFT ``module`` in PEFT's own format (``adapter_model.safetensors`` +
        ``adapter_config.json``); ``PeftModel.from_pretrained(base, directory)`` loads it. Every rank calls it."""
        self.plan_of(module)  # set up by this strategy
        return export_adapter(module, directory)

    def _save_atomically(self, path: Any, write: Callable[[Path], None]) -> None:
        """Write with ``write`` beside ``path``, then commit by rename on rank 0: a kill leaves a whole checkpoint."""
        path = Path(self.broadcast(path))
        if path.is_dir() and not self._save_distributed_checkpoint and not is_sharded_checkpoint(path):
            raise IsADirectoryError(
                f"{type(self).__name__}: the checkpoint path {str(path)!r} is a directory that is not a checkpoint;"
                " choose a file path for a full checkpoint."
            )
        token = self.broadcast(uuid.uuid4().hex[:12])
        temp = temp_sibling(path, token)
        write(temp)
        self.barrier()
        if self.global_rank == 0:
            commit(temp, path, token)
        self.barrier()

    def _recovered(self, path: Any) -> Path:
        """``path``, with the previous checkpoint put back first if a kill fell inside a commit."""
        path = Path(self.broadcast(path))
        if self.global_rank == 0:
            recover(path)
        self.barrier()
        return path
