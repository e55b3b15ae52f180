"""Helper for test_checkpoint, run as a rank of its own (``run_distributed(kill_during_save, 1, folder, mode,
action)``): ``save`` saves once, then dies by SIGKILL in the middle of a second save; ``load`` loads what is left and
returns whether it equals the first save's weights."""

import os
import signal
from pathlib import Path

import torch

from lightning_mixedfsdp.testing import accelerator_for
from tests.scenarios import A_LOG, MIXER, BufferedLlama, full_params, global_batch


def kill_during_save(rank: int, world_size: int, where: str, mode: str, action: str) -> bool:
    folder = Path(where)
    from lightning.fabric import Fabric

    import lightning_mixedfsdp  # noqa: F401
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss

    strategy = MixedFSDP2Strategy(keep_fp32_params=A_LOG, save_distributed_checkpoint=mode == "sharded")
    fabric = Fabric(accelerator=accelerator_for(1), devices=1, strategy=strategy, precision="bf16-true")
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(BufferedLlama(MIXER))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    path = folder / "checkpoint"

    if action == "load":
        fabric.load(path, {"model": model, "optimizer": optimizer})
        expected = torch.load(folder / "expected.pt")
        return all(torch.equal(v, expected[k]) and v.dtype == expected[k].dtype for k, v in full_params(model).items())

    def step(index: int) -> None:
        tokens = global_batch(1, index)
        fabric.backward(causal_lm_loss(model(tokens), tokens))
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    torch.save(full_params(model), folder / "expected.pt")
    step(1)
    _die_midway(mode)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    return False  # the second save finished: the kill did not happen


def _die_midway(mode: str) -> None:
    """SIGKILL after part of the checkpoint is on disk: DCP data files but no metadata, or half of the file."""
    if mode == "sharded":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        FileSystemWriter.finish = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
        return
    original = torch.save

    def half_then_die(obj, f, *args, **kwargs):  # noqa: ANN001
        import io

        buffer = io.BytesIO()
        original(obj, buffer, *args, **kwargs)
        with open(f, "wb") as handle:
            handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_then_die
