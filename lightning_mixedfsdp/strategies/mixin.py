"""What the Fabric and Trainer strategies share: Lightning's hooks around the torch-only model setup. The settings
(``intake.py``), the meshes from ``ParallelDims``, handing a module to ``shard_model``, context parallelism's split,
the optimizer hooks, and fault tolerance's hooks (``fault_tolerance/hooks.py``); the save, load and export sequences
are ``checkpointing.py``'s, the work itself lives in the rooms below."""

import os
import weakref
from typing import Any, Callable, List, Optional, Sequence
from weakref import WeakSet

from torch import nn
from torch.optim import Optimizer

from lightning_mixedfsdp.apply.bf16_updates import install_bf16_updates
from lightning_mixedfsdp.apply.context_parallel import ContextParallel
from lightning_mixedfsdp.apply.muon import install_sharded_muon
from lightning_mixedfsdp.apply.optimizers import refuse_whole_matrix_optimizer
from lightning_mixedfsdp.apply.semi_sync_checkpoint import without_outer_state
from lightning_mixedfsdp.fault_tolerance.heal import HealSources
from lightning_mixedfsdp.fault_tolerance.hooks import NoFaultTolerance
from lightning_mixedfsdp.mesh import MeshSize, ParallelDims, ParallelizeFn, ParallelMeshes, semi_synchronous
from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.model_setup import ShardedModels, mixed_dtype_fsdp_groups, shard_model
from lightning_mixedfsdp.planning.types import ShardPlan
from lightning_mixedfsdp.strategies.checkpointing import CheckpointingMixin
from lightning_mixedfsdp.strategies.intake import IntakeMixin
from lightning_mixedfsdp.strategies.pipelined import PipelineMixin
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision
from lightning_mixedfsdp.strategies.process_group import destroy_process_group_at_exit


def refuse_fsdp1_modules(module: nn.Module, owner: str) -> None:
    """Lightning's own guard, with its type and message: FSDP1-wrapped modules cannot be sharded again."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`."
            f" The `{owner}` only supports the new FSDP2 APIs in PyTorch >= 2.4."
        )


class MixedFSDP2Mixin(IntakeMixin, CheckpointingMixin, PipelineMixin):
    """The parts of the Fabric and Trainer strategies that are the same. Mixed in before Lightning's
    ModelParallelStrategy of either package, whose own ``setup_environment`` builds the device mesh."""

    _meshes: Optional[ParallelMeshes]
    _sharded: ShardedModels
    _data_parallel_size: MeshSize
    _tensor_parallel_size: MeshSize
    _device_mesh: Any

    # provided by Lightning's strategies
    num_nodes: int
    num_processes: int
    world_size: int  # root_device: declared by PipelineMixin

    def _reset_state(self) -> None:
        """Called by :meth:`IntakeMixin._intake`, before Lightning's ``__init__``."""
        self._meshes = None
        self._context_parallel: Optional[ContextParallel] = None
        self._sharded = ShardedModels()
        self._watched: "WeakSet[Optimizer]" = WeakSet()
        # in setup order, the same on every replica group: what a heal transfers, optimizer by optimizer
        self._optimizer_order: List["weakref.ref[Optimizer]"] = []
        # the zero-lr steps that make optimizer state around a save or load are no training steps
        self._making_optimizer_state = False
        self._init_pipelines()

    @property
    def meshes(self) -> ParallelMeshes:
        if self._meshes is None:
            raise RuntimeError(f"{type(self).__name__}: the device meshes exist only once the processes are launched.")
        return self._meshes

    @property
    def context_parallel(self) -> ContextParallel:
        """Context parallelism for a loop that is not an HF causal LM's: ``split(...)`` (this rank's part of the
        next forward's tensors; attention runs as ring attention until its backward ends), ``loss(...)`` (the whole
        sequence's mean from this rank's part) and ``gather(...)``; each hands tensors back unchanged at
        ``context_parallel_size=1``. An HF causal LM needs none of it: the strategy splits its calls itself."""
        if self._context_parallel is None:
            raise RuntimeError(f"{type(self).__name__}: context parallelism exists once the processes are launched.")
        return self._context_parallel

    @property
    def fault_tolerance(self) -> NoFaultTolerance:
        """Fault tolerance's hooks: torchft's replica groups (``fault_tolerance/hooks.py``), or none."""
        return self._fault_tolerance

    @property
    def torchft_manager(self) -> Any:
        """torchft's own ``Manager`` of this replica group (``current_step()``, ``num_participants()``,
        ``register_state_dict_fn(...)`` for state a heal should carry, such as an LR scheduler under Fabric)."""
        return self._fault_tolerance.manager

    @property
    def group_sampler_kwargs(self) -> dict:
        """The data-parallel ranks of this replica group alone: for evaluation, which every group runs on the whole
        held-out set (without fault tolerance, the same as ``distributed_sampler_kwargs``)."""
        mesh = self.meshes.data_parallel
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """The data-parallel ranks; under fault tolerance every replica group's, so each group draws its own part."""
        mesh = self.meshes.data_parallel
        return self._fault_tolerance.sampler_kwargs(mesh.size(), mesh.get_local_rank())

    def setup_environment(self) -> None:
        """Lightning's own: device, process group, and its 2-D ``("data_parallel", "tensor_parallel")`` mesh with its
        checks, for sizes :class:`~lightning_mixedfsdp.mesh.ParallelDims` resolved and validated first; HSDP and
        expert parallelism then build their meshes from the same dims."""
        parallelism = self._config.parallelism
        dims = ParallelDims.resolve(
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            data_parallel_size=parallelism.data_parallel_size,
            replicate=parallelism.data_parallel_replicate_size,
            tensor_parallel_size=parallelism.tensor_parallel_size,
            expert_parallel=parallelism.expert_parallel_size,
            context_parallel=parallelism.context_parallel_size,
            pipeline=parallelism.pipeline_parallel_size,
            owner=type(self).__name__,
        )
        # Lightning's own strategy sees every rank tensor parallelism leaves as its data-parallel size
        self._data_parallel_size, self._tensor_parallel_size = dims.lightning_data_parallel, dims.tensor_parallel
        super().setup_environment()  # type: ignore[misc]
        destroy_process_group_at_exit()
        self._meshes = dims.build_meshes(self.root_device.type, self._device_mesh if dims.replicate == 1 else None)
        if parallelism.replicate_sync != "every_step" and self._config.fault_tolerance is None:
            self._meshes = semi_synchronous(self._meshes)  # under fault tolerance the replica groups sync instead
        self._device_mesh = self._meshes.root
        rotate = self._config.parallelism.context_parallel_rotate
        self._context_parallel = ContextParallel(self._meshes.context_parallel, rotate)
        agree: Callable[[Any], Any] = lambda value: self.broadcast(value, src=0)  # noqa: E731
        self._fault_tolerance.start(self.root_device, self.global_rank, self.world_size, agree, self._heal_sources)

    def _heal_sources(self) -> HealSources:
        optimizers = [optimizer for optimizer in (ref() for ref in self._optimizer_order) if optimizer is not None]
        return HealSources(self._sharded.modules(), optimizers, [*self._heal_others(), *self._sharded.outer_syncs()])

    def _heal_others(self) -> Sequence[Any]:
        """Other stateful objects a heal carries (the Trainer's LR schedulers)."""
        return ()

    def _commit_step(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` may step: under fault tolerance torchft's vote on this step (a discarded step's
        grads are dropped); the zero-lr steps that make optimizer state around a save or load always may."""
        return self._making_optimizer_state or self._fault_tolerance.commit(optimizer)

    def writes_checkpoints(self) -> bool:
        """Whether this launch writes checkpoints: always, except under fault tolerance, where one live replica
        group writes each."""
        return self._fault_tolerance.writes_checkpoints()

    def _shard(
        self, module: nn.Module, precision: MixedFSDPPrecision, parallelize: Optional[ParallelizeFn]
    ) -> nn.Module:
        """Hand ``module`` to the model setup (cut to this rank's pipeline stages first, under pipeline parallelism); a
        module the user's ``parallelize_fn`` sharded itself gets Lightning's own precision semantics (autocast under
        ``bf16-mixed``), and FSDP groups it made with mixed dtypes are refused."""
        refuse_fsdp1_modules(module, type(self).__name__)
        complete_stages = self._cut_to_stages(module, parallelize) if self.pipelined else None
        sharded = shard_model(
            module,
            self._config,
            precision.bulk,
            self.meshes,
            self.root_device,
            parallelize,
            self._fault_tolerance.cross_replica_reduce,
            self._context_parallel,
            self._fault_tolerance.outer_exchange,
            split_in=self._split_in,
        )
        if complete_stages is not None:
            complete_stages(sharded)
        if sharded.applied is not None:
            sharded.applied.handles.extend(self._fault_tolerance.watch(sharded.module))
        else:
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
        """After each step of ``optimizer`` (hooked once per optimizer, however often it is set up): the bf16
        params' updates written back by ``dtypes.bf16_updates``, the models' buffers averaged (``buffers.sync=
        "average"``), the float8 all-gather's scales computed (``float8``); its checkpoints carry the outer state of
        semi-synchronous replicas (``replicate_sync``). Muon (``torch.optim.Muon``, ``MuonWithAdamW``) computes each
        matrix's update whole (``apply/muon.py``); another optimizer that would compute each update from a shard of a
        matrix it needs whole is refused first."""
        # before the hooks below, once: the step's own writes first, so the hooks after it see the step's params
        _install_step(optimizer, self._sharded.modules(), self._config.dtypes.bf16_updates, type(self).__name__)
        if optimizer not in self._watched:
            optimizer.register_step_pre_hook(self._before_optimizer_step)
            optimizer.register_step_post_hook(self._after_optimizer_step)
            self._sharded.attach_optimizer(optimizer)
            # after the outer syncs' own: what none of them took (a semi-synchronous run's checkpoint loaded here)
            optimizer.register_load_state_dict_pre_hook(without_outer_state)
            self._watched.add(optimizer)
            self._optimizer_order.append(weakref.ref(optimizer))

    def _before_optimizer_step(self, *_: Any) -> None:
        if not self._making_optimizer_state:
            self._sharded.before_optimizer_step()

    def _after_optimizer_step(self, *_: Any) -> None:
        if not self._making_optimizer_state:
            self._sharded.after_optimizer_step()

    def plan_of(self, module: nn.Module) -> ShardPlan:
        """The dtype plan applied to ``module`` (a model set up by this strategy)."""
        return self._sharded.plan_of(module)


def _install_step(optimizer: Optimizer, modules: Sequence[nn.Module], bf16_updates: str, owner: str) -> None:
    """The step ``optimizer`` runs under the strategy: Muon's, each matrix orthogonalised whole (``apply/muon.py``),
    or its own with the bf16 params' write-back (``apply/bf16_updates.py``); an optimizer that needs whole matrices
    and is not Muon is refused. Each install happens once however often it is asked; the refusals every time."""
    names = {id(p): canonical_name(n) for module in modules for n, p in module.named_parameters()}
    if install_sharded_muon(optimizer, names, bf16_updates, owner):
        return
    refuse_whole_matrix_optimizer(optimizer, owner)
    install_bf16_updates(optimizer, bf16_updates, _run_seed, owner)  # type: ignore[arg-type]


def _run_seed() -> int:
    """The seed Lightning's ``seed_everything`` set (0 when none is)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
