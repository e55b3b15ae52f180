"""The Fabric strategy's checkpoint hooks: Lightning's ``save_checkpoint`` and ``load_checkpoint`` around the one save
and load sequence both strategies share (``checkpointing.py``), as ``trainer_checkpoints.py`` holds the Trainer's."""

from typing import Any, Callable, Dict, Optional, Tuple

from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.atomic import PathLike
from lightning_mixedfsdp.strategies.lightning_compat import has_dtensor_modules
from lightning_mixedfsdp.strategies.mixin import MixedFSDP2Mixin


class FabricCheckpointing(MixedFSDP2Mixin, ModelParallelStrategy):
    """Lightning's Fabric ``ModelParallelStrategy`` with the shared mixin and the checkpoint hooks Fabric calls;
    :class:`~lightning_mixedfsdp.strategies.fabric.MixedFSDP2Strategy` adds the rest."""

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
        self._sharded.before_save()  # semi-synchronous replicas made equal first
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


def _optimizers_and_model(state: Dict[str, Any]) -> Tuple[Dict[str, Optimizer], Optional[nn.Module]]:
    """The optimizers of a checkpoint's state by key, and its distributed model (by Lightning's own test) when there
    is exactly one."""
    optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
    models = [value for value in state.values() if has_dtensor_modules(value)]
    return optimizers, models[0] if len(models) == 1 else None
