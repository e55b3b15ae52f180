"""Fabric(strategy="mixed_fsdp2") trains mixed-dtype models on 2 ranks with real fully_shard (CPU/gloo)."""

from typing import Any, Dict

import pytest
import torch

from benchmarks.baselines import shard_each_norm_separately
from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.apply.applier import apply_dtypes
from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.testing import run_distributed
from tests.scenarios import (
    LLAMA,
    describe_params,
    full_params,
    global_batch,
    make_fabric,
    rank_slice,
    reference_model,
    train_reference,
)

STEPS = 5
WORLD = 2


def _train_llama(rank: int, world_size: int, precision: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from lightning_mixedfsdp.diagnostics.collectives import count_collectives
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(world_size, precision)
    torch.manual_seed(0)
    model = fabric.setup(TinyLlama(LLAMA))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = full_params(model)
    losses, first_step, counted = [], {}, None
    for step in range(STEPS):
        tokens = rank_slice(global_batch(world_size, step), rank, world_size)
        with count_collectives() as counts:
            loss = causal_lm_loss(model(tokens), tokens)
            fabric.backward(loss)
        if step == 2:
            counted = counts.by_kind()
        if step == 0:
            first_step = describe_params(model)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    plan = fabric.strategy.plan_of(model)
    return {
        "losses": losses,
        "params": first_step,
        "before": before,
        "after": full_params(model),
        "counted": counted,
        "predicted": plan.predicted_collectives(),
        "report": format_plan(plan),
        "sampler": fabric.strategy.distributed_sampler_kwargs,
        "fsdp_mesh": tuple(fabric.strategy.meshes.fsdp.shape),
    }


def _steady_step_counts(fabric: Any, model: Any, rank: int, world_size: int) -> Dict[str, int]:
    """Collectives of one forward+backward after a warm-up step (FSDP initialises lazily)."""
    from lightning_mixedfsdp.diagnostics.collectives import count_collectives
    from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss

    for step in range(2):
        tokens = rank_slice(global_batch(world_size, step), rank, world_size)
        with count_collectives() as counts:
            loss = causal_lm_loss(model(tokens), tokens)
            fabric.backward(loss) if fabric is not None else loss.backward()
    return counts.by_kind()


def _collective_comparison(rank: int, world_size: int) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama

    out: Dict[str, Any] = {}
    variants = {"uniform_bf16": dict(keep_fp32_modules=[]), "grouped_sharded": dict(replicate_below_bytes=0)}
    for name, fields in variants.items():
        fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(**fields))
        torch.manual_seed(0)
        model = fabric.setup(TinyLlama(LLAMA))
        out[name] = _steady_step_counts(fabric, model, rank, world_size)
        out[f"{name}_predicted"] = fabric.strategy.plan_of(model).predicted_collectives()

    torch.manual_seed(0)
    baseline = TinyLlama(LLAMA)
    apply_dtypes(baseline, plan_sharding(baseline, MixedFSDPConfig(), "bf16-true"))
    shard_each_norm_separately(baseline, fabric.strategy.meshes.fsdp)
    out["per_norm"] = _steady_step_counts(None, baseline, rank, world_size)
    return out


def _train_issue_156784(rank: int, world_size: int, strategy: Any) -> Dict[str, Any]:
    from lightning_mixedfsdp.recipes.models.tiny_llama import Issue156784Model

    fabric = make_fabric(world_size, "32-true", strategy)
    torch.manual_seed(0)
    model = fabric.setup(Issue156784Model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(8 * world_size, 32, generator=generator)
    y = x[:, :4].sum(-1, keepdim=True)
    x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank].to(fabric.device)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": describe_params(model), "after": full_params(model)}


def _skip_a_nonfinite_batch(rank: int, world_size: int, skip_only: bool) -> Dict[str, Any]:
    """Lightning's contract for ``clip_gradients`` (``error_if_nonfinite=True`` by default): a non-finite norm is a
    RuntimeError the loop catches to skip the batch, then trains on. Step 1's loss is NaN on rank 1 only
    (``skip_only``: step 1 is never run, the reference)."""
    import torch.distributed as dist

    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(world_size, "bf16-true")
    torch.manual_seed(0)
    model = fabric.setup(TinyLlama(LLAMA))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    errors, losses = [], []
    for step in range(4):
        if step == 1 and skip_only:
            continue
        tokens = rank_slice(global_batch(world_size, step), rank, world_size)
        loss = causal_lm_loss(model(tokens), tokens)
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        fabric.backward(loss)
        try:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        except RuntimeError as error:
            errors.append((step, str(error)))
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    return {"errors": errors, "losses": losses, "after": full_params(model)}


def _core_scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    results: Dict[str, Any] = {p: _train_llama(rank, world_size, p) for p in ("bf16-true", "32-true")}
    results["collectives"] = _collective_comparison(rank, world_size)
    results["issue_156784"] = _train_issue_156784(rank, world_size, "mixed_fsdp2")
    results["issue_156784_sharded"] = _train_issue_156784(rank, world_size, MixedFSDP2Strategy(replicate_below_bytes=0))
    results["nonfinite"] = {skip: _skip_a_nonfinite_batch(rank, world_size, skip) for skip in (False, True)}
    return results


@pytest.fixture(scope="module")
def core_results() -> list:
    return run_distributed(_core_scenarios, WORLD)


def test_norms_are_fp32_dtensors_with_fp32_grads_and_the_rest_bf16(core_results: list) -> None:
    for result in core_results:
        params = result["bf16-true"]["params"]
        assert params, "no params reported"
        for name, info in params.items():
            expected = torch.float32 if "norm" in name else torch.bfloat16
            assert info["dtensor"], name
            assert info["dtype"] == expected, (name, info)
            assert info["grad_dtype"] == expected, (name, info)


def test_norm_weights_were_trained(core_results: list) -> None:
    result = core_results[0]["bf16-true"]
    norm_names = [n for n in result["before"] if "norm" in n]
    assert len(norm_names) == 2 * LLAMA.n_layers + 1
    for name in norm_names:
        assert not torch.equal(result["before"][name], result["after"][name]), f"{name} did not change"


def test_ranks_hold_identical_params_after_training(core_results: list) -> None:
    for precision in ("bf16-true", "32-true"):
        rank0, rank1 = (r[precision]["after"] for r in core_results)
        for name in rank0:
            assert torch.equal(rank0[name], rank1[name]), (precision, name)


def test_fp32_losses_match_single_process_reference(core_results: list) -> None:
    # fp32 everywhere: sharded and single-process runs differ only by summation order -> float32 round-off
    reference = train_reference(reference_model(LLAMA, "32-true"), WORLD, STEPS)
    torch.testing.assert_close(core_results[0]["32-true"]["losses"], reference, rtol=1e-5, atol=1e-5)


def test_bf16_losses_match_single_process_reference_with_same_dtypes(core_results: list) -> None:
    # bf16 grads are reduced across ranks in bf16 while the reference sums one bf16 matmul over the whole batch:
    # each step's update differs by bf16 rounding (2^-8 relative), so allow 1% on the loss over 5 AdamW steps
    reference = train_reference(reference_model(LLAMA, "bf16-true"), WORLD, STEPS)
    torch.testing.assert_close(core_results[0]["bf16-true"]["losses"], reference, rtol=1e-2, atol=1e-2)
    assert core_results[0]["bf16-true"]["losses"][-1] < core_results[0]["bf16-true"]["losses"][0]


def test_collectives_per_step_equal_the_plan(core_results: list) -> None:
    for precision in ("bf16-true", "32-true"):
        result = core_results[0][precision]
        assert result["counted"] == {k: v for k, v in result["predicted"].items() if v}, result["report"]


def test_small_fp32_norms_add_no_all_gather_and_one_all_reduce_over_uniform_bf16(core_results: list) -> None:
    mixed = core_results[0]["bf16-true"]["counted"]
    uniform = core_results[0]["collectives"]["uniform_bf16"]
    assert mixed["all_gather"] == uniform["all_gather"]
    assert mixed["reduce_scatter"] == uniform["reduce_scatter"]
    assert mixed.get("all_reduce", 0) - uniform.get("all_reduce", 0) == 1


def test_grouped_norms_need_fewer_collectives_than_one_fully_shard_per_norm(core_results: list) -> None:
    counts = core_results[0]["collectives"]
    grouped, per_norm = counts["grouped_sharded"], counts["per_norm"]
    assert grouped == {k: v for k, v in counts["grouped_sharded_predicted"].items() if v}
    layers = LLAMA.n_layers
    # per norm: 2 norms + block per layer, final norm, root; grouped: 1 norm group + block per layer, same root
    assert per_norm == {"all_gather": 2 * (3 * layers + 2) - 1, "reduce_scatter": 3 * layers + 2}
    assert grouped == {"all_gather": 2 * (2 * layers + 2) - 1, "reduce_scatter": 2 * layers + 2}


@pytest.mark.parametrize("variant", ["issue_156784", "issue_156784_sharded"])
def test_issue_156784_model_with_one_bf16_linear_trains_with_the_string_strategy(
    core_results: list, variant: str
) -> None:
    result = core_results[0][variant]
    for name, info in result["params"].items():
        assert info["dtype"] == (torch.bfloat16 if name.startswith("hidden.") else torch.float32), name
        assert info["dtensor"]
    assert result["losses"][-1] < result["losses"][0]
    for name, value in result["after"].items():
        assert torch.equal(value, core_results[1][variant]["after"][name]), name


def test_default_mesh_is_pure_data_parallel_over_all_ranks(core_results: list) -> None:
    for rank, result in enumerate(core_results):
        assert result["bf16-true"]["fsdp_mesh"] == (WORLD,)
        assert result["bf16-true"]["sampler"] == {"num_replicas": WORLD, "rank": rank}


_EXIT_SCRIPT = """
import atexit, sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

import lightning_mixedfsdp  # noqa: F401

out = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=2, strategy="mixed_fsdp2", precision="bf16-true")
# registered before the strategy's exit hook, so it runs after it (atexit runs last in, first out)
atexit.register(lambda: (out / f"rank{fabric.global_rank}").write_text(str(dist.is_initialized())))
fabric.launch()
model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
# a collective right before the end: the pattern whose gloo worker could outlive the interpreter
fabric.all_gather(model(torch.ones(2, 8)).float().sum().detach())
"""


def test_a_launched_run_destroys_its_process_groups_before_the_interpreter_exits(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exits.py"
    script.write_text(_EXIT_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=180
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(WORLD)] == ["False", "False"]


def test_a_non_finite_grad_norm_is_a_catchable_error_and_the_loop_trains_on(core_results: list) -> None:
    for rank_results in core_results:
        poisoned, skipped = rank_results["nonfinite"][False], rank_results["nonfinite"][True]
        # every rank raises at step 1 (the global norm is NaN everywhere), with torch's message
        assert [step for step, _ in poisoned["errors"]] == [1] and not skipped["errors"]
        assert "non-finite (nan), so it cannot be clipped" in poisoned["errors"][0][1]
        # catching and skipping leaves the model as if the batch never came, bit for bit, with no NaN anywhere
        assert poisoned["losses"] == skipped["losses"] and len(poisoned["losses"]) == 3
        for name, value in poisoned["after"].items():
            assert torch.isfinite(value).all() and torch.equal(value, skipped["after"][name]), name
