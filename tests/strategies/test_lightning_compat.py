"""Every function of ``strategies/lightning_compat.py`` on the installed Lightning, and what the torch-only layers
copy from Lightning without importing it."""

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mixedfsdp.checkpoint.atomic import LIGHTNING_METADATA_FILENAME
from lightning_mixedfsdp.model.names import unwrap_model
from lightning_mixedfsdp.strategies import lightning_compat


def test_the_checkpoint_metadata_file_is_lightnings() -> None:
    assert LIGHTNING_METADATA_FILENAME == lightning_compat.lightning_metadata_filename() == "meta.pt"


def test_the_torch_only_layers_unwrap_fabrics_module_and_a_compiled_one() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    inner = nn.Linear(2, 2)
    wrapped = fabric.setup_module(inner)
    assert wrapped is not inner and lightning_compat.unwrap_fabric_module(wrapped) is inner
    assert unwrap_model(wrapped) is inner
    assert lightning_compat.unwrap_fabric_module(inner) is None and unwrap_model(inner) is inner
    assert unwrap_model(torch.compile(inner)) is inner
