"""``Fabric(strategy="mixed_fsdp2")``: Lightning's ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.apply.clip import clip_grad_norm_
from lightning_mixedfsdp.apply.optimizers import params_by_identity, rebind_optimizer
from lightning_mixedfsdp.checkpoint.atomic import PathLike
from lightning_mixedfsdp.mesh import MeshSize, ParallelizeFn
from lightning_mixedfsdp.pipeline import ShardedModels
from lightning_mixedfsdp.strategies.intake import ConfigInput
from lightning_mixedfsdp.strategies.lightning_compat import BackwardSyncControl, has_dtensor_modules
from lightning_mixedfsdp.strategies.mixin import MixedFSDP2Mixin
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision


class MixedFSDP2Strategy(MixedFSDP2Mixin, ModelParallelStrategy):
    """FSDP2 for models whose params mix dtypes: keep-fp32 params stay fp32, no hand-written ``fully_shard``.

    Arguments are Lightning's ``ModelParallelStrategy``'s, in its order, plus:
        config: A :class:`~lightning_mixedfsdp.MixedFSDPConfig` (or a mapping of its options). Keyword ``options``
            override it: an option group or a mapping of its fields (``float8={"recipe": "tensorwise"}``), or a flat
            name (``keep_fp32_params=[r"A_log$"]``, ``float8="tensorwise"``).
        data_parallel_replicate_size: HSDP: replicas of the sharded model (e.g. one per node). 1 means plain FSDP.

    ``parallelize_fn(model, device_mesh)`` is optional (e.g. tensor parallelism), run before the dtype-grouped FSDP
    on the data-parallel mesh; if it shards with FSDP itself, no plan is applied. ``data_parallel_size="auto"`` takes
    every rank tensor parallelism and replication leave; ``tensor_parallel_size`` defaults to 1 (Lightning's
    ``"auto"``, the devices of a node, is accepted too).
    """

    def __init__(
        self,
        parallelize_fn: Optional[ParallelizeFn] = None,
        data_parallel_size: MeshSize = "auto",
        tensor_parallel_size: MeshSize = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        *,
        config: ConfigInput = None,
        data_parallel_replicate_size: int = 1,
        **options: Any,
    ) -> None:
        self._intake(
            config,
            options,
            data_parallel_size,
            data_parallel_replicate_size,
            tensor_parallel_size,
            process_group_backend,
        )
        super().__init__(
            parallelize_fn=parallelize_fn,  # type: ignore[arg-type]
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _MixedBackwardSyncControl(self._sharded)

    @property
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
        return self._shard(module, self.precision, self._parallelize_fn)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: List[Optimizer], scheduler: Optional[Any] = None
    ) -> Tuple[nn.Module, List[Optimizer], Optional[Any]]:
        """Lightning's joint setup (``fabric.setup(model, optimizer)``), with each optimizer's param groups pointed at
        the sharded params that replaced the ones it was built with (hyperparameters and groups kept)."""
        names = params_by_identity(module)
        module = self.setup_module(module)
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, module, type(self).__name__)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._watch_optimizer(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Lightning's step; under fault tolerance only when torchft's vote commits it (a discarded step drops its
        grads and returns None)."""
        if not self._commit_step(optimizer):
            return None
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def teardown(self) -> None:
        self._fault_tolerance.shutdown()
        super().teardown()

    @override
    def save_checkpoint(
        self,
        path: PathLike,
        state: Dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Lightning's save (a DCP folder, or one file with ``save_distributed_checkpoint=False``), written beside
        ``path`` and committed by rename: a save killed midway leaves the previous checkpoint intact. Under fault
        tolerance one live replica group writes it, with torchft's step counters."""
        write = super().save_checkpoint
        if storage_options is not None:  # Lightning's own refusal, before anything is written
            write(path, state, storage_options=storage_options)
        optimizers, module = _optimizers_and_model(state)
        self._save_checkpoint(
            path,
            state,
            lambda temp, to_save: write(temp, to_save, storage_options=None, filter=filter),
            self._saving_optimizers(module, optimizers),
            module,
        )

    @override
    def load_checkpoint(
        self, path: PathLike, state: Optional[Any] = None, strict: bool = True, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        optimizers, module = _optimizers_and_model(state if isinstance(state, dict) else {})
        read = super().load_checkpoint
        return self._load_checkpoint(
            path,
            module,
            optimizers,
            weights_only,
            lambda at: read(at, state=state, strict=strict, weights_only=weights_only),
            strict,
        )

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
        # a step whose reduction across replica groups failed is discarded at its vote: its grads may be garbage
        failed = self._fault_tolerance.reduction_failed
        return clip_grad_norm_(
            self.precision.main_params(optimizer),
            max_norm,
            norm_type,
            error_if_nonfinite and not failed,
            nonfinite_check=self._config.diagnostics.nonfinite_check,
        )


class _MixedBackwardSyncControl(BackwardSyncControl):
    def __init__(self, sharded: ShardedModels) -> None:
        self._sharded = sharded

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._sharded.no_sync([module], enabled)


def _optimizers_and_model(state: Dict[str, Any]) -> Tuple[Dict[str, Optimizer], Optional[nn.Module]]:
    """The optimizers of a checkpoint's state by key, and its distributed model (by Lightning's own test) when there
    is exactly one."""
    optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
    models = [value for value in state.values() if has_dtensor_modules(value)]
    return optimizers, models[0] if len(models) == 1 else None
