"""``Trainer(strategy="mixed_fsdp2")``: Lightning's (Trainer) ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Generator, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.atomic import remove_path
from lightning_mixedfsdp.precision import MixedFSDPPrecision
from lightning_mixedfsdp.sharding.clip import clip_grad_norm_
from lightning_mixedfsdp.strategies.mixin import ConfigInput, MixedFSDP2Mixin, no_parallelize


class MixedFSDPTrainerPrecision(MixedFSDPPrecision, Precision):
    """The same plugin for the Trainer; clipping by norm works over mixed placements and dtypes."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)


class MixedFSDP2Strategy(MixedFSDP2Mixin, ModelParallelStrategy):
    """FSDP2 for LightningModules whose params mix dtypes; no ``configure_model`` that shards by hand is needed.

    Every child module of the LightningModule that holds params is sharded by the dtype plan. A ``configure_model``
    that only builds layers (on the meta device with ``empty_init``) or applies tensor parallelism still works; one
    that calls ``fully_shard`` itself takes over and no plan is applied to that child. With
    ``accumulate_grad_batches=N``, FSDP groups and replicated params sync once per optimizer step.

    Arguments are those of :class:`lightning_mixedfsdp.fabric.MixedFSDP2Strategy`, without ``parallelize_fn``
    (use ``configure_model``).
    """

    _lightning_strategy = ModelParallelStrategy

    def __init__(
        self,
        config: ConfigInput = None,
        *,
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
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> MixedFSDPTrainerPrecision:
        return self._plugin_or_default(self._precision_plugin, MixedFSDPTrainerPrecision)

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        translatable = (Precision, HalfPrecision, MixedPrecision)
        self._precision_plugin = self._adopted(precision_plugin, MixedFSDPTrainerPrecision, translatable)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # users reach the mesh in `LightningModule.configure_model()` as with Lightning's own strategy
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.meshes.root

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # Lightning's generic flow (accelerator, convert_module, model_to_device, `_setup_model`, optimizers);
        # ModelParallelStrategy.setup adds a required `configure_model`, which the dtype plan makes unnecessary
        Strategy.setup(self, trainer)

    @override
    def model_to_device(self) -> None:
        # runs before `_setup_model`: fully_shard moves each shard itself, so no rank holds the unsharded model on
        # the device; `_setup_model` moves what sharding leaves behind
        pass

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Shard every child that holds params, then move the rest (metrics, buffers of param-less children)."""
        own = [name for name, _ in model.named_parameters(recurse=False)]
        if own:
            raise TypeError(
                f"{type(self).__name__} shards the child modules of {type(model).__name__}, but it holds params"
                f" directly: {own}. Register them in a submodule (e.g. `self.model = ...`)."
            )
        for name, child in model.named_children():
            if any(True for _ in child.parameters()):
                sharded = self._sharded.shard(
                    child, self._config, self.precision_plugin.bulk, self.meshes, self.root_device, no_parallelize
                )
                setattr(model, name, sharded)
        model.to(self.root_device)
        self.barrier()
        return model

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's own only handles DDP; here FSDP groups and replicated params skip their reduction."""
        assert self.model is not None
        with self._sharded.no_sync(list(self.model.children())):
            yield

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        write = super().save_checkpoint
        self._save_atomically(filepath, lambda temp: write(checkpoint, temp, storage_options=storage_options))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        return super().load_checkpoint(self._recovered(checkpoint_path), weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(filepath)
