"""``Fabric(strategy="mixed_fsdp2")``: Lightning's ModelParallelStrategy with dtype-grouped FSDP2."""

import uuid
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.checkpoint import commit, export_model, is_sharded_checkpoint, recover, temp_sibling
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.core import (
    STRATEGY_NAME,
    ConfigInput,
    ShardedModules,
    adopt_precision,
    default_timeout,
    make_config,
    shard_size,
    validate_mesh_sizes,
)
from lightning_mixedfsdp.gradients import clip_grad_norm_
from lightning_mixedfsdp.mesh import ParallelMeshes, build_parallel_meshes
from lightning_mixedfsdp.plan import ShardPlan
from lightning_mixedfsdp.precision import MixedFSDPPrecision


class MixedFSDP2Strategy(ModelParallelStrategy):
    """FSDP2 for models whose params mix dtypes: keep-fp32 params stay fp32, no hand-written ``fully_shard``.

    Arguments:
        config: A :class:`~lightning_mixedfsdp.MixedFSDPConfig` (or a mapping of its fields). Keyword ``fields``
            override it, e.g. ``MixedFSDP2Strategy(keep_fp32_params=[r"A_log$"])``.
        parallelize_fn: Optional ``fn(model, device_mesh) -> model`` (e.g. tensor parallelism) run before the
            dtype-grouped FSDP on the data-parallel mesh. If it shards with FSDP itself, no plan is applied.
        data_parallel_size: Ranks a param is sharded over. ``"auto"``: world size / (replicate x tensor parallel),
            i.e. pure data parallelism over all ranks by default.
        data_parallel_replicate_size: HSDP: replicas of the sharded model (e.g. one per node). 1 means plain FSDP.
        tensor_parallel_size: Size of the ``"tensor_parallel"`` mesh dim handed to ``parallelize_fn``.
    """

    def __init__(
        self,
        config: ConfigInput = None,
        *,
        parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]] = None,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        data_parallel_replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_timeout(),
        **fields: Any,
    ) -> None:
        self._config = make_config(config, fields, type(self).__name__)
        validate_mesh_sizes(type(self).__name__, data_parallel_size, data_parallel_replicate_size, tensor_parallel_size)
        super().__init__(
            parallelize_fn=parallelize_fn or _no_parallelize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._replicate_size = data_parallel_replicate_size
        self._meshes: Optional[ParallelMeshes] = None
        self._sharded = ShardedModules()
        self._backward_sync_control = _MixedBackwardSyncControl(self._sharded)

    @property
    def config(self) -> MixedFSDPConfig:
        return self._config

    @property
    def meshes(self) -> ParallelMeshes:
        if self._meshes is None:
            raise RuntimeError(f"{type(self).__name__}: the device meshes exist only after `fabric.launch()`.")
        return self._meshes

    @property  # type: ignore[override]
    @override
    def precision(self) -> MixedFSDPPrecision:
        return self._precision if self._precision is not None else MixedFSDPPrecision("32-true", self._config)

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # the connector hands us Lightning's plugin for a precision flag; Lightning's bf16-true would cast the
        # keep-fp32 params to bf16 before sharding, so translate it
        self._precision = adopt_precision(precision, self._config, type(self).__name__)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        mesh = self.meshes.data_parallel
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        shard = shard_size(self._data_parallel_size, self._replicate_size, self._tensor_parallel_size, self.world_size)
        self._data_parallel_size = shard
        self._meshes = build_parallel_meshes(
            self.root_device.type, self._replicate_size, shard, self._tensor_parallel_size, self.world_size
        )
        self._device_mesh = self._meshes.root

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._sharded.shard(
            module, self._config, self.precision, self.meshes, self.root_device, self._parallelize_fn
        )

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: Dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Lightning's save (a DCP folder, or one file with ``save_distributed_checkpoint=False``), written beside
        ``path`` and committed by rename: a save killed midway leaves the previous checkpoint intact."""
        path = Path(self.broadcast(path))
        if path.is_dir() and not self._save_distributed_checkpoint and not is_sharded_checkpoint(path):
            raise IsADirectoryError(
                f"{type(self).__name__}: the checkpoint path {str(path)!r} is a directory that is not a checkpoint;"
                " choose a file path for a full checkpoint."
            )
        token = self.broadcast(uuid.uuid4().hex[:12])
        temp = temp_sibling(path, token)
        super().save_checkpoint(temp, state, storage_options=storage_options, filter=filter)
        self.barrier()
        if self.global_rank == 0:
            commit(temp, path, token)
        self.barrier()

    @override
    def load_checkpoint(
        self, path: Any, state: Optional[Any] = None, strict: bool = True, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        path = Path(self.broadcast(path))
        if self.global_rank == 0:
            recover(path)
        self.barrier()
        return super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)

    def export_safetensors(
        self,
        module: nn.Module,
        directory: Any,
        dtype: torch.dtype = torch.bfloat16,
        keep_fp32_patterns: Optional[Sequence[str]] = None,
        max_shard_bytes: int = 5 * 2**30,
    ) -> Optional[List[Path]]:
        """Consolidate ``module``'s weights into HF-style safetensors in ``dtype``; the plan's keep-fp32 params (or
        names matching ``keep_fp32_patterns``) stay fp32. Every rank calls it; rank 0 writes."""
        plan = self.plan_of(module)
        keep = [name for name, p in plan.params.items() if p.rule is not None]
        return export_model(module, directory, dtype, keep, keep_fp32_patterns, max_shard_bytes)

    def plan_of(self, module: nn.Module) -> ShardPlan:
        """The dtype plan applied to ``module`` (a model returned by ``fabric.setup``)."""
        return self._sharded.plan_of(module)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="FSDP2 with dtype-grouped sharding for mixed-dtype models"
            )


def _no_parallelize(module: nn.Module, _: Any) -> nn.Module:
    return module


class _MixedBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, sharded: ShardedModules) -> None:
        self._sharded = sharded

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return _no_sync(self._sharded, module, enabled)


@contextmanager
def _no_sync(sharded: ShardedModules, module: nn.Module, enabled: bool) -> Generator[None, None, None]:
    """FSDP groups and replicated params both skip their reduction; grads accumulate locally until sync."""
    sharded.set_requires_gradient_sync(module, not enabled)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(module, True)
