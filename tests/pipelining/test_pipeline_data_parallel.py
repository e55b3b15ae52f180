"""4 ranks: pipeline parallelism 2 composed with FSDP 2 (each stage sharded over 2 ranks) and with HSDP's replicate 2
(shard 1): each data-parallel replica trains on its part of the global batch, and the result equals one process on
the whole batch (32-true: losses, the clip norm, every param by name)."""

from typing import Any, Dict, List

import pytest
import torch

from tests.conftest import Launch
from tests.pipelining.test_pipeline_parallel import LR, STEPS, batches, llama, lm_loss, merged, one_process
from tests.scenarios import full_params, make_fabric, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 4
LAYOUTS = {
    "fsdp": {"data_parallel_size": 2},
    "hsdp": {"data_parallel_replicate_size": 2, "data_parallel_size": 1},
}


def _layout(rank: int, name: str) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(pipeline_parallel_size=2, pipeline_microbatches=2, **LAYOUTS[name])
    fabric = make_fabric(WORLD, "32-true", strategy)
    model = llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    sampler = fabric.strategy.distributed_sampler_kwargs
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        part = batch.chunk(sampler["num_replicas"])[sampler["rank"]]
        loss = fabric.strategy.pipeline_step(model, part, target=part, loss_fn=lm_loss)
        torch.distributed.all_reduce(loss, group=fabric.strategy.meshes.data_parallel.get_group())
        losses.append(loss.item() / sampler["num_replicas"])
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1e9).item())
        optimizer.step()
        optimizer.zero_grad()
    placements = {n: tuple(repr(p) for p in param.placements) for n, param in unwrap(model).named_parameters()}
    return {
        "sampler": sampler,
        "losses": losses,
        "norms": norms,
        "params": full_params(model),
        "placements": placements,
        "pipeline_rank": fabric.strategy.meshes.pipeline.get_local_rank(),
    }


def _evaluation_between(rank: int) -> Dict[str, Any]:
    """PP 2 x FSDP 2, a user's order: step, evaluate, optimizer step, step (the evaluation must leave no gathered
    copy that the next forward reads instead of the updated shards); the last stage keeps no micro-batch outputs."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(pipeline_parallel_size=2, pipeline_microbatches=2, data_parallel_size=2)
    fabric = make_fabric(WORLD, "32-true", strategy)
    model = llama()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    sampler = fabric.strategy.distributed_sampler_kwargs
    losses = []
    for batch in batches()[:STEPS]:
        part = batch.chunk(sampler["num_replicas"])[sampler["rank"]]
        loss = fabric.strategy.pipeline_step(model, part, target=part, loss_fn=lm_loss)
        torch.distributed.all_reduce(loss, group=fabric.strategy.meshes.data_parallel.get_group())
        losses.append(loss.item() / sampler["num_replicas"])
        fabric.strategy.pipeline_eval(model, part, target=part, loss_fn=lm_loss)
        optimizer.step()
        optimizer.zero_grad()
    runner = fabric.strategy._runner_of(model, "test")
    kept = [len(stage.output_chunks) for schedule, _ in runner._schedules.values() for stage in _stages(schedule)]
    return {"losses": losses, "kept_outputs": kept}


def _stages(schedule: Any) -> List[Any]:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def _scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    return {**{name: _layout(rank, name) for name in LAYOUTS}, "evaluation_between": _evaluation_between(rank)}


LAUNCH = Launch(_scenarios, WORLD, with_folder=False, timeout=400)


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return one_process(as_documents=False)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_with_data_parallel_equals_one_process(results: list, reference: Dict[str, Any], layout: str) -> None:
    assert [r[layout]["pipeline_rank"] for r in results] == [0, 0, 1, 1], "the pipeline dim is outermost"
    assert [r[layout]["sampler"] for r in results] == [{"num_replicas": 2, "rank": i} for i in (0, 1, 0, 1)]
    for result in results:
        assert result[layout]["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert result[layout]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    stages = merged([results[0], results[2]], layout, "params")
    assert set(stages) == set(reference["params"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(stages[name], value.detach(), atol=1e-5, rtol=0, msg=name)
        for replica in (results[1], results[3]):
            if name in replica[layout]["params"]:
                assert torch.equal(replica[layout]["params"][name], stages[name]), name


def test_each_stage_shards_over_its_own_data_parallel_ranks(results: list) -> None:
    weight = "model.layers.0.mlp.up_proj.weight"
    assert results[0]["fsdp"]["placements"][weight] == ("Shard(dim=0)",)
    assert results[0]["hsdp"]["placements"][weight] == ("Replicate()", "Shard(dim=0)")


def test_an_evaluation_between_steps_leaves_the_stages_resharded(results: list) -> None:
    """One process, SGD at lr 0.5 (a stale gathered copy would show in the second loss): the same two losses."""
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    for batch in batches()[:STEPS]:
        loss = lm_loss(model(batch), batch)
        loss.backward()
        expected.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    for result in results:
        assert result["evaluation_between"]["losses"] == pytest.approx(expected, abs=1e-5)
    assert all(kept == 0 for result in results for kept in result["evaluation_between"]["kept_outputs"])
