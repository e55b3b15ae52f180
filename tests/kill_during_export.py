"""Helper for test_faults, run as a rank of its own (``run_distributed(kill_during_export, 1, folder, action)``):
``kill`` exports once (a copy is kept as ``expected``), then dies by SIGKILL in the middle of a second export into
the same folder; ``export`` exports again and returns whether the export loads back to the model's weights."""

import os
import shutil
import signal
from pathlib import Path

import torch

from tests.hf_models import tiny_model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def kill_during_export(rank: int, world_size: int, where: str, action: str) -> bool:
    folder = Path(where)
    from lightning.fabric import Fabric

    import lightning_mixedfsdp  # noqa: F401
    from lightning_mixedfsdp.checkpoint.safetensors_stream import SafetensorsStream
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=MixedFSDP2Strategy(), precision="bf16-true")
    fabric.launch()
    model = fabric.setup(tiny_model("llama"))
    export = folder / "export"
    if action == "export":
        fabric.strategy.export_safetensors(model, export)
        from lightning_mixedfsdp.checkpoint.load import read_state_dict

        saved = read_state_dict(export)
        state = {k: _full(v).to(saved[k].dtype) for k, v in model.state_dict().items()}
        return all(torch.equal(saved[k], state[k]) for k in saved)
    fabric.strategy.export_safetensors(model, export)
    shutil.copytree(export, folder / "expected")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # the second export differs from the first
    write_region = SafetensorsStream.write_region

    def die_after_one_region(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        write_region(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    SafetensorsStream.write_region = die_after_one_region  # type: ignore[method-assign]
    fabric.strategy.export_safetensors(model, export)
    return False  # the second export finished: the kill did not happen
