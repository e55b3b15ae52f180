"""What the Fabric and Trainer strategies share: Lightning's hooks around the torch-only pipeline. Config and
precision intake (``MixedFSDPConfig.from_input``, ``precision.adopt_precision``), the meshes from ``ParallelDims``,
handing a module to ``shard_model``, and the optimizer-state hooks around Lightning's own save and load; the work
itself lives in the rooms below (``mesh.py``, ``pipeline.py``, ``checkpoint/``)."""

import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union
from weakref import WeakSet

import torch
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn
from torch.optim import Optimizer

from lightning_mixedfsdp.checkpoint.atomic import PathLike, recovered, save_atomically
from lightning_mixedfsdp.checkpoint.export import export_adapter, export_model
from lightning_mixedfsdp.checkpoint.optimizer_state import (
    AbsentState,
    restoring_missing_state,
    standing_in_for_state_ranks_lack,
)
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.fault_tolerance.heal import HealSources
from lightning_mixedfsdp.fault_tolerance.session import ReplicaGroupSession, check_fault_tolerance
from lightning_mixedfsdp.mesh import MeshSize, ParallelDims, ParallelizeFn, ParallelMeshes, check_sizes
from lightning_mixedfsdp.pipeline import ShardedModels, mixed_dtype_fsdp_groups, shard_model
from lightning_mixedfsdp.planning.planner import ShardPlan
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision, TPlugin, adopt_precision, plugin_or_default
from lightning_mixedfsdp.strategies.process_group import destroy_process_group_at_exit

STRATEGY_NAME = "mixed_fsdp2"
REPLICA_STATE_KEY = "torchft"
"""The checkpoint entry holding torchft's step counters, written under fault tolerance; a plain run ignores it."""

ConfigInput = Union[MixedFSDPConfig, Mapping[str, Any], None]


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
        self._config = MixedFSDPConfig.from_input(config, fields, type(self).__name__)
        check_sizes(data_parallel, replicate, tensor_parallel, type(self).__name__)
        if self._config.fault_tolerance is not None:  # the missing parts of fault tolerance fail before any launch
            check_fault_tolerance(self._config.fault_tolerance, type(self).__name__)
        self._replicate_size = replicate
        self._meshes = None
        self._sharded = ShardedModels()
        self._watched: "WeakSet[Optimizer]" = WeakSet()
        # in setup order, the same on every replica group: what a heal transfers, optimizer by optimizer
        self._optimizer_order: List["weakref.ref[Optimizer]"] = []
        self._replica_session: Optional[ReplicaGroupSession] = None
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
        assert plugin is None or isinstance(plugin, MixedFSDPPrecision)
        return plugin_or_default(plugin, self._config, plugin_class)

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
    def torchft_manager(self) -> Any:
        """torchft's own ``Manager`` of this replica group (``current_step()``, ``num_participants()``,
        ``register_state_dict_fn(...)`` for state a heal should carry, such as an LR scheduler under Fabric)."""
        if self._replica_session is None:
            raise RuntimeError(
                f"{type(self).__name__}: torchft_manager exists with fault_tolerance set, once the processes are"
                " launched (after `fabric.launch()`, or in the Trainer's fit)."
            )
        return self._replica_session.manager

    @property
    def replica_session(self) -> Optional[ReplicaGroupSession]:
        """This replica group's fault-tolerance session (None without ``fault_tolerance``)."""
        return self._replica_session

    @property
    def group_sampler_kwargs(self) -> dict:
        """The data-parallel ranks of this replica group alone: for evaluation, which every group runs on the whole
        held-out set (without fault tolerance, the same as ``distributed_sampler_kwargs``)."""
        mesh = self.meshes.data_parallel
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """The data-parallel ranks; under fault tolerance every replica group's ranks, so each group draws its own
        part of the data."""
        if self._replica_session is None:
            return self.group_sampler_kwargs
        mesh = self.meshes.data_parallel
        return self._replica_session.sampler_kwargs(mesh.size(), mesh.get_local_rank())

    def setup_environment(self) -> None:
        """Lightning's own: device, process group, and its 2-D ``("data_parallel", "tensor_parallel")`` mesh with its
        checks, for sizes :class:`~lightning_mixedfsdp.mesh.ParallelDims` resolved and validated first; HSDP and
        expert parallelism then build their meshes from the same dims."""
        dims = ParallelDims.resolve(
            self.num_nodes * self.num_processes,
            self.num_processes,
            self._data_parallel_size,
            self._replicate_size,
            self._tensor_parallel_size,
            self._config.expert_parallel_size,
            type(self).__name__,
        )
        # Lightning's own strategy sees replicate x shard as its data-parallel size
        self._data_parallel_size, self._tensor_parallel_size = dims.data_parallel, dims.tensor_parallel
        super().setup_environment()  # type: ignore[misc]
        destroy_process_group_at_exit()
        self._meshes = dims.build_meshes(self.root_device.type, self._device_mesh if dims.replicate == 1 else None)
        self._device_mesh = self._meshes.root
        settings = self._config.fault_tolerance
        if settings is not None and self._replica_session is None:
            self._replica_session = ReplicaGroupSession.start(
                settings,
                self.root_device,
                group_rank=self.global_rank,
                group_world_size=self.world_size,
                agree=lambda value: self.broadcast(value, src=0),
                sources=self._heal_sources,
                owner=type(self).__name__,
            )

    def _heal_sources(self) -> HealSources:
        optimizers = [optimizer for optimizer in (ref() for ref in self._optimizer_order) if optimizer is not None]
        return HealSources(self._sharded.modules(), optimizers, self._heal_others())

    def _heal_others(self) -> Sequence[Any]:
        """Other stateful objects a heal carries (the Trainer's LR schedulers)."""
        return ()

    def _commit_step(self, optimizer: Optimizer) -> bool:
        """Under fault tolerance, torchft's vote on this step: when it is discarded, its grads are dropped and
        ``optimizer`` does not step. Always True without."""
        if self._replica_session is None or self._making_optimizer_state:
            return True
        committed = self._replica_session.commit()
        if not committed:
            optimizer.zero_grad(set_to_none=True)
        return committed

    def writes_checkpoints(self) -> bool:
        """Whether this launch writes checkpoints: always, except under fault tolerance, where one live replica
        group writes each."""
        return self._replica_session is None or self._replica_session.writes_checkpoints()

    def _with_replica_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if self._replica_session is None:
            return state
        return {**state, REPLICA_STATE_KEY: self._replica_session.state_dict()}

    def _restore_replica_state(self, remainder: Dict[str, Any]) -> None:
        """Take torchft's step counters out of a loaded checkpoint's remainder; restore them under fault
        tolerance (a plain run drops them)."""
        replica_state = remainder.pop(REPLICA_STATE_KEY, None)
        if replica_state is not None and self._replica_session is not None:
            self._replica_session.load_state_dict(replica_state)

    def _end_fault_tolerance(self) -> None:
        if self._replica_session is not None:
            self._replica_session.shutdown()
            self._replica_session = None

    def _shard(
        self, module: nn.Module, precision: MixedFSDPPrecision, parallelize: Optional[ParallelizeFn]
    ) -> nn.Module:
        """Hand ``module`` to the pipeline; a module the user's ``parallelize_fn`` sharded itself gets Lightning's own
        precision semantics (autocast under ``bf16-mixed``), and FSDP groups it made with mixed dtypes are refused."""
        refuse_fsdp1_modules(module, type(self).__name__)
        session = self._replica_session
        sharded = shard_model(
            module,
            self._config,
            precision.bulk,
            self.meshes,
            self.root_device,
            parallelize,
            cross_replica_reduce=session.reduce if session is not None else None,
        )
        if session is not None and sharded.applied is not None:
            sharded.applied.handles.append(session.watch(sharded.module))
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
        """After each step of ``optimizer`` (hooked once per optimizer, however often it is set up): the models'
        buffers averaged (``buffer_sync="average"``), the float8 all-gather's scales computed (``float8``)."""
        if optimizer not in self._watched:
            optimizer.register_step_post_hook(self._after_optimizer_step)
            self._watched.add(optimizer)
            self._optimizer_order.append(weakref.ref(optimizer))

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
        single_file = not self._save_distributed_checkpoint
        rank_zero = self.global_rank == 0
        save_atomically(path, write, single_file, self.broadcast, self.barrier, rank_zero, type(self).__name__)

    def _recovered(self, path: PathLike) -> Path:
        return recovered(path, self.broadcast, self.barrier, self.global_rank == 0)

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
