"""What the Fabric and Trainer strategies share: config intake, precision adoption, Lightning's mesh contract (plus
HSDP), handing a module to the pipeline, atomic checkpoints and export. Nothing here shards: the torch-only pipeline
(``pipeline.py``) does; these are the adapters that let Lightning drive it."""

import uuid
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Tuple, Type, TypeVar, Union
from weakref import WeakSet

import torch
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn
from torch.optim import Optimizer

from lightning_mixedfsdp.checkpoint.atomic import (
    PathLike,
    commit,
    foreign_entries,
    is_sharded_checkpoint,
    recover,
    temp_sibling,
)
from lightning_mixedfsdp.checkpoint.export import export_adapter, export_model
from lightning_mixedfsdp.checkpoint.optimizer_state import (
    AbsentState,
    restoring_missing_state,
    standing_in_for_state_ranks_lack,
)
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.mesh import (
    TENSOR_PARALLEL,
    ParallelMeshes,
    build_expert_meshes,
    build_parallel_meshes,
    check_expert_parallel_size,
    check_mesh_product,
    meshes_of_2d,
)
from lightning_mixedfsdp.pipeline import ParallelizeFn, ShardedModels, mixed_dtype_fsdp_groups, shard_model
from lightning_mixedfsdp.planning.planner import ShardPlan
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision
from lightning_mixedfsdp.strategies.process_group import destroy_process_group_at_exit

STRATEGY_NAME = "mixed_fsdp2"

ConfigInput = Union[MixedFSDPConfig, Mapping[str, Any], None]
MeshSize = Union[Literal["auto"], int]
TPlugin = TypeVar("TPlugin", bound=MixedFSDPPrecision)


def make_config(config: ConfigInput, fields: Dict[str, Any], owner: str) -> MixedFSDPConfig:
    """Merge a config object (or mapping, e.g. an OmegaConf block) with keyword fields; validate once."""
    if config is not None and not isinstance(config, (MixedFSDPConfig, Mapping)):
        raise TypeError(f"{owner}(config={config!r}) must be a MixedFSDPConfig or a mapping of its fields.")
    base = dict(config) if isinstance(config, Mapping) else asdict(config or MixedFSDPConfig())
    if fields.get("wrap_units") == "auto":
        fields = {**fields, "wrap_units": None}
    return MixedFSDPConfig.from_kwargs(**{**base, **fields}).validate()


def adopt_precision(
    plugin: Any,
    config: MixedFSDPConfig,
    owner: str,
    plugin_class: Type[TPlugin],
    translatable: Tuple[type, ...],
) -> Optional[TPlugin]:
    """``plugin_class`` for the plugin's precision flag, with the bulk dtypes resolved from ``config``.

    Lightning's plugins built from a flag (exactly the ``translatable`` classes) are translated, and a
    :class:`MixedFSDPPrecision` passed by the user is rebuilt, so plugin and plan can never disagree; any other
    plugin is refused. The flag is checked once, where the bulk dtypes are resolved.
    """
    if plugin is None:
        return None
    flag = getattr(plugin, "precision", None)
    if not isinstance(plugin, MixedFSDPPrecision) and type(plugin) not in translatable:
        raise ValueError(
            f"{owner} does not support the precision plugin {type(plugin).__name__} (precision={flag!r}). Pass a"
            " precision flag instead of a custom plugin."
        )
    return plugin_class(flag, config.bulk_dtypes(str(flag), owner))  # type: ignore[arg-type]


def check_mesh_sizes(owner: str, data_parallel_size: Any, replicate_size: Any, tensor_parallel_size: Any) -> None:
    """Sizes that can never be right, refused at construction (Lightning's own checks come at launch)."""
    problems = []
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if value != "auto" and not (isinstance(value, int) and value >= 1):
            problems.append(f"{name}={value!r} must be 'auto' or an int >= 1")
    if not (isinstance(replicate_size, int) and replicate_size >= 1):
        problems.append(f"data_parallel_replicate_size={replicate_size!r} must be an int >= 1")
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems) + ".")


def refuse_fsdp1_modules(module: nn.Module, owner: str) -> None:
    """Lightning's own guard, with its type and message: FSDP1-wrapped modules cannot be sharded again."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`."
            f" The `{owner}` only supports the new FSDP2 APIs in PyTorch >= 2.4."
        )


class MixedFSDP2Mixin:
    """The parts of the Fabric and Trainer strategies that are the same. Mixed in before Lightning's
    ModelParallelStrategy of either package, whose own ``setup_environment`` builds the device mesh."""

    _config: MixedFSDPConfig
    _meshes: Optional[ParallelMeshes]
    _sharded: ShardedModels
    _replicate_size: int
    _data_parallel_size: MeshSize
    _tensor_parallel_size: MeshSize
    _device_mesh: Any
    _save_distributed_checkpoint: bool

    # provided by Lightning's strategies
    num_nodes: int
    num_processes: int
    world_size: int
    global_rank: int
    root_device: torch.device
    broadcast: Callable[..., Any]
    barrier: Callable[..., Any]

    def _intake(
        self, config: ConfigInput, fields: Dict[str, Any], data_parallel: Any, replicate: int, tensor_parallel: Any
    ) -> None:
        """Before Lightning's ``__init__``, which already calls the precision setter that needs the config."""
        self._config = make_config(config, fields, type(self).__name__)
        check_mesh_sizes(type(self).__name__, data_parallel, replicate, tensor_parallel)
        self._replicate_size = replicate
        self._meshes = None
        self._sharded = ShardedModels()
        self._watched: "WeakSet[Optimizer]" = WeakSet()
        # the zero-lr steps that make optimizer state around a save or load are no training steps
        self._making_optimizer_state = False

    # the methods below override those of the Lightning strategy this class is mixed into (the type checker sees no
    # base here, so they carry no @override)
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="FSDP2 with dtype-grouped sharding for mixed-dtype models"
            )

    def _plugin_or_default(self, plugin: Optional[Precision], plugin_class: Type[TPlugin]) -> TPlugin:
        """The adopted plugin; Lightning's default flag, ``"32-true"``, before the connector hands one over."""
        if plugin is None:
            return plugin_class("32-true", self._config.bulk_dtypes("32-true"))
        assert isinstance(plugin, plugin_class)  # the precision setter adopted it
        return plugin

    def _adopted(self, plugin: Any, plugin_class: Type[TPlugin], translatable: Tuple[type, ...]) -> Optional[TPlugin]:
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
    def distributed_sampler_kwargs(self) -> dict:
        mesh = self.meshes.data_parallel
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    def setup_environment(self) -> None:
        """Lightning's own: device, process group, and its 2-D ``("data_parallel", "tensor_parallel")`` mesh with its
        checks, for sizes resolved here first; HSDP then builds the replicate x shard x tensor-parallel mesh."""
        shard, tensor_parallel = self._resolved_sizes()
        if self._replicate_size > 1:  # Lightning's own check sees only replicate x shard
            world = self.num_nodes * self.num_processes
            check_mesh_product(self._replicate_size, shard, tensor_parallel, world, type(self).__name__)
        experts = self._config.expert_parallel_size
        if experts > 1:
            check_expert_parallel_size(experts, shard, tensor_parallel, type(self).__name__)
        self._data_parallel_size = self._replicate_size * shard
        self._tensor_parallel_size = tensor_parallel
        super().setup_environment()  # type: ignore[misc]
        destroy_process_group_at_exit()
        if self._replicate_size == 1:
            self._meshes = meshes_of_2d(self._device_mesh)
        else:
            self._meshes = build_parallel_meshes(
                self.root_device.type,
                self._replicate_size,
                shard,
                tensor_parallel,
                self.world_size,
                type(self).__name__,
            )
            self._device_mesh = self._meshes.root
        if experts > 1:
            expert_meshes = build_expert_meshes(
                self.root_device.type, self._replicate_size, shard, experts, self._meshes.root[TENSOR_PARALLEL]
            )
            self._meshes = replace(self._meshes, experts=expert_meshes)

    def _resolved_sizes(self) -> Tuple[int, int]:
        """(shard, tensor parallel). ``tensor_parallel_size="auto"`` is the devices of a node, as in Lightning;
        ``data_parallel_size="auto"`` takes every rank the others leave (Lightning's: the number of nodes, which is
        the same when tensor parallelism is ``"auto"``)."""
        world = self.num_nodes * self.num_processes
        tensor_parallel = self.num_processes if self._tensor_parallel_size == "auto" else self._tensor_parallel_size
        if self._data_parallel_size != "auto":
            return int(self._data_parallel_size), int(tensor_parallel)
        return max(world // (self._replicate_size * int(tensor_parallel)), 1), int(tensor_parallel)

    def _shard(
        self, module: nn.Module, precision: MixedFSDPPrecision, parallelize: Optional[ParallelizeFn]
    ) -> nn.Module:
        """Hand ``module`` to the pipeline; a module the user's ``parallelize_fn`` sharded itself gets Lightning's own
        precision semantics (autocast under ``bf16-mixed``), and FSDP groups it made with mixed dtypes are refused."""
        refuse_fsdp1_modules(module, type(self).__name__)
        sharded = shard_model(module, self._config, precision.bulk, self.meshes, self.root_device, parallelize)
        if sharded.applied is None:
            mixed = mixed_dtype_fsdp_groups(sharded.module)
            if mixed:
                raise TypeError(
                    f"{type(self).__name__}: your `parallelize_fn` called `fully_shard` on modules whose trainable"
                    f" params mix dtypes after the dtype plan's casts ({'; '.join(mixed[:3])}), which FSDP2 refuses."
                    " Remove `fully_shard` from `parallelize_fn` and let mixed_fsdp2 shard (tensor parallelism may"
                    " stay), or give each keep-fp32 module its own `fully_shard`, or set keep_fp32_modules=[] and"
                    " keep_fp32_params=[] to store everything in one dtype."
                )
            precision.follow_lightning(self.root_device.type)
        return self._sharded.add(sharded)

    def _watch_optimizer(self, optimizer: Optimizer) -> None:
        """``buffer_sync="average"``: average the models' buffers after each step of ``optimizer`` (once per
        optimizer, however often it is set up)."""
        if self._config.buffer_sync == "average" and optimizer not in self._watched:
            optimizer.register_step_post_hook(self._after_optimizer_step)
            self._watched.add(optimizer)

    @contextmanager
    def _saving_optimizers(
        self, module: Optional[nn.Module], optimizers: Dict[str, Optimizer]
    ) -> Iterator[AbsentState]:
        """Around Lightning's save: params whose state only some ranks hold get a stand-in on the others
        (``checkpoint/optimizer_state.py``); yields the record to save under ``ABSENT_STATE_KEY`` (empty: none)."""
        self._making_optimizer_state = True
        try:
            if module is None or not optimizers:
                yield {}
            else:
                with standing_in_for_state_ranks_lack(module, optimizers) as absent:
                    yield absent
        finally:
            self._making_optimizer_state = False

    def _after_optimizer_step(self, *_: Any) -> None:
        if not self._making_optimizer_state:
            self._sharded.after_optimizer_step()

    def plan_of(self, module: nn.Module) -> ShardPlan:
        """The dtype plan applied to ``module`` (a model set up by this strategy)."""
        return self._sharded.plan_of(module)

    def export_safetensors(
        self,
        module: nn.Module,
        directory: PathLike,
        dtype: torch.dtype = torch.bfloat16,
        max_shard_bytes: int = 5 * 2**30,
    ) -> Optional[List[Path]]:
        """Consolidate ``module``'s weights into HF-style safetensors in ``dtype``; the tensors the plan keeps in fp32
        (keep-fp32 params, fp32 buffers) stay fp32. Every rank calls it; rank 0 writes."""
        return export_model(module, directory, dtype, self.plan_of(module), max_shard_bytes)

    def export_adapter(self, module: nn.Module, directory: PathLike) -> Optional[List[Path]]:
        """Write the active adapter of a PEFT ``module`` in PEFT's own format (``adapter_model.safetensors`` +
        ``adapter_config.json``); ``PeftModel.from_pretrained(base, directory)`` loads it. Every rank calls it."""
        self.plan_of(module)  # set up by this strategy
        return export_adapter(module, directory)

    def _save_atomically(self, path: PathLike, write: Callable[[Path], None]) -> None:
        """Write with ``write`` beside ``path``, then commit by rename on rank 0: a kill leaves a whole checkpoint, and
        the user's files in an existing folder stay."""
        path = Path(self.broadcast(path))
        if path.is_dir() and not self._save_distributed_checkpoint:
            if not is_sharded_checkpoint(path):
                raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
            foreign = foreign_entries(path)
            if foreign:
                raise IsADirectoryError(
                    f"{type(self).__name__}: replacing the sharded checkpoint {str(path)!r} with a single file would"
                    f" remove files it did not write: {[e.name for e in foreign[:5]]}. Move them out, or save to"
                    " another path."
                )
        token = self.broadcast(uuid.uuid4().hex[:12])
        temp = temp_sibling(path, token)
        write(temp)
        self.barrier()
        if self.global_rank == 0:
            commit(temp, path, token)
        self.barrier()

    def _recovered(self, path: PathLike) -> Path:
        """``path``, with an interrupted commit finished first (the previous checkpoint put back if needed)."""
        path = Path(self.broadcast(path))
        if self.global_rank == 0:
            recover(path)
        self.barrier()
        return path

    @contextmanager
    def _loading_optimizers(
        self,
        path: Path,
        module: Optional[nn.Module],
        optimizers: Dict[str, Optimizer],
        weights_only: Optional[bool] = None,
    ) -> Iterator[None]:
        """Around Lightning's load: params whose state the checkpoint lacks (they never got a grad) resume as "no
        state yet" (``checkpoint/optimizer_state.py``), and the zero-lr steps torch takes to make optimizer state
        are no training steps (no buffer averaging)."""
        self._making_optimizer_state = True
        try:
            if module is None or not optimizers:
                yield  # Lightning's load raises its own error, or has no optimizer to load
            else:
                with restoring_missing_state(path, module, optimizers, weights_only):
                    yield
        finally:
            self._making_optimizer_state = False
