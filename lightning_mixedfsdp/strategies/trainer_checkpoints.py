"""The Trainer strategy's checkpoint hooks: Lightning's ``optimizer_state``, ``save_checkpoint``, ``load_checkpoint``
and ``remove_checkpoint`` around the one save and load sequence both strategies share (``checkpointing.py``)."""

from contextlib import nullcontext
from typing import Any, Dict, Optional

from lightning.pytorch.strategies import ModelParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.atomic import PathLike, remove_path
from lightning_mixedfsdp.checkpoint.optimizer_state import AbsentStateRecord
from lightning_mixedfsdp.strategies.mixin import MixedFSDP2Mixin


class TrainerCheckpointing(MixedFSDP2Mixin, ModelParallelStrategy):
    """Lightning's Trainer ``ModelParallelStrategy`` with the shared mixin and the checkpoint hooks the Trainer calls;
    :class:`~lightning_mixedfsdp.strategies.trainer.MixedFSDP2Strategy` adds the rest."""

    _absent_state: AbsentStateRecord
    """The stand-ins ``optimizer_state`` made while Lightning assembles a checkpoint, taken by ``save_checkpoint``."""

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Lightning's, semi-synchronous replicas made equal first (the Trainer collects the model's state before the
        optimizers' and before ``save_checkpoint``)."""
        self._sharded.before_save()
        return super().lightning_module_state_dict()

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
