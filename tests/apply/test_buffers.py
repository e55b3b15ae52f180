"""Buffers as training really has them, on 2 ranks: the dtype each gets is the one HF's own construction under the
compute dtype gives it (every architecture below builds and trains), and ``buffer_sync`` keeps the buffers a model
updates equal across ranks: an aux-loss-free router bias updated from each rank's expert load, BatchNorm statistics
against DDP's."""

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from tests.conftest import Launch
from tests.hf_models import AuxFreeBalancing, model_class, tiny_config, tiny_model
from tests.scenarios import global_batch, make_fabric, rank_slice, unwrap

WORLD = 2
ARCHITECTURES = (
    "llama",
    "qwen3_next",
    "gemma3_text",
    "minimax",
    "mamba2",
    "falcon_h1",
    "deepseek_v3",
    "gpt_oss",
    "t5",
    "lfm2_moe",
)
SYNC_MODES = ("none", "broadcast", "average")


def _floating_buffers(model: nn.Module) -> Dict[str, torch.dtype]:
    from lightning_mixedfsdp.model.names import canonical_name

    return {canonical_name(n): b.dtype for n, b in model.named_buffers() if b.is_floating_point()}


def _architecture(name: str) -> Dict[str, Any]:
    """Set up under bf16-true from an fp32 build, then two steps; the buffer dtypes against HF's bf16 build."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.planning.types import BufferSource

    with torch.device("meta"):
        hf_bf16 = _floating_buffers(model_class(name).from_config(tiny_config(name), dtype=torch.bfloat16))
    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy())
    model = fabric.setup(tiny_model(name))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    plan = fabric.strategy.plan_of(model)
    losses = []
    for step in range(2):
        tokens = rank_slice(global_batch(WORLD, step), fabric.global_rank, WORLD)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "after_setup": _floating_buffers(unwrap(model)),
        "hf_bf16": hf_bf16,
        "keep_rules": {
            n: b.set_by
            for n, b in plan.buffers.items()
            if b.source not in (BufferSource.BUILT, BufferSource.CONSTRUCTED)
        },
        "losses": losses,
    }


def _router_bias(mode: str, steps: int = 10) -> Dict[str, Any]:
    """DeepSeek-V3 with aux-free balancing from each rank's own load; the biases each forward routed with."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(buffer_sync=mode))
    model = fabric.setup(tiny_model("deepseek_v3"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    balancing = AuxFreeBalancing(model)
    for step in range(steps):
        tokens = rank_slice(global_batch(WORLD, step), fabric.global_rank, WORLD)
        fabric.backward(model(input_ids=tokens, labels=tokens).loss)
        balancing.update()
        optimizer.step()
        optimizer.zero_grad()
    model(input_ids=rank_slice(global_batch(WORLD, steps), fabric.global_rank, WORLD))
    after_step = [r.e_score_correction_bias.detach().clone() for r in balancing.routers]
    return {"used": balancing.used, "after_last_step": after_step}


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch_norm(mode: str, rank: int) -> Dict[str, torch.Tensor]:
    """Five SGD steps on this rank's data, with ``buffer_sync=mode`` or (``"ddp"``) under torch's DDP."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    if mode == "ddp":
        model: nn.Module = DistributedDataParallel(BatchNormNet())  # broadcast_buffers=True, its default
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step, inner = (lambda loss: loss.backward()), model.module
    else:
        fabric = make_fabric(WORLD, "32-true", MixedFSDP2Strategy(buffer_sync=mode))
        model = fabric.setup(BatchNormNet())
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        step, inner = fabric.backward, unwrap(model)
    for index in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + index)) * (1 + rank)
        step(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    from torch.distributed.tensor import DTensor

    state = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in inner.named_parameters()
    }
    state.update({n: b.clone() for n, b in inner.named_buffers()})
    return state


def _scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    return {
        "architectures": {name: _architecture(name) for name in ARCHITECTURES},
        "router": {mode: _router_bias(mode) for mode in SYNC_MODES},
        "batch_norm": {mode: _batch_norm(mode, rank) for mode in ("ddp", "broadcast", "none")},
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=300, with_folder=False)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_buffer_dtypes_are_hfs_bf16_build_except_where_a_keep_rule_names_them(results: list, name: str) -> None:
    got = results[0]["architectures"][name]
    assert got["after_setup"].keys() == got["hf_bf16"].keys()
    for buffer, dtype in got["after_setup"].items():
        expected = torch.float32 if buffer in got["keep_rules"] else got["hf_bf16"][buffer]
        assert dtype == expected, (buffer, got["keep_rules"].get(buffer))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_trains_two_steps(results: list, name: str) -> None:
    for rank in range(WORLD):
        losses = results[rank]["architectures"][name]["losses"]
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_minimax_decay_buffers_follow_the_compute_dtype_and_rope_stays_fp32(results: list) -> None:
    minimax = results[0]["architectures"]["minimax"]["after_setup"]
    decays = [n for n in minimax if "self_attn" in n and "rotary" not in n]
    assert decays and all(minimax[n] == torch.bfloat16 for n in decays)
    assert results[0]["architectures"]["llama"]["after_setup"]["model.rotary_emb.inv_freq"] == torch.float32


def _spread(results: list, mode: str, which: str) -> float:
    """The largest difference between the ranks' router biases: of the last forward, or after the last step."""

    def biases(rank: int) -> List[torch.Tensor]:
        router = results[rank]["router"][mode]
        return router["used"][-1] if which == "used" else router["after_last_step"]

    return max((a - b).abs().max().item() for a, b in zip(biases(0), biases(1), strict=True))


def test_router_biases_updated_from_local_load_drift_apart_without_sync(results: list) -> None:
    assert _spread(results, "none", "used") > 0


@pytest.mark.parametrize("mode", ["broadcast", "average"])
def test_router_biases_stay_equal_on_every_rank_with_sync(results: list, mode: str) -> None:
    for forward in range(len(results[0]["router"][mode]["used"])):
        for a, b in zip(
            results[0]["router"][mode]["used"][forward], results[1]["router"][mode]["used"][forward], strict=True
        ):
            assert torch.equal(a, b), forward
    assert _spread(results, mode, "used") == 0


def test_averaged_router_biases_are_equal_right_after_the_optimizer_step(results: list) -> None:
    assert _spread(results, "average", "after_last_step") == 0


def test_batch_norm_statistics_and_weights_match_ddp_with_broadcast(results: list) -> None:
    for rank in range(WORLD):
        ddp, ours = results[rank]["batch_norm"]["ddp"], results[rank]["batch_norm"]["broadcast"]
        assert ddp.keys() == ours.keys()
        for name in ddp:
            torch.testing.assert_close(ours[name], ddp[name], rtol=1e-5, atol=1e-6, msg=name)


def test_batch_norm_statistics_differ_across_ranks_without_sync(results: list) -> None:
    mean = "net.1.running_mean"
    assert not torch.allclose(results[0]["batch_norm"]["none"][mean], results[1]["batch_norm"]["none"][mean])
    assert torch.equal(results[0]["batch_norm"]["broadcast"]["net.1.num_batches_tracked"], torch.tensor(5))
