"""Every private Lightning API the strategies use, each behind one small function, checked on lightning 2.6.5 and
2.6.6 (``pyproject.toml`` pins ``lightning>=2.6,<2.7``)."""

from typing import Any, Dict, Iterable, Optional

from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

# Fabric's hook for ``no_backward_sync``; strategies subclass it (``lightning.fabric.strategies.strategy``).
BackwardSyncControl = _BackwardSyncControl


def lightning_metadata_filename() -> str:
    """The file of a Lightning sharded checkpoint that holds everything but the model and optimizers
    (``lightning.fabric.utilities.load._METADATA_FILENAME``); ``checkpoint/atomic.py`` names it without importing
    Lightning, and a test checks the two agree."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return str(_METADATA_FILENAME)


def unwrap_fabric_module(module: nn.Module) -> Optional[nn.Module]:
    """The user's module inside Fabric's ``_FabricModule`` (its private ``_forward_module``, which Lightning's own
    strategies unwrap the same way); None for any other module. Registered with ``model/names.py`` when the strategies
    are imported, so the torch-only code below them unwraps Fabric's modules without knowing Lightning."""
    from lightning.fabric.wrappers import _FabricModule

    return module._forward_module if isinstance(module, _FabricModule) else None


def has_dtensor_modules(value: object) -> bool:
    """Whether ``value`` is a module with DTensor params: Lightning's own test for "the distributed model" of a
    checkpoint's state (``lightning.fabric.strategies.model_parallel._has_dtensor_modules``), looked up at call time
    so that what Lightning's save decides and what we decide stay the same."""
    from lightning.fabric.strategies import model_parallel

    return bool(model_parallel._has_dtensor_modules(value))


def optimizers_to_device(optimizers: Iterable[Any], device: Any) -> None:
    """Move optimizer states to ``device``, as Lightning's own strategies do at the end of ``setup``
    (``lightning.fabric.utilities.optimizer._optimizers_to_device``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_module_device_mesh(lightning_module: nn.Module, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (``LightningModule._device_mesh``; Lightning's own strategy sets
    it in ``setup_environment``, so ``configure_model`` can reach the mesh)."""
    lightning_module._device_mesh = mesh


class TrainerStepCounter:
    """The Trainer's optimizer-step count (``trainer.global_step``) as a stateful object, so that a fault-tolerant
    heal gives a restarted replica group the live group's count and ``max_steps`` ends every group at the same step.
    Private: ``fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total`` (or, under manual
    optimization, ``manual_optimization.optim_step_progress.total``) and ``epoch_loop._batches_that_stepped``, the
    counters Lightning's own checkpoint restores."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def _total(self) -> Any:
        loop = self._trainer.fit_loop.epoch_loop
        module = self._trainer.lightning_module
        if module is None or module.automatic_optimization:
            return loop.automatic_optimization.optim_progress.optimizer.step.total
        return loop.manual_optimization.optim_step_progress.total

    def state_dict(self) -> Dict[str, int]:
        total = self._total()
        return {
            "completed": int(total.completed),
            "batches_that_stepped": self._trainer.fit_loop.epoch_loop._batches_that_stepped,
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        total = self._total()
        in_flight = total.ready - total.completed  # a heal lands inside a step whose `ready` was counted already
        total.completed = state["completed"]
        total.ready = state["completed"] + in_flight
        self._trainer.fit_loop.epoch_loop._batches_that_stepped = state["batches_that_stepped"]
