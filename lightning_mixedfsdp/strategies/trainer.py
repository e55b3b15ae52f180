"""``Trainer(strategy="mixed_fsdp2")``: Lightning's (Trainer) ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.apply.clip import clip_grad_norm_
from lightning_mixedfsdp.checkpoint.atomic import PathLike, remove_path
from lightning_mixedfsdp.checkpoint.optimizer_state import AbsentStateRecord
from lightning_mixedfsdp.mesh import MeshSize
from lightning_mixedfsdp.strategies.lightning_compat import (
    TrainerStepCounter,
    optimizers_to_device,
    set_module_device_mesh,
    undo_optimizer_step,
)
from lightning_mixedfsdp.strategies.mixin import ConfigInput, MixedFSDP2Mixin, refuse_fsdp1_modules
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision

SKIPPED_INTERVAL = "skipped: discarded step"
"""The interval a step-interval LR scheduler config has while the batch of a discarded step ends: Lightning steps no
scheduler of an interval it does not know."""


class MixedFSDPTrainerPrecision(MixedFSDPPrecision, Precision):
    """The same plugin for the Trainer; clipping by norm works over mixed placements and dtypes."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)


class MixedFSDP2Strategy(MixedFSDP2Mixin, ModelParallelStrategy):
    """FSDP2 for LightningModules whose params mix dtypes; no ``configure_model`` that shards by hand is needed.

    Every child module of the LightningModule that holds params is sharded by the dtype plan. A ``configure_model``
    that builds layers (on the meta device under ``init_module(empty_init=True)``), applies tensor parallelism or
    activation checkpointing still works; one that calls ``fully_shard`` itself takes over and no plan is applied to
    that child. With ``accumulate_grad_batches=N``, FSDP groups and replicated params sync once per optimizer step.

    Arguments are Lightning's ``ModelParallelStrategy``'s, in its order, plus ``config``,
    ``data_parallel_replicate_size`` and the config's fields, as for
    :class:`lightning_mixedfsdp.fabric.MixedFSDP2Strategy`.
    """

    def __init__(
        self,
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
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._absent_state = AbsentStateRecord()
        # the LR scheduler configs while a discarded step's batch ends (its step-interval schedulers skip it)
        self._discarded_schedulers: Optional[List[Any]] = None

    @property
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
        # users reach the mesh in `LightningModule.configure_model()`; HSDP replaced Lightning's 2-D mesh
        assert self.lightning_module is not None
        set_module_device_mesh(self.lightning_module, self.meshes.root)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """``ModelParallelStrategy.setup``'s sequence, except that ``configure_model`` is optional (the dtype plan
        shards the children) and a meta model is initialised by the pipeline, one chunk at a time, instead of by
        ``reset_parameters`` on every rank's full copy."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_fsdp1_modules(self.model, type(self).__name__)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self._watch_optimizer(optimizer)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's step; under fault tolerance the closure (forward, backward) runs first and the update only
        when torchft's vote commits the step, as a loss scaler skips one (a discarded step drops its grads)."""
        step = super().optimizer_step
        return self._fault_tolerance.step_after_closure(
            optimizer, closure, lambda run: step(optimizer, run, model, **kwargs), self._step_discarded
        )

    def _step_discarded(self) -> None:
        """A step torchft's vote discarded: not counted (``global_step`` stays), and the LR schedulers that step per
        optimizer step skip this batch; the batch stays consumed (the next step trains on the next one)."""
        assert self.lightning_module is not None
        undo_optimizer_step(self.lightning_module.trainer)
        if self._discarded_schedulers is None:
            self._discarded_schedulers = self.lr_scheduler_configs
            self.lr_scheduler_configs = [
                replace(config, interval=SKIPPED_INTERVAL) if config.interval == "step" else config
                for config in self.lr_scheduler_configs
            ]

    def _restore_schedulers(self) -> None:
        if self._discarded_schedulers is not None:
            self.lr_scheduler_configs, self._discarded_schedulers = self._discarded_schedulers, None

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Lightning's; the next batch after a discarded step brings the LR schedulers back (the first strategy hook
        of a batch, before any callback sees them)."""
        self._restore_schedulers()
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_start(self) -> None:
        """Under fault tolerance the first step's quorum opens here, before the first batch is drawn: a restarted
        group heals (weights, optimizer, schedulers, the Trainer's step and batch counters) and its data stream then
        starts at the healed step."""
        super().on_train_start()
        self._fault_tolerance.begin_step()

    @override
    def on_train_end(self) -> None:
        self._restore_schedulers()
        super().on_train_end()

    @override
    def _heal_others(self) -> Sequence[Any]:
        """The LR schedulers, and the Trainer's step count (a healed group stops at ``max_steps`` with the others)."""
        assert self.lightning_module is not None
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        return [*schedulers, TrainerStepCounter(self.lightning_module.trainer)]

    @override
    def teardown(self) -> None:
        self._fault_tolerance.shutdown()
        super().teardown()

    @override
    def model_to_device(self) -> None:
        """Shard every child that holds params (``fully_shard`` moves each shard to the device itself, so no rank
        holds the unsharded model on it), then move the rest (metrics, buffers of param-less children)."""
        model = self.model
        assert model is not None
        own = [name for name, _ in model.named_parameters(recurse=False)]
        if own:
            raise TypeError(
                f"{type(self).__name__} shards the child modules of {type(model).__name__}, but it holds params"
                f" directly: {own}. Register them in a submodule (e.g. `self.model = ...`)."
            )
        for name, child in model.named_children():
            if any(True for _ in child.parameters()):
                setattr(model, name, self._shard(child, self.precision_plugin, None))
        model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's own only handles DDP; here FSDP groups and replicated params skip their reduction."""
        assert self.model is not None
        with self._sharded.no_sync(list(self.model.children())):
            yield

    @override
    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """Lightning's, with a stand-in for the state only some ranks hold (the checkpoint records where it stands
        in: ``checkpoint/optimizer_state.py``)."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        key = f"optimizer_{[id(o) for o in self.optimizers].index(id(inner))}" if inner in self.optimizers else None
        if key is None:
            return super().optimizer_state(optimizer)
        with self._saving_optimizers(self.lightning_module, {key: inner}) as absent:
            state = super().optimizer_state(optimizer)
        self._absent_state.add(absent)
        return state

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        write = super().save_checkpoint
        if storage_options is not None:  # Lightning's own refusal, before anything is written
            write(checkpoint, filepath, storage_options=storage_options)
        absent = self._absent_state.take()  # made while Lightning assembled the checkpoint (optimizer_state)
        self._save_checkpoint(
            filepath, checkpoint, lambda temp, to_save: write(to_save, temp), nullcontext(absent), self.lightning_module
        )

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        optimizers = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(self.optimizers)}
        read = super().load_checkpoint
        return self._load_checkpoint(
            checkpoint_path,
            self.lightning_module,
            optimizers,
            weights_only,
            lambda at: read(at, weights_only=weights_only),
            self.lightning_module is None or self.lightning_module.strict_loading,
        )

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        if self.is_global_zero and self.writes_checkpoints():
            remove_path(filepath)
