"""Semi-synchronous replicas (``replicate_sync``): local SGD and DiLoCo across HSDP's replicate dim on real
``fully_shard``ed models, against their formulas written out here, against every-step sync, and for a bf16 param whose
averaged change is below its spacing (an fp32 global copy keeps it; a bf16 one loses it)."""

import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.apply.semi_sync import semi_sync_problems
from lightning_mixedfsdp.testing import run_distributed
from tests.scenarios import full_params, make_fabric

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

STEPS = 4
SYNC_EVERY = 2
LR = 0.05
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs).square().mean()


def strategy(replicate: int, **settings: Any) -> Any:
    from lightning_mixedfsdp.strategies.fabric import MixedFSDP2Strategy

    return MixedFSDP2Strategy(data_parallel_replicate_size=replicate, **settings)


def _train(rank: int, world_size: int, replicate: int, settings: Dict[str, Any]) -> Dict[str, Any]:
    """SGD steps on this rank's batches; every rank's full params after each step (its replica's)."""
    fabric = make_fabric(world_size, "32-true", strategy=strategy(replicate, **settings))
    model = fabric.setup(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    after = []
    for step in range(STEPS):
        fabric.backward(loss_of(model, batch(rank, step)))
        optimizer.step()
        optimizer.zero_grad()
        after.append(full_params(model))
    return {"after": after, "sync_mesh": tuple(fabric.strategy.meshes.fsdp.shape)}


def _bf16_below_spacing(rank: int, world_size: int, state_dtype: torch.dtype) -> List[float]:
    """One bf16 weight of 1.0 (spacing 2**-7 above it, 2**-8 below); replica 0's SGD step moves it down by one
    spacing, replica 1's not at all: the averaged change times the outer lr (0.1) is 0.1 of the spacing below 1.0."""
    from lightning_mixedfsdp.apply.semi_sync import OuterSync

    settings = dict(replicate_sync="diloco", sync_every=1, outer_lr=0.1, outer_momentum=0.0, outer_nesterov=False)
    fabric = make_fabric(world_size, "bf16-true", strategy=strategy(2, keep_fp32_modules=[], **settings))
    with torch.device("meta"):
        layer = nn.Linear(1, 1, bias=False)
    model = fabric.setup(layer)
    sharded = fabric.strategy._sharded
    applied = next(iter(sharded._applied.values()))
    if state_dtype != torch.float32:  # the control: the global copy held in the param's dtype
        outer = applied.outer
        applied.after_step.remove(outer.after_step)
        applied.outer = OuterSync(outer.params, outer.exchange, "diloco", 1, 0.1, 0.0, False, None, state_dtype)
        applied.after_step.append(applied.outer.after_step)
    with torch.no_grad():  # the global copy is taken from it at the first step
        for p in model.parameters():
            p.to_local().fill_(1.0)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1.0))
    weights = []
    for _ in range(10):
        push = 2.0**-7 if fabric.strategy.meshes.outer.get_local_rank() == 0 else 0.0
        fabric.backward(model(torch.full((1, 1), push, dtype=torch.bfloat16)).sum())
        optimizer.step()
        optimizer.zero_grad()
        weights.append(float(next(model.parameters()).full_tensor()))
    return weights


def _save_mid_cycle(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """DiLoCo with H=4: a save after step 2 syncs first (an early outer step); the params saved are every replica's."""
    settings = dict(replicate_sync="diloco", sync_every=4)
    fabric = make_fabric(world_size, "32-true", strategy=strategy(2, **settings))
    model = fabric.setup(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    for step in range(2):
        fabric.backward(loss_of(model, batch(rank, step)))
        optimizer.step()
        optimizer.zero_grad()
    before = full_params(model)
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    after = full_params(model)
    fabric.save(folder + "_again", {"model": model, "optimizer": optimizer})  # e.g. a top-k and a `last` save
    return {"before": before, "after": after, "after_second_save": full_params(model)}


RESUME_STEPS, RESUME_AT = 6, 4
DILOCO_H2 = dict(replicate_sync="diloco", sync_every=2, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)


def _resume_run(
    rank: int,
    world_size: int,
    folder: str,
    settings: Dict[str, Any],
    save_at: int = -1,
    load: bool = False,
    single_file: bool = False,
) -> Dict[str, Any]:
    """AdamW on 2 replicas: steps from ``RESUME_AT`` after a load of ``folder``, else from 0 (a save after step
    ``save_at``); each step's loss and the final params. A fresh init differs from the saved run's (seed 1)."""
    import warnings

    fabric = make_fabric(
        world_size, "32-true", strategy=strategy(2, save_distributed_checkpoint=not single_file, **settings)
    )
    torch.manual_seed(1)
    model = fabric.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)) if load else mlp())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    caught: List[str] = []
    if load:
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            fabric.load(folder, {"model": model, "optimizer": optimizer})
        caught = [str(w.message) for w in found if "outer state" in str(w.message)]
    losses = []
    for step in range(RESUME_AT if load else 0, RESUME_STEPS):
        loss = loss_of(model, batch(rank, step))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == save_at:
            fabric.save(folder, {"model": model, "optimizer": optimizer})
    return {"losses": losses, "params": full_params(model), "warnings": caught}


def _trainer_fit(world_size: int, folder: str, ckpt_path: Any = None) -> List[float]:
    """The Trainer with DiLoCo at H=2 for ``RESUME_STEPS`` steps, a checkpoint after step ``RESUME_AT``; the losses."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy
    from lightning_mixedfsdp.testing import accelerator_for

    losses: List[float] = []

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, _batch: Any, _index: int) -> torch.Tensor:
            loss = loss_of(self.net, batch(self.global_rank, self.global_step))  # the step's batch, resumed or not
            losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    trainer = pl.Trainer(
        accelerator=accelerator_for(world_size),
        devices=world_size,
        strategy=MixedFSDP2Strategy(data_parallel_replicate_size=2, **DILOCO_H2),
        max_steps=RESUME_STEPS,
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=RESUME_AT, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), torch.utils.data.DataLoader(torch.zeros(RESUME_STEPS * 2, 1)), ckpt_path=ckpt_path)
    return losses


def _resumes(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """DiLoCo at H=2 saved at step 4 (a sync point) as DCP and as one file, resumed; across the two kinds of run."""
    runs = {
        "uninterrupted": _resume_run(rank, world_size, folder + "/dcp", DILOCO_H2, save_at=RESUME_AT),
        "resumed": _resume_run(rank, world_size, folder + "/dcp", DILOCO_H2, load=True),
    }
    _resume_run(rank, world_size, folder + "/file", DILOCO_H2, save_at=RESUME_AT, single_file=True)
    runs["resumed_from_file"] = _resume_run(rank, world_size, folder + "/file", DILOCO_H2, load=True, single_file=True)
    runs["every_step_from_diloco"] = _resume_run(rank, world_size, folder + "/dcp", {}, load=True)
    _resume_run(rank, world_size, folder + "/every_step", {}, save_at=RESUME_AT)
    runs["diloco_from_every_step"] = _resume_run(rank, world_size, folder + "/every_step", DILOCO_H2, load=True)
    trainer_losses = _trainer_fit(world_size, folder + "/trainer")
    checkpoint = next(Path(folder, "trainer").glob(f"*step={RESUME_AT}*"))
    runs["trainer"] = {
        "uninterrupted": trainer_losses[RESUME_AT:],
        "resumed": _trainer_fit(world_size, folder + "/trainer_resumed", str(checkpoint)),
    }
    return runs


def _save_with_state_one_replica_lacks(rank: int, world_size: int, folder: str) -> str:
    """Replica 1 never uses the second head, so its AdamW holds no state for it: the save refuses on both ranks."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, inputs: torch.Tensor, both: bool) -> torch.Tensor:
            return self.first(inputs) + (self.second(inputs) if both else 0)

    fabric = make_fabric(world_size, "32-true", strategy=strategy(2, replicate_sync="diloco", sync_every=2))
    model = fabric.setup(TwoHeads())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    fabric.backward(model(batch(rank, 0), both=rank == 0).square().mean())
    optimizer.step()
    try:
        fabric.save(folder, {"model": model, "optimizer": optimizer})
    except RuntimeError as err:
        return str(err)
    return "saved"


def _lora_with_activation_checkpointing(rank: int, world_size: int) -> Dict[str, Any]:
    """An HF Llama with LoRA adapters, activation checkpointing, DiLoCo at H=2 on 2 replicas: only the adapters sync."""
    from peft import LoraConfig, get_peft_model

    from tests.hf_models import tiny_model

    settings = dict(replicate_sync="diloco", sync_every=2, activation_checkpointing="full")
    fabric = make_fabric(world_size, "bf16-true", strategy=strategy(2, **settings))
    model = fabric.setup(get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    applied = next(iter(fabric.strategy._sharded._applied.values()))
    before, after = full_params(model), []
    for step in range(2):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        fabric.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
        after.append(full_params(model))
    synced = [n for n, p in model.named_parameters() if any(p is q for q in applied.outer.params)]
    return {"before": before, "after": after, "synced": synced}


def _scenarios_2x2(rank: int, world_size: int) -> Dict[str, Any]:
    diloco = dict(replicate_sync="diloco", sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    return {"diloco": _train(rank, world_size, 2, diloco)}


def _scenarios_2x1(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    diloco = dict(replicate_sync="diloco", sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    return {
        "diloco": _train(rank, world_size, 2, diloco),
        "local_sgd_1": _train(rank, world_size, 2, dict(replicate_sync="local_sgd", sync_every=1)),
        "every_step": _train(rank, world_size, 2, {}),
        "bf16_fp32_state": _bf16_below_spacing(rank, world_size, torch.float32),
        "bf16_bf16_state": _bf16_below_spacing(rank, world_size, torch.bfloat16),
        "saved": _save_mid_cycle(rank, world_size, folder),
        "lora": _lora_with_activation_checkpointing(rank, world_size),
        "resume": _resumes(rank, world_size, folder + "_resume"),
        "state_one_replica_lacks": _save_with_state_one_replica_lacks(rank, world_size, folder + "_lacks"),
    }


@pytest.fixture(scope="module")
def two_by_one(tmp_path_factory: pytest.TempPathFactory) -> list:
    return run_distributed(_scenarios_2x1, 2, str(tmp_path_factory.mktemp("semi_sync") / "mid_cycle"), timeout=300)


@pytest.fixture(scope="module")
def two_by_two() -> list:
    return run_distributed(_scenarios_2x2, 4, timeout=300)


def local_steps(params: Dict[str, torch.Tensor], batches: List[List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """One replica's SGD steps from ``params``: per step the mean loss over its ranks' batches (FSDP averages the
    shard ranks' grads)."""
    model = mlp()
    model.load_state_dict(params)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step_batches in batches:
        sum(loss_of(model, b) for b in step_batches).__truediv__(len(step_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def diloco_reference(replicas: int, shards: int) -> List[Dict[str, torch.Tensor]]:
    """DiLoCo written out: per cycle each replica's local steps from the global params, the pseudo-gradients
    averaged, Nesterov momentum, the outer step; the global params after each cycle."""
    global_params = {k: v.detach().clone() for k, v in mlp().state_dict().items()}
    momentum = {k: torch.zeros_like(v) for k, v in global_params.items()}
    after_cycles = []
    for cycle in range(STEPS // SYNC_EVERY):
        steps = range(cycle * SYNC_EVERY, (cycle + 1) * SYNC_EVERY)
        ends = [
            local_steps(global_params, [[batch(r * shards + s, step) for s in range(shards)] for step in steps])
            for r in range(replicas)
        ]
        for name in global_params:
            delta = sum(global_params[name] - end[name] for end in ends) / replicas
            momentum[name] = OUTER_MOMENTUM * momentum[name] + delta
            global_params[name] = global_params[name] - OUTER_LR * (delta + OUTER_MOMENTUM * momentum[name])
        after_cycles.append({k: v.clone() for k, v in global_params.items()})
    return after_cycles


def assert_close(found: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], tolerance: float) -> None:
    worst = max((found[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= tolerance, worst


@pytest.mark.parametrize(("layout", "shards"), [("2x1", 1), ("2x2", 2)])
def test_diloco_outer_step_equals_its_formula(two_by_one: list, two_by_two: list, layout: str, shards: int) -> None:
    results = two_by_one if layout == "2x1" else two_by_two
    expected = diloco_reference(2, shards)
    for rank in range(2 * shards):
        after = results[rank]["diloco"]["after"]
        for cycle, reference in enumerate(expected):
            assert_close(after[(cycle + 1) * SYNC_EVERY - 1], reference, 1e-6)
    assert results[0]["diloco"]["sync_mesh"] == (shards,)  # FSDP shards within a replica only


def test_replicas_are_equal_to_the_bit_after_each_sync_and_apart_between(two_by_two: list) -> None:
    for step in range(STEPS):
        same = all(
            torch.equal(two_by_two[s]["diloco"]["after"][step][k], two_by_two[2 + s]["diloco"]["after"][step][k])
            for s in range(2)
            for k in two_by_two[0]["diloco"]["after"][step]
        )
        assert same == ((step + 1) % SYNC_EVERY == 0), step


def test_local_sgd_every_step_with_plain_sgd_equals_every_step_sync(two_by_one: list) -> None:
    for rank in range(2):
        for local, synced in zip(
            two_by_one[rank]["local_sgd_1"]["after"], two_by_one[rank]["every_step"]["after"], strict=True
        ):
            assert_close(local, synced, 1e-6)
    assert two_by_one[0]["every_step"]["sync_mesh"] == (2, 1)  # HSDP: gradients cross the replicate dim


def test_an_fp32_global_copy_keeps_a_bf16_change_below_the_spacing_that_a_bf16_one_loses(two_by_one: list) -> None:
    kept, lost = two_by_one[0]["bf16_fp32_state"], two_by_one[0]["bf16_bf16_state"]
    assert lost == [1.0] * 10  # each outer step's 0.1 spacing rounds away in a bf16 global copy
    assert kept[0] == 1.0 and kept[-1] < 1.0  # accumulated in fp32, it moves the bf16 weight within a few syncs
    assert kept.index(kept[-1]) <= 6 and kept[-1] == 1.0 - 2.0**-8


def test_a_save_mid_cycle_syncs_the_replicas_first(two_by_one: list) -> None:
    first, second = two_by_one[0]["saved"], two_by_one[1]["saved"]
    assert any(not torch.equal(first["before"][k], second["before"][k]) for k in first["before"])  # mid-cycle
    assert all(torch.equal(first["after"][k], second["after"][k]) for k in first["after"])  # synced by the save
    # a second save at the same step finds them synced: no second outer step (its momentum would move them)
    assert all(torch.equal(first["after"][k], first["after_second_save"][k]) for k in first["after"])


def test_a_resume_from_a_sync_point_repeats_the_uninterrupted_run(two_by_one: list) -> None:
    """The outer state (DiLoCo's fp32 global copy, its momentum, the cycle's position) is in the checkpoint, and the
    save made the replicas' AdamW states equal: the resumed steps' losses and the params after the next outer step
    equal the uninterrupted run's, from a DCP folder and from one file (Fabric), and the Trainer's resumed losses
    equal its uninterrupted ones; without the outer state the momentum would restart at zero and the params differ."""
    for rank in (0, 1):
        runs = two_by_one[rank]["resume"]
        uninterrupted = runs["uninterrupted"]
        for resumed in (runs["resumed"], runs["resumed_from_file"]):
            assert resumed["losses"] == uninterrupted["losses"][RESUME_AT:]
            assert_close(resumed["params"], uninterrupted["params"], 0.0)
            assert resumed["warnings"] == []
        assert len(runs["trainer"]["resumed"]) == RESUME_STEPS - RESUME_AT
        assert runs["trainer"]["resumed"] == runs["trainer"]["uninterrupted"]


def test_checkpoints_cross_between_semi_synchronous_and_every_step_runs(two_by_one: list) -> None:
    """An every-step run loads a DiLoCo checkpoint (its outer state left out); a DiLoCo run loads an every-step one,
    starting its outer state afresh from the loaded params, and says so (rank 0)."""
    for rank in (0, 1):
        runs = two_by_one[rank]["resume"]
        assert len(runs["every_step_from_diloco"]["losses"]) == RESUME_STEPS - RESUME_AT
        assert runs["every_step_from_diloco"]["losses"][0] == runs["uninterrupted"]["losses"][RESUME_AT]
        assert runs["every_step_from_diloco"]["warnings"] == []
    warned = two_by_one[0]["resume"]["diloco_from_every_step"]["warnings"]
    assert len(warned) == 1 and "holds no outer state for replicate_sync='diloco'" in warned[0]
    assert two_by_one[1]["resume"]["diloco_from_every_step"]["warnings"] == []


def test_a_save_refuses_optimizer_state_some_replica_lacks_on_every_rank(two_by_one: list) -> None:
    for rank in (0, 1):
        message = two_by_one[rank]["state_one_replica_lacks"]
        assert "the replicas hold optimizer state for different params" in message, message
        assert "replicate_sync='every_step'" in message


def test_lora_with_activation_checkpointing_syncs_the_adapters_alone(two_by_one: list) -> None:
    first, second = two_by_one[0]["lora"], two_by_one[1]["lora"]
    assert first["synced"] and all(".lora_" in n for n in first["synced"])
    frozen = [n for n in first["before"] if ".lora_" not in n]
    assert all(torch.equal(first["after"][-1][n], first["before"][n]) for n in frozen)  # the base took no part
    adapters = [n for n in first["before"] if ".lora_B" in n]
    assert any(not torch.equal(first["after"][0][n], second["after"][0][n]) for n in adapters)  # apart mid-cycle
    assert all(torch.equal(first["after"][1][n], second["after"][1][n]) for n in first["before"])  # equal after


def test_untested_compositions_are_refused_with_the_fix() -> None:
    problems = semi_sync_problems("diloco", context_parallel=2, expert_parallel=2, offload=None)
    assert len(problems) == 2
    assert "float8='tensorwise' is untested" in semi_sync_problems("local_sgd", 1, 1, None, "tensorwise")[0]
    assert (
        "replicate_sync='diloco' with context_parallel_size=2 is untested; use replicate_sync='every_step'"
        in (problems[0])
    )
    assert "expert_parallel_size=2 is untested" in problems[1]


def test_a_replicate_sync_without_replicas_is_refused() -> None:
    from lightning_mixedfsdp.config import MixedFSDPConfig, MixedFSDPConfigError

    with pytest.raises(
        MixedFSDPConfigError,
        match=r"replicate_sync='local_sgd' syncs HSDP replicas \(or fault-tolerant replica groups\) every",
    ):
        MixedFSDPConfig.from_input(None, {"replicate_sync": "local_sgd"}, "MixedFSDP2Strategy")


def test_the_dry_run_prints_the_bytes_across_the_replicate_dim_and_the_outer_state(capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    main(["--dry-run", "trainer.devices=4", "strategy.parallelism.data_parallel_replicate_size=2",
          "strategy.parallelism.replicate_sync=diloco", "strategy.parallelism.sync_every=20"])  # fmt: skip
    out = capsys.readouterr().out
    every = re.search(r"  every step: ([\d.]+) KiB all-reduced", out)
    diloco = re.search(r"  diloco every 20 steps: ([\d.]+) KiB all-reduced .*; ([\d.]+)x less\); outer state", out)
    assert every and diloco and "(fp32 global copy and momentum, on the host)" in out
    # bf16 gradients every step against fp32 pseudo-gradients every 20 steps: a tenth of the bytes
    # (10.03: the replicated fp32 norms reduce in fp32 either way)
    assert float(diloco.group(2)) == 10.0 and abs(float(every.group(1)) / float(diloco.group(1)) - 10) < 0.05
