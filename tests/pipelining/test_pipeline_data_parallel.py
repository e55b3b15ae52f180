"""4 ranks: pipeline parallelism 2 composed with FSDP 2 (each stage sharded over 2 ranks), with HSDP's replicate 2
(shard 1), and with tensor parallelism 2 from the model's own plan (each stage's projections split over 2 ranks):
each data-parallel replica trains on its part of the global batch, and the result equals one process on the whole
batch (32-true: losses, the clip norm, every param by name)."""

from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.pipelining.test_pipeline_parallel import (
    LR,
    STEPS,
    _step,
    batches,
    llama,
    lm_loss,
    merged,
    one_process,
    sgd_in_one_process,
)
from tests.scenarios import full_params, make_fabric, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 4
LAYOUTS = {
    "fsdp": {"data_parallel_size": 2},
    "hsdp": {"data_parallel_replicate_size": 2, "data_parallel_size": 1},
    "tp": {"tensor_parallel_size": 2, "data_parallel_size": 1},
}
REPLICAS = {"fsdp": 2, "hsdp": 2, "tp": 1}
"""Data-parallel replicas per layout: TP ranks train on the same rows."""


def _layout(rank: int, name: str) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(pipeline_parallel_size=2, pipeline_microbatches=2, **LAYOUTS[name])
    fabric = make_fabric(WORLD, "32-true", strategy)
    model = llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    sampler = fabric.strategy.distributed_sampler_kwargs
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        part, loss = _replica_step(fabric, model, batch)
        losses.append(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1e9).item())
        optimizer.step()
        optimizer.zero_grad()
    placements = {n: describe_placements(param) for n, param in unwrap(model).named_parameters()}
    return {
        "sampler": sampler,
        "losses": losses,
        "norms": norms,
        "params": full_params(model),
        "placements": placements,
        "pipeline_rank": fabric.strategy.meshes.pipeline.get_local_rank(),
    }


def _replica_step(fabric: Any, model: Any, batch: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """This data-parallel replica's part of the global ``batch`` through one pipeline step; the part, and the loss
    averaged over the replicas (what one process computes on the whole batch)."""
    sampler = fabric.strategy.distributed_sampler_kwargs
    part = batch.chunk(sampler["num_replicas"])[sampler["rank"]]
    loss = fabric.strategy.pipeline_step(model, part, target=part, loss_fn=lm_loss)
    torch.distributed.all_reduce(loss, group=fabric.strategy.meshes.data_parallel.get_group())
    return part, loss.item() / sampler["num_replicas"]


def describe_placements(param: Any) -> Any:
    """``(mesh dims, placements)`` of a DTensor param."""
    return tuple(param.device_mesh.mesh_dim_names), tuple(repr(p) for p in param.placements)


def _evaluation_between(rank: int) -> Dict[str, Any]:
    """PP 2 x FSDP 2, a user's order: step, evaluate, optimizer step, step (the evaluation must leave no gathered
    copy that the next forward reads instead of the updated shards); the last stage keeps no micro-batch outputs."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(pipeline_parallel_size=2, pipeline_microbatches=2, data_parallel_size=2)
    fabric = make_fabric(WORLD, "32-true", strategy)
    model = llama()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for batch in batches()[:STEPS]:
        part, loss = _replica_step(fabric, model, batch)
        losses.append(loss)
        fabric.strategy.pipeline_eval(model, part, target=part, loss_fn=lm_loss)
        optimizer.step()
        optimizer.zero_grad()
    runner = fabric.strategy._runner_of(model, "test")
    kept = [len(stage.output_chunks) for schedule, _ in runner._schedules.values() for stage in _stages(schedule)]
    return {"losses": losses, "kept_outputs": kept}


def _tensor_parallel_stages(rank: int, folder: str) -> Dict[str, Any]:
    """PP 2 x TP 2 (the model's own plan): bf16-true keeps every norm fp32 on each stage and TP rank; a DCP save
    loads at PP 1 x FSDP 4 and back at PP 2 x TP 2; the export from the four ranks is one HF folder."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    def pp_tp(precision: str = "32-true") -> Any:
        options = dict(pipeline_parallel_size=2, pipeline_microbatches=2, tensor_parallel_size=2)
        return make_fabric(WORLD, precision, MixedFSDP2Strategy(data_parallel_size=1, **options))

    out: Dict[str, Any] = {}
    fabric = pp_tp("bf16-true")
    model = fabric.setup(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["bf16_losses"] = [_step(fabric, model, optimizer, batch) for batch in batches()[:STEPS]]
    out["bf16_dtypes"] = {n: p.dtype for n, p in unwrap(model).named_parameters()}

    fabric = pp_tp()
    model = fabric.setup(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    for batch in batches()[:STEPS]:
        _step(fabric, model, optimizer, batch)
    path = Path(folder) / "pp2_tp2.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.strategy.export_safetensors(model, Path(folder) / "export", dtype=torch.float32)
    out["saved"] = full_params(model)
    flat = make_fabric(WORLD, "32-true", MixedFSDP2Strategy(data_parallel_size=4))
    model = flat.setup(llama(seed=5))
    optimizer = flat.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    flat.load(path, {"model": model, "optimizer": optimizer})
    out["at_fsdp4"] = full_params(model)
    flat.save(Path(folder) / "fsdp4.ckpt", {"model": model, "optimizer": optimizer})
    fabric = pp_tp()
    model = fabric.setup(llama(seed=6))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    fabric.load(Path(folder) / "fsdp4.ckpt", {"model": model, "optimizer": optimizer})
    out["back_at_pp2_tp2"] = full_params(model)
    return out


def _expert_parallel_stages(rank: int) -> Dict[str, Any]:
    """Qwen3-MoE in two stages, each over 2 data-parallel ranks that split its experts (EP 2): SGD at a rate where a
    token routed to the wrong rank or a grad reduced twice shows."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    options = dict(pipeline_parallel_size=2, pipeline_microbatches=2, data_parallel_size=2, expert_parallel_size=2)
    fabric = make_fabric(WORLD, "32-true", MixedFSDP2Strategy(**options))
    model = fabric.setup(moe())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=MOE_LR))
    losses = []
    for batch in batches()[:STEPS]:
        part, loss = _replica_step(fabric, model, batch)
        losses.append(loss)
        optimizer.step()
        optimizer.zero_grad()
    placements = {n: describe_placements(param) for n, param in unwrap(model).named_parameters()}
    return {"losses": losses, "params": full_params(model), "placements": placements}


MOE_LR = 0.5


def moe() -> torch.nn.Module:
    return tiny_model("qwen3_moe", num_hidden_layers=4, tie_word_embeddings=False)


def _stages(schedule: Any) -> List[Any]:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    return {
        **{name: _layout(rank, name) for name in LAYOUTS},
        "evaluation_between": _evaluation_between(rank),
        "tensor_parallel_stages": _tensor_parallel_stages(rank, folder),
        "expert_parallel_stages": _expert_parallel_stages(rank),
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=400)


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return one_process(as_documents=False)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_with_data_parallel_equals_one_process(results: list, reference: Dict[str, Any], layout: str) -> None:
    assert [r[layout]["pipeline_rank"] for r in results] == [0, 0, 1, 1], "the pipeline dim is outermost"
    replicas = REPLICAS[layout]
    expected_samplers = [{"num_replicas": replicas, "rank": i % replicas} for i in (0, 1, 0, 1)]
    assert [r[layout]["sampler"] for r in results] == expected_samplers
    for result in results:
        assert result[layout]["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert result[layout]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    stages = merged([results[0], results[2]], layout, "params")
    assert set(stages) == set(reference["params"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(stages[name], value.detach(), atol=1e-5, rtol=0, msg=name)
        for replica in (results[1], results[3]):  # the other replica, or the other TP rank
            if name in replica[layout]["params"]:
                assert torch.equal(replica[layout]["params"][name], stages[name]), name


def test_each_stage_shards_over_its_own_data_parallel_ranks(results: list) -> None:
    weight = "model.layers.0.mlp.up_proj.weight"
    assert results[0]["fsdp"]["placements"][weight] == (("data_parallel_shard",), ("Shard(dim=0)",))
    assert results[0]["hsdp"]["placements"][weight] == (
        ("data_parallel_replicate", "data_parallel_shard"),
        ("Replicate()", "Shard(dim=0)"),
    )


def test_each_stage_splits_its_projections_over_the_tensor_parallel_ranks_by_the_models_plan(results: list) -> None:
    """Llama's ``base_model_tp_plan``: q/k/v, gate and up colwise (rows split), o and down rowwise (columns split);
    norms stay whole on every TP rank (fp32-capable, outside the plan), sharded over the stage's FSDP rank."""
    for rank in (0, 2):
        placements = results[rank]["tp"]["placements"]
        layer = 0 if rank == 0 else 2
        up, down = (placements[f"model.layers.{layer}.mlp.{name}.weight"][1] for name in ("up_proj", "down_proj"))
        # FSDP shards dim 0 over the stage's data-parallel rank (strided where TP splits dim 0 too)
        assert "Shard(dim=0" in up[0] and up[1] == "Shard(dim=0)"
        assert down == ("Shard(dim=0)", "Shard(dim=1)")
        assert placements[f"model.layers.{layer}.self_attn.q_proj.weight"][0][-1] == "tensor_parallel"
        assert "tensor_parallel" not in placements[f"model.layers.{layer}.input_layernorm.weight"][0]


def test_an_evaluation_between_steps_leaves_the_stages_resharded(results: list) -> None:
    """One process, SGD at lr 0.5 (a stale gathered copy would show in the second loss): the same two losses."""
    expected = sgd_in_one_process(llama(), lr=0.5)
    for result in results:
        assert result["evaluation_between"]["losses"] == pytest.approx(expected, abs=1e-5)
    assert all(kept == 0 for result in results for kept in result["evaluation_between"]["kept_outputs"])


def test_bf16_stages_split_by_tensor_parallelism_keep_every_norm_fp32(results: list) -> None:
    for result in results:
        got = result["tensor_parallel_stages"]
        assert got["bf16_dtypes"] and all(
            dtype == (torch.float32 if "norm" in name else torch.bfloat16) for name, dtype in got["bf16_dtypes"].items()
        ), got["bf16_dtypes"]
        losses = got["bf16_losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_a_checkpoint_moves_from_pp2_tp2_to_fsdp4_and_back_and_exports_one_folder(results: list, folder: Path) -> None:
    from safetensors.torch import load_file

    saved = merged([results[0], results[2]], "tensor_parallel_stages", "saved")
    assert set(saved) == set(llama().state_dict())
    for result in results:
        at_fsdp4 = result["tensor_parallel_stages"]["at_fsdp4"]
        assert set(at_fsdp4) == set(saved)
        assert all(torch.equal(at_fsdp4[name], saved[name]) for name in saved)
    back = merged([results[0], results[2]], "tensor_parallel_stages", "back_at_pp2_tp2")
    assert all(torch.equal(back[name], saved[name]) for name in saved)
    stored = {n: t for path in sorted((folder / "export").glob("*.safetensors")) for n, t in load_file(path).items()}
    assert set(stored) == set(saved)
    assert all(torch.equal(stored[name], saved[name]) for name in saved)


def test_moe_stages_with_their_experts_split_over_each_stages_ranks_train_as_one_process(results: list) -> None:
    model = moe()
    losses = sgd_in_one_process(model, MOE_LR)
    for result in results:
        assert result["expert_parallel_stages"]["losses"] == pytest.approx(losses, abs=1e-5)
    stages = merged([results[0], results[2]], "expert_parallel_stages", "params")
    assert set(stages) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(stages[name], param.detach(), atol=1e-5, rtol=0, msg=name)
    experts = [n for n in results[0]["expert_parallel_stages"]["placements"] if ".mlp.experts." in n]
    assert experts and all(
        "expert_parallel" in results[0]["expert_parallel_stages"]["placements"][n][0] for n in experts
    ), results[0]["expert_parallel_stages"]["placements"]
