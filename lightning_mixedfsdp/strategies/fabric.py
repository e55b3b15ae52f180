"""``Fabric(strategy="mixed_fsdp2")``: Lightning's ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable, Dict, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.precision import MixedFSDPPrecision
from lightning_mixedfsdp.sharding.clip import clip_grad_norm_
from lightning_mixedfsdp.strategies.mixin import (
    ConfigInput,
    MixedFSDP2Mixin,
    ParallelizeFn,
    ShardedModules,
    no_parallelize,
)


class MixedFSDP2Strategy(MixedFSDP2Mixin, ModelParallelStrategy):
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

    _lightning_strategy = ModelParallelStrategy

    def __init__(
        self,
        config: ConfigInput = None,
        *,
        parallelize_fn: Optional[ParallelizeFn] = None,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        data_parallel_replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **fields: Any,
    ) -> None:
        self._intake(config, fields, data_parallel_size, data_parallel_replicate_size, tensor_parallel_size)
        super().__init__(
            parallelize_fn=parallelize_fn or no_parallelize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _MixedBackwardSyncControl(self._sharded)

    @property  # type: ignore[override]
    @override
    def precision(self) -> MixedFSDPPrecision:
        return self._plugin_or_default(self._precision, MixedFSDPPrecision)

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # the connector hands us Lightning's plugin for a precision flag; Lightning's bf16-true would cast the
        # keep-fp32 params to bf16 before sharding, so translate it
        self._precision = self._adopted(precision, MixedFSDPPrecision, (Precision, HalfPrecision, MixedPrecision))

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._sharded.shard(
            module, self._config, self.precision.bulk, self.meshes, self.root_device, self._parallelize_fn
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
        write = super().save_checkpoint
        self._save_atomically(path, lambda temp: write(temp, state, storage_options=storage_options, filter=filter))

    @override
    def load_checkpoint(
        self, path: Any, state: Optional[Any] = None, strict: bool = True, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        return super().load_checkpoint(self._recovered(path), state=state, strict=strict, weights_only=weights_only)

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


class _MixedBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, sharded: ShardedModules) -> None:
        self._sharded = sharded

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._sharded.no_sync([module], enabled)
