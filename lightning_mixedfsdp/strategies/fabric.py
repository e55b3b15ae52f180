"""``Fabric(strategy="mixed_fsdp2")``: Lightning's ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, List, Optional, Tuple, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.apply.clip import clip_grad_norm_
from lightning_mixedfsdp.apply.optimizers import params_by_identity, rebind_optimizer
from lightning_mixedfsdp.mesh import MeshSize, ParallelizeFn
from lightning_mixedfsdp.model_setup import ShardedModels
from lightning_mixedfsdp.strategies.fabric_checkpoints import FabricCheckpointing
from lightning_mixedfsdp.strategies.intake import ConfigInput, given
from lightning_mixedfsdp.strategies.lightning_compat import BackwardSyncControl
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision


class MixedFSDP2Strategy(FabricCheckpointing):
    """FSDP2 for models whose params mix dtypes: keep-fp32 params stay fp32, no hand-written ``fully_shard``.

    Arguments are Lightning's ``ModelParallelStrategy``'s, in its order, plus:
        config: A :class:`~lightning_mixedfsdp.MixedFSDPConfig` (or a mapping of its options). Keyword ``options``
            override it: an option group or a mapping of its fields (``float8={"recipe": "tensorwise"}``), or a flat
            name (``keep_fp32_params=[r"A_log$"]``, ``float8="tensorwise"``).
        data_parallel_replicate_size: HSDP: replicas of the sharded model (e.g. one per node). 1 means plain FSDP.

    The three sizes are the config's ``parallelism`` fields of the same names (beside ``context_parallel_size`` and
    ``expert_parallel_size``), given here as Lightning's arguments; one left out (``None``) keeps the config's value,
    by default ``data_parallel_size="auto"`` (every rank the other degrees leave), ``tensor_parallel_size=1``
    (Lightning's ``"auto"``, the devices of a node, is accepted too) and ``data_parallel_replicate_size=1``.

    ``parallelize_fn(model, device_mesh)`` is optional (e.g. tensor parallelism), run before the dtype-grouped FSDP
    on the data-parallel mesh; if it shards with FSDP itself, no plan is applied.
    """

    def __init__(
        self,
        parallelize_fn: Optional[ParallelizeFn] = None,
        data_parallel_size: Optional[MeshSize] = None,
        tensor_parallel_size: Optional[MeshSize] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        *,
        config: ConfigInput = None,
        data_parallel_replicate_size: Optional[int] = None,
        **options: Any,
    ) -> None:
        sizes = {
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
            "data_parallel_replicate_size": data_parallel_replicate_size,
        }
        self._intake(config, {**given(sizes), **options}, process_group_backend)
        parallelism = self._config.parallelism
        super().__init__(
            parallelize_fn=parallelize_fn,  # type: ignore[arg-type]
            data_parallel_size=parallelism.data_parallel_size,
            tensor_parallel_size=parallelism.tensor_parallel_size,
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
            rebind_optimizer(optimizer, names, module, type(self).__name__, other_stages=self.pipelined)
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
            across=self._pipeline_group(),
            counted_elsewhere=self._counted_elsewhere(),
        )


class _MixedBackwardSyncControl(BackwardSyncControl):
    def __init__(self, sharded: ShardedModels) -> None:
        self._sharded = sharded

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._sharded.no_sync([module], enabled)
