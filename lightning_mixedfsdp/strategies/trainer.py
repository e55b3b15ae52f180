"""``Trainer(strategy="mixed_fsdp2")``: Lightning's (Trainer) ModelParallelStrategy with dtype-grouped FSDP2."""

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, List, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.apply.clip import clip_grad_norm_
from lightning_mixedfsdp.checkpoint.optimizer_state import AbsentStateRecord
from lightning_mixedfsdp.mesh import MeshSize
from lightning_mixedfsdp.strategies.discarded_steps import HeldSchedulers
from lightning_mixedfsdp.strategies.intake import ConfigInput, given
from lightning_mixedfsdp.strategies.lightning_compat import (
    TrainerStepCounter,
    optimizers_to_device,
    set_module_device_mesh,
    undo_optimizer_step,
)
from lightning_mixedfsdp.strategies.mixin import refuse_fsdp1_modules
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision
from lightning_mixedfsdp.strategies.trainer_checkpoints import TrainerCheckpointing


class MixedFSDPTrainerPrecision(MixedFSDPPrecision, Precision):
    """The same plugin for the Trainer; clipping by norm works over mixed placements and dtypes (and over pipeline
    stages: ``norm_across``, set by the strategy)."""

    norm_across: Any = None
    counted_elsewhere: Callable[[], Sequence[torch.Tensor]] = tuple
    """The strategy's tied copies whose grad another pipeline rank's norm holds."""
    last_norm: Optional[torch.Tensor] = None
    """The total gradient norm the last clip by norm found (before clipping), for logging."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.last_norm = clip_grad_norm_(
            self.main_params(optimizer), clip_val, across=self.norm_across, counted_elsewhere=self.counted_elsewhere()
        )


class MixedFSDP2Strategy(TrainerCheckpointing):
    """FSDP2 for LightningModules whose params mix dtypes; no ``configure_model`` that shards by hand is needed.

    Every child module of the LightningModule that holds params is sharded by the dtype plan. A ``configure_model``
    that builds layers (on the meta device under ``init_module(empty_init=True)``), applies tensor parallelism or
    activation checkpointing still works; one that calls ``fully_shard`` itself takes over and no plan is applied to
    that child. With ``accumulate_grad_batches=N``, FSDP groups and replicated params sync once per optimizer step.

    Arguments are Lightning's ``ModelParallelStrategy``'s, in its order, plus ``config``,
    ``data_parallel_replicate_size`` and the config's fields, as for
    :class:`lightning_mixedfsdp.fabric.MixedFSDP2Strategy`.
    """

    _split_in = "configure_model"

    def __init__(
        self,
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
            data_parallel_size=parallelism.data_parallel_size,
            tensor_parallel_size=parallelism.tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._absent_state = AbsentStateRecord()
        self._held_schedulers = HeldSchedulers()

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
        shards the children) and a meta model is initialised by the model setup, one chunk at a time, instead of by
        ``reset_parameters`` on every rank's full copy."""
        assert self.model is not None and self.accelerator is not None
        self._refuse_unpipelined_loop(trainer)
        self.accelerator.setup(trainer)
        refuse_fsdp1_modules(self.model, type(self).__name__)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.norm_across = self._pipeline_group()
        self.precision_plugin.counted_elsewhere = self._counted_elsewhere
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _refuse_unpipelined_loop(self, trainer: "pl.Trainer") -> None:
        """Under pipeline parallelism a training step must run ``pipeline_step`` itself (``unpipelined_loop``)."""
        module = self.lightning_module
        if self.pipelined and module is not None and trainer.state.fn == TrainerFn.FITTING:
            problems = unpipelined_loop(module, trainer.accumulate_grad_batches)
            if problems:
                size = self._config.parallelism.pipeline_parallel_size
                raise ValueError(
                    f"{type(self).__name__}: under pipeline_parallel_size={size}, " + "; ".join(problems) + "."
                )

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
        self.lr_scheduler_configs = self._held_schedulers.hold(self.lr_scheduler_configs)

    def _restore_schedulers(self) -> None:
        self.lr_scheduler_configs = self._held_schedulers.release(self.lr_scheduler_configs)

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


def unpipelined_loop(module: "pl.LightningModule", accumulate_grad_batches: int) -> List[str]:
    """Why ``module``'s loop would not run a pipeline, each with the fix: Lightning's automatic optimization would
    call the model (a stage) directly, and its gradient accumulation would reduce per batch what the pipeline
    accumulates over micro-batches."""
    problems = []
    if module.automatic_optimization:
        problems.append(
            f"{type(module).__name__} uses automatic optimization; set `self.automatic_optimization = False` and"
            " in `training_step` call `loss = self.trainer.strategy.pipeline_step(self.model, inputs, target=...,"
            " loss_fn=...)`, then `self.clip_gradients(...)` if you clip, `optimizer.step()`,"
            " `optimizer.zero_grad()` and your scheduler's `step()`"
        )
    if accumulate_grad_batches > 1:
        problems.append(
            f"accumulate_grad_batches={accumulate_grad_batches} is not supported: raise pipeline_microbatches"
            " instead (a larger batch split into more micro-batches)"
        )
    return problems
