"""Muon under HSDP, 2 replicas x 2 shards on 4 ranks: each replica orthogonalises its shard group's matrices itself
(no Muon traffic across the replicate dim), the replicas stay equal, and 3 steps of torch's Muon beside AdamW land
within 1 % of one process's movement (the norm of the difference against the norm of the update: the replicate dim's
all-reduce sums the gradients in another order than one process, and Muon's bf16 Newton-Schulz turns last-bit
differences into visible ones)."""

from typing import Any, Dict

import pytest
import torch

from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss
from tests.apply.test_muon import STEPS, _model, _step, _torch_optimizers
from tests.conftest import Launch
from tests.scenarios import full_params, global_batch, make_fabric, rank_slice

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 4


def _hsdp(rank: int, world: int) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world, strategy=MixedFSDP2Strategy(data_parallel_replicate_size=2))
    model = fabric.setup_module(_model())
    muon, adamw = fabric.setup_optimizers(*_torch_optimizers(model))
    for step in range(STEPS):
        _step(model, (muon, adamw), step, world, rank, fabric.backward)
    w1 = model.layers[0].feed_forward.w1.weight
    return {"after": full_params(model), "placements": tuple(repr(p) for p in w1.placements)}


LAUNCH = Launch(_hsdp, WORLD, with_folder=False, timeout=300)


def test_hsdp_replicas_stay_equal_and_land_within_a_percent_of_one_process(results: list) -> None:
    model = _model()
    optimizers = _torch_optimizers(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(STEPS):
        for rank in range(WORLD):
            tokens = rank_slice(global_batch(WORLD, step), rank, WORLD)
            (causal_lm_loss(model(tokens), tokens) / WORLD).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert results[0]["placements"] == ("Replicate()", "Shard(dim=0)")
    for result in results[1:]:
        assert all(torch.equal(result["after"][n], results[0]["after"][n]) for n in start)
    for name, value in model.named_parameters():
        # Frobenius norms: the update's error against the update
        movement = (value.detach() - start[name]).norm().item()
        off = (results[0]["after"][name] - value.detach()).norm().item()
        assert movement > 0 and off <= 0.01 * movement, (name, off, movement)
