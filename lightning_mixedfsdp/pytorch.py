"""``Trainer(strategy="mixed_fsdp2")``: Lightning's (Trainer) ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Generator, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.checkpoint import remove_path
from lightning_mixedfsdp.core import (
    ConfigInput,
    MixedFSDP2Mixin,
    adopt_precision,
    no_parallelize,
)
from lightning_mixedfsdp.gradients import clip_grad_norm_
from lightning_mixedfsdp.precision import MixedFSDPPrecision


class MixedFSDPTrainerPrecision(MixedFSDPPrecision, TrainerPrecision):
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
        if self._precision_plugin is None:
            return MixedFSDPTrainerPrecision("32-true", self._config)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[TrainerPrecision]) -> None:
        name = type(self).__name__
        self._precision_plugin = adopt_precision(precision_plugin, self._config, name, MixedFSDPTrainerPrecision)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._build_meshes()
        # users reach the mesh in `LightningModule.configure_model()` as with Lightning's own strategy
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.meshes.root

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard_children(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_children(self, module: nn.Module) -> None:
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            raise TypeError(
                f"{type(self).__name__} shards the child modules of {type(module).__name__}, but it holds params"
                f" directly: {own}. Register them in a submodule (e.g. `self.model = ...`)."
            )
        for name, child in module.named_children():
            if any(True for _ in child.parameters()):
                sharded = self._sharded.shard(
                    child, self._config, self.precision_plugin, self.meshes, self.root_device, no_parallelize
                )
                setattr(module, name, sharded)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's own only handles DDP; here FSDP groups and replicated params skip their reduction."""
        assert self.model is not None
        with self._sharded.no_sync(list(self.model.children())):
            yield

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        path = Path(self.broadcast(filepath))
        write = super().save_checkpoint
        self._save_atomically(path, lambda temp: write(checkpoint, temp, storage_options=storage_options))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._recover_before_load(path)
        return super().load_checkpoint(path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))
