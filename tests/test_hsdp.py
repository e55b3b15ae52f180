"""HSDP: 4 ranks as 2 (replicate) x 2 (shard); replicated params are reduced over both dims."""

from typing import Any, Dict

import pytest
import torch

from tests.distributed import run_distributed
from tests.scenarios import (
    A_LOG,
    MIXER,
    describe_params,
    full_params,
    global_batch,
    make_fabric,
    mixer_grad_reference,
    rank_slice,
    unwrap,
)

WORLD = 4


def _hsdp_training(rank: int, world_size: int) -> Dict[str, Any]:
    from lightning_mixedfsdp.diagnostics import count_collectives
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.models import TinyLlama, causal_lm_loss

    strategy = MixedFSDP2Strategy(data_parallel_replicate_size=2, keep_fp32_params=A_LOG)
    fabric = make_fabric(world_size, "bf16-true", strategy)
    torch.manual_seed(0)
    model = fabric.setup(TinyLlama(MIXER))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out: Dict[str, Any] = {"mesh_shape": tuple(strategy.meshes.fsdp.shape)}
    for step in range(3):
        tokens = rank_slice(global_batch(world_size, step), rank, world_size)
        with count_collectives() as counts:
            fabric.backward(causal_lm_loss(model(tokens), tokens))
        if step == 0:
            out["params"] = describe_params(model)
            out["a_log_grads"] = {
                n: p.grad.to_local().clone() for n, p in unwrap(model).named_parameters() if n.endswith("A_log")
            }
            out["total_norm"] = fabric.clip_gradients(model, optimizer, max_norm=1e9).item()
        if step == 1:
            out["counted"] = counts.by_kind()
        optimizer.step()
        optimizer.zero_grad()
    out["predicted"] = fabric.strategy.plan_of(model).predicted_collectives(hsdp=True)
    out["after"] = full_params(model)
    return out


@pytest.fixture(scope="module")
def results() -> list:
    return run_distributed(_hsdp_training, WORLD)


def test_sharded_params_are_replicate_shard_and_replicated_params_replicate_replicate(results: list) -> None:
    assert results[0]["mesh_shape"] == (2, 2)
    for name, info in results[0]["params"].items():
        expected = ("Replicate()", "Replicate()") if "norm" in name or "A_log" in name else ("Replicate()", "Shard(dim=0)")
        assert info["placements"] == expected, name


def test_a_log_grad_is_identical_on_all_four_ranks_and_equals_the_reference(results: list) -> None:
    reference = mixer_grad_reference(WORLD)
    for name, grad in results[0]["a_log_grads"].items():
        for other in results[1:]:
            assert torch.equal(grad, other["a_log_grads"][name]), name
        torch.testing.assert_close(grad, reference[name], rtol=1e-3, atol=1e-5)


def test_params_stay_identical_on_all_four_ranks(results: list) -> None:
    for name, value in results[0]["after"].items():
        for other in results[1:]:
            assert torch.equal(value, other["after"][name]), name


def test_clip_norm_is_identical_on_all_ranks(results: list) -> None:
    assert len({r["total_norm"] for r in results}) == 1


def test_hsdp_collectives_equal_the_plan(results: list) -> None:
    out = results[0]
    assert out["counted"] == {k: v for k, v in out["predicted"].items() if v}
