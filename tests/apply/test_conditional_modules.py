"""Modules that run for some inputs only (a vision tower and its projector), on ranks that see different inputs: HF
Llava and Qwen2-VL from config, tower frozen, 2 ranks where one rank's row has an image and the other's has none
(and a step where no rank has one) train exactly as one process averaging the ranks' losses."""

from typing import Any, Dict, List, Tuple

import pytest
import torch

from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.apply import conditional
from lightning_mixedfsdp.apply.conditional import conditional_problems
from lightning_mixedfsdp.compat.torch import can_reduce_unused_params
from lightning_mixedfsdp.planning.conditional import conditional_trainable
from lightning_mixedfsdp.testing import run_distributed
from tests.hf_models import tiny_vlm, vlm_row
from tests.scenarios import NEEDS_UNUSED_REDUCTION, describe_params, full_params, make_fabric

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 2
IMAGES: List[Tuple[bool, ...]] = [(True, False), (False, True), (True, True), (False, False)]
"""Which rank's row has an image, step by step: one rank, the other, both, neither."""
TOWER = ("model.vision_tower.", "model.visual.")


def frozen_tower(model_type: str) -> torch.nn.Module:
    model = tiny_vlm(model_type)
    for name, param in model.named_parameters():
        if name.startswith(TOWER):
            param.requires_grad_(False)
    return model


def _train(rank: int, world_size: int, model_type: str, precision: str) -> Dict[str, Any]:
    fabric = make_fabric(world_size, precision)
    model = fabric.setup(frozen_tower(model_type))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))  # as users pass them
    first, losses, grads_present = {}, [], []
    for step, images in enumerate(IMAGES):
        loss = model(**vlm_row(model_type, 10 * step + rank, images[rank])).loss
        fabric.backward(loss)
        if step == 0:
            first = describe_params(model)
        grads_present.append(any(p.grad is not None for n, p in model.named_parameters() if "projector" in n))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with_state = {n for n, p in model.named_parameters() if optimizer.state.get(p)}
    return {
        "losses": losses,
        "params": full_params(model),
        "first": first,
        "grads": grads_present,
        "with_state": with_state,
    }


def _both(rank: int, world_size: int) -> Dict[str, Any]:
    return {kind: _train(rank, world_size, kind, "32-true") for kind in ("llava", "qwen2_vl")} | {
        "bf16": _train(rank, world_size, "llava", "bf16-true")
    }


def one_process(model_type: str) -> Dict[str, torch.Tensor]:
    model = frozen_tower(model_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, images in enumerate(IMAGES):
        loss = sum(model(**vlm_row(model_type, 10 * step + r, images[r])).loss for r in range(WORLD)) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results() -> list:
    return run_distributed(_both, WORLD, timeout=300)


def _setup_refusal(rank: int, world_size: int) -> str:
    fabric = make_fabric(world_size, "32-true")
    try:
        fabric.setup(frozen_tower("llava"))
    except ValueError as error:
        return str(error)
    return "set up"


@pytest.mark.skipif(can_reduce_unused_params(), reason="this torch reduces unused params: the projector trains")
def test_setup_refuses_a_trainable_projector_on_a_torch_without_unused_param_reduction() -> None:
    for message in run_distributed(_setup_refusal, WORLD):
        assert "model.multi_modal_projector" in message and "torch >= 2.13" in message


@NEEDS_UNUSED_REDUCTION
@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_ranks_with_and_without_images_equal_one_process(results: list, model_type: str) -> None:
    reference = one_process(model_type)
    for rank in range(WORLD):
        trained = results[rank][model_type]["params"]
        worst = max((trained[n] - reference[n]).abs().max().item() for n in reference)
        assert worst < 1e-6, (model_type, rank, worst)
    initial = dict(frozen_tower(model_type).named_parameters())
    tower = [n for n in reference if n.startswith(TOWER)]
    projector = [n for n in reference if "projector" in n or "merger" in n]
    assert tower and all(torch.equal(reference[n], initial[n]) for n in tower)  # frozen: unchanged
    assert all(torch.equal(results[0][model_type]["params"][n], initial[n].detach()) for n in tower)
    if model_type == "llava":  # the projector trains (Qwen2-VL's merger is inside its tower)
        assert any(not torch.equal(reference[n], initial[n]) for n in projector)


@NEEDS_UNUSED_REDUCTION
def test_the_projector_gets_no_grad_in_a_step_no_rank_ran_it(results: list) -> None:
    # FSDP reduced zeros for it on the rank without an image; the last step had no image anywhere: no grad, as one
    # process gives it (AdamW would otherwise decay it and move its moments)
    assert results[0]["llava"]["grads"] == [True, True, True, False]
    assert results[1]["llava"]["grads"] == [True, True, True, False]


@NEEDS_UNUSED_REDUCTION
def test_the_frozen_tower_is_bf16_except_its_norms_sharded_without_grads_or_optimizer_state(results: list) -> None:
    params = results[0]["bf16"]["first"]
    tower = {n: d for n, d in params.items() if n.startswith(TOWER)}
    norms = {n for n in tower if "layer_norm" in n or "layernorm" in n}
    assert norms and all(tower[n]["dtype"] == torch.float32 for n in norms)
    assert all(
        d["dtype"] == torch.bfloat16 and d["placements"] == ("Shard(dim=0)",)
        for n, d in tower.items()
        if n not in norms
    )
    assert all(d["grad_dtype"] is None for d in tower.values())
    assert not any(n.startswith(TOWER) for n in results[0]["bf16"]["with_state"])
    assert any("projector" in n for n in results[0]["bf16"]["with_state"])


def test_the_plan_keeps_towers_out_of_units_and_replicates_their_fp32_norms() -> None:
    plan = plan_sharding(frozen_tower("llava"), MixedFSDPConfig(), "bf16-true")
    assert plan.conditional_modules == ("model.vision_tower", "model.multi_modal_projector")
    assert not any(u.startswith("model.vision_tower") for u in plan.units)
    assert any(u.startswith("model.language_model.layers") for u in plan.units)
    [tower_norms] = [g for g in plan.groups if g.reason == "runs for some inputs"]
    assert tower_norms.replicated and "model.vision_tower.post_layernorm" in tower_norms.modules
    # the cast boundary wraps the norms, never a container whose other params sit in bf16
    assert all(m.endswith(("layer_norm1", "layer_norm2", "post_layernorm", "layernorm")) for m in tower_norms.modules)
    assert list(conditional_trainable(plan)) == ["model.multi_modal_projector"]


def test_context_parallelism_is_refused_with_modules_that_run_for_some_inputs() -> None:
    plan = plan_sharding(frozen_tower("llava"), MixedFSDPConfig(), "bf16-true")
    [problem] = [p for p in conditional_problems(plan, context_parallel=2, fault_tolerant=False) if "torch" not in p]
    assert "context_parallel_size=2" in problem and "model.vision_tower" in problem
    assert "Set context_parallel_size=1" in problem


def test_fault_tolerance_is_refused_with_modules_that_run_for_some_inputs() -> None:
    plan = plan_sharding(frozen_tower("llava"), MixedFSDPConfig(), "bf16-true")
    [problem] = [p for p in conditional_problems(plan, context_parallel=1, fault_tolerant=True) if "torch" not in p]
    assert "fault_tolerance" in problem and "Set fault_tolerance=None" in problem


def test_a_torch_without_unused_param_reduction_refuses_trainable_conditional_modules(monkeypatch: Any) -> None:
    monkeypatch.setattr(conditional, "can_reduce_unused_params", lambda: False)
    plan = plan_sharding(frozen_tower("llava"), MixedFSDPConfig(), "bf16-true")
    [problem] = conditional_problems(plan, context_parallel=1, fault_tolerant=False)
    assert "model.multi_modal_projector" in problem and "torch >= 2.13" in problem and "freeze them" in problem


def test_expert_parallelism_is_refused_with_modules_that_run_for_some_inputs() -> None:
    from dataclasses import replace

    from lightning_mixedfsdp.config import Parallelism
    from tests.hf_models import tiny_model

    moe = plan_sharding(tiny_model("qwen3_moe"), MixedFSDPConfig(parallelism=Parallelism(expert_parallel_size=2)))
    plan = replace(plan_sharding(frozen_tower("llava"), MixedFSDPConfig(), "bf16-true"), experts=moe.experts)
    [problem] = [p for p in conditional_problems(plan, context_parallel=1, fault_tolerant=False) if "torch" not in p]
    assert "expert_parallel_size=2" in problem and "Set expert_parallel_size=1" in problem
