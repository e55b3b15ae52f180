"""Every private Lightning API the strategies use, each behind one small function, checked on lightning 2.6.5 and
2.6.6 (``pyproject.toml`` pins ``lightning>=2.6,<2.7``)."""

from typing import Any, Iterable

from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

# Fabric's hook for ``no_backward_sync``; strategies subclass it (``lightning.fabric.strategies.strategy``).
BackwardSyncControl = _BackwardSyncControl

# The file of a Lightning sharded checkpoint that holds the user's metadata (``lightning.fabric.utilities.load``).
LIGHTNING_METADATA_FILENAME = "meta.pt"


def optimizers_to_device(optimizers: Iterable[Any], device: Any) -> None:
    """Move optimizer states to ``device``, as Lightning's own strategies do at the end of ``setup``
    (``lightning.fabric.utilities.optimizer._optimizers_to_device``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_module_device_mesh(lightning_module: nn.Module, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (``LightningModule._device_mesh``; Lightning's own strategy sets
    it in ``setup_environment``, so ``configure_model`` can reach the mesh)."""
    lightning_module._device_mesh = mesh
