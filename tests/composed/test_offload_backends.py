"""CPU offload puts collectives on host tensors: clipping over host grads, an export's gathers, the rank-0 stream of a
load, the 4-bit base's block maxima. NCCL rejects them, so on CUDA the strategy's process group has gloo for host
tensors beside NCCL. On the CPU every tensor is a host tensor: each collective of the offload path is recorded with
its tensors' device and its group's backend for that device, and a group without one fails the check (a group made
``cuda:gloo`` only, as a CPU machine can make one); the strategy's own group passes it. The choice of backend for
CUDA is checked without a GPU (``process_group_backend``)."""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from lightning_mixedfsdp.strategies.process_group import process_group_backend
from lightning_mixedfsdp.testing import run_distributed
from tests.composed.test_qlora import VOCAB, base_model, qlora_model
from tests.scenarios import global_batch, make_fabric, rank_slice

pytest.importorskip(
    "torchao", reason="the offload path here has a 4-bit base (pip install 'lightning-mixedfsdp[qlora]')"
)

WORLD = 2


def _offload_path(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """The offload path end to end under the recorder, on the strategy's group: a 4-bit base loaded by rank 0's
    stream, two clipped steps, a DCP save and load, an export."""
    from lightning_mixedfsdp import load_full_weights
    from lightning_mixedfsdp.diagnostics.collectives import checking_collective_backends
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    root = Path(folder)
    with checking_collective_backends(strict=True) as records:
        fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(quantize_base="nf4", offload="cpu"))
        with fabric.init_module(empty_init=True):
            model = qlora_model("llama")
        model = fabric.setup(model)
        load_full_weights(model, root / "pretrained", read="rank_zero")
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(trainable, lr=1e-3))
        for step in range(2):
            tokens = rank_slice(global_batch(world_size, step, vocab=VOCAB), rank, world_size)
            fabric.backward(model(input_ids=tokens, labels=tokens).loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(root / "ckpt", {"model": model, "optimizer": optimizer})
        fabric.load(root / "ckpt", {"model": model, "optimizer": optimizer})
        fabric.strategy.export_safetensors(model, root / "export")
    devices = sorted({r.device for r in records})
    backends = sorted({str(r.backend) for r in records})
    return {"collectives": len(records), "devices": devices, "backends": backends}


def _clip_on_a_group_without_a_host_backend(rank: int, world_size: int) -> Dict[str, Any]:
    """Clipping host grads (offload's first host collective each step) over a group made ``cuda:gloo`` only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_mixedfsdp.apply.clip import clip_grad_norm_
    from lightning_mixedfsdp.diagnostics.collectives import checking_collective_backends

    dist.init_process_group("cuda:gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        param = DTensor.from_local(torch.ones(4, requires_grad=True), mesh, [Shard(0)], run_check=False)
        param.grad = DTensor.from_local(torch.ones(4), mesh, [Shard(0)], run_check=False)
        with checking_collective_backends(strict=True):
            clip_grad_norm_([param], 1.0)
    except AssertionError as error:
        return {"error": str(error)}
    finally:  # the launcher's closing barrier could not run on it
        dist.destroy_process_group()
    return {"error": None}


@pytest.fixture(scope="module")
def pretrained(folder: Path) -> Path:
    base_model("llama").to(torch.bfloat16).save_pretrained(str(folder / "pretrained"))
    return folder


def test_every_host_collective_of_the_offload_path_has_a_backend_on_the_strategys_group(pretrained: Path) -> None:
    results = run_distributed(_offload_path, WORLD, str(pretrained), timeout=240)
    for result in results:
        assert result["devices"] == ["cpu"] and result["collectives"] > 50
        assert result["backends"] == ["ProcessGroupGloo"]


def test_a_group_without_a_host_backend_fails_the_check() -> None:
    results = run_distributed(_clip_on_a_group_without_a_host_backend, WORLD, timeout=120)
    for result in results:
        assert result["error"] is not None and "no backend for cpu" in result["error"], result


@pytest.mark.parametrize(
    ("device", "requested", "offload", "expected"),
    [
        ("cuda", None, True, "cuda:nccl,cpu:gloo"),
        ("cuda", None, False, "nccl"),
        ("cpu", None, True, "gloo"),
        ("cuda", "cuda:nccl,cpu:gloo", True, "cuda:nccl,cpu:gloo"),
        ("cuda", "gloo", True, "gloo"),
        ("cuda", "nccl", False, "nccl"),
    ],
)
def test_the_strategy_gives_host_tensors_a_backend_beside_nccl(
    device: str, requested: Any, offload: bool, expected: str
) -> None:
    assert process_group_backend(device, requested, offload, "MixedFSDP2Strategy") == expected


def test_a_backend_without_a_host_part_is_refused_under_offload_at_construction() -> None:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    with pytest.raises(ValueError, match=r"MixedFSDP2Strategy: memory.offload='cpu' runs collectives on host tensors"):
        MixedFSDP2Strategy(offload="cpu", process_group_backend="nccl")
    with pytest.raises(ValueError, match=r"Use process_group_backend='cuda:gloo,cpu:gloo'"):
        MixedFSDP2Strategy(offload="cpu", process_group_backend="cuda:gloo")
