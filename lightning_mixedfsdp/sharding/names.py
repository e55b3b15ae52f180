"""Module identity across the wrappers users and Lightning put around a model."""

from torch import nn


def unwrap_model(module: nn.Module) -> nn.Module:
    """The model inside Fabric's ``_FabricModule`` (``_forward_module``)."""
    return getattr(module, "_forward_module", module)
