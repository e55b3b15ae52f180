"""Expert parallelism (``expert_parallel_size``) on HF MoE models built from tiny configs: Qwen3-MoE, DeepSeek-V3
(fp32 ``e_score_correction_bias`` buffer, kept by HF's strict list) and gpt-oss (a router with a bias). Each runs with
E=1 and E=2 at the same world size, same seed, same batches, under ``bf16-true`` with fp32 routers; the E=2 run must
give the E=1 run's grads, losses and params. Two launches: 2 ranks (E=2, experts not FSDP-sharded) and 4 ranks
(data-parallel 4 = expert_data_parallel 2 x expert_parallel 2; plus HSDP 2x2 with E=2, and activation checkpointing).
A checkpoint saved at E=2 loads at E=1 (DCP reshards the experts), and the export is one HF-loadable folder."""

from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch

from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.testing import run_distributed
from tests.hf_models import model_class, tiny_config, tiny_model
from tests.scenarios import (
    assert_same_state,
    full_grads,
    full_params,
    global_batch,
    make_fabric,
    rank_slice,
    snapshot,
    unwrap,
)

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

ARCHITECTURES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
ROUTERS = [r"mlp\.(gate|router)\.(weight|bias)$"]  # routers in fp32, as a user of these models asks
STEPS = 3
# bf16-true: expert outputs are combined in another order under EP (per-token sums after the all-to-all, instead of
# HF's per-expert accumulation), which moves bf16 roundings (2^-8 = 3.9e-3 relative each); everything else is the same
# computation. Measured (CPU): loss <= 1.7e-3 abs (4e-4 rel), grads <= 1.6e-2 of each tensor's max, params <= 2.9e-3.
# The grads are what catches a wrong divide factor (2x): AdamW steps hide a grad's scale from the params.
LOSS_TOL = dict(rtol=1e-3, atol=0)  # a quarter of a bf16 ulp of the loss
GRAD_TOL = dict(rtol=3e-2, atol=1e-7)  # relative to each grad's largest entry: a few bf16 roundings
PARAM_TOL = dict(rtol=0, atol=1e-2)  # 3 AdamW steps at lr 1e-3 move a param by <= 3e-3 each way, plus bf16 spacing


@contextmanager
def counting_all_to_alls() -> Iterator[Counter]:
    """All-to-alls issued through transformers' EP, forward (the calls) and backward (the ops the autograd
    all-to-all's backward dispatches)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_mixedfsdp.compat.transformers import all_to_all_module

    counts: Counter = Counter()
    module = all_to_all_module()
    originals = module.all_to_all_single, module.all_to_all_single_autograd

    def split_sizes(*args: Any, **kwargs: Any) -> Any:
        counts["backward" if counts["in_backward"] else "forward"] += 1
        return originals[0](*args, **kwargs)

    def tokens(*args: Any, **kwargs: Any) -> Any:
        if not counts["in_backward"]:  # a recompute in backward is counted by the dispatcher below
            counts["forward"] += 1
            counts["token_forward"] += 1
        return originals[1](*args, **kwargs)

    class Backward(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if counts["in_backward"] and "all_to_all" in str(func.overloadpacket):
                counts["backward"] += 1
            return func(*args, **(kwargs or {}))

    module.all_to_all_single, module.all_to_all_single_autograd = split_sizes, tokens
    try:
        with Backward():
            yield counts
    finally:
        module.all_to_all_single, module.all_to_all_single_autograd = originals


def _strategy(expert_parallel_size: int, **fields: Any) -> Any:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    return MixedFSDP2Strategy(expert_parallel_size=expert_parallel_size, keep_fp32_params=ROUTERS, **fields)


def _fp32_router_state(model: torch.nn.Module) -> Dict[str, torch.dtype]:
    inner = unwrap(model)
    tensors = [*inner.named_parameters(), *inner.named_buffers()]
    return {n: t.dtype for n, t in tensors if ".gate." in n or ".router." in n}


def _run(
    name: str, world: int, expert_parallel_size: int, save: Optional[Path] = None, replicate: int = 1, **fields: Any
) -> Dict[str, Any]:
    """Set up, one counted step with its grads, then AdamW steps; the figures the tests compare."""
    from torch.distributed.tensor import DTensor

    from lightning_mixedfsdp.model.names import canonical_name

    strategy = _strategy(expert_parallel_size, data_parallel_replicate_size=replicate, **fields)
    fabric = make_fabric(world, "bf16-true", strategy)
    model = fabric.setup(tiny_model(name))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    inner = unwrap(model)
    local_shapes = {
        n: tuple(p.to_local().shape) for n, p in inner.named_parameters() if ".experts." in n and isinstance(p, DTensor)
    }
    meshes = {n: p.device_mesh.mesh_dim_names for n, p in inner.named_parameters() if ".experts." in n}
    routers_after_setup = _fp32_router_state(model)
    losses, grads, counts, norms = [], {}, Counter(), []
    for step in range(STEPS):
        tokens = rank_slice(global_batch(world, step), fabric.global_rank, world)
        if step == 0:
            with counting_all_to_alls() as counts:
                loss = model(input_ids=tokens, labels=tokens).loss
                counts["in_backward"] = 1
                fabric.backward(loss)
                counts["in_backward"] = 0
            grads = {canonical_name(n): g for n, g in full_grads(model).items()}
        else:
            loss = model(input_ids=tokens, labels=tokens).loss
            fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    saved = {}
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer})
        saved = snapshot(model, optimizer)
    plan = fabric.strategy.plan_of(model)
    return {
        "losses": losses,
        "grad_norms": norms,
        "grads": grads,
        "saved": saved,
        "params": full_params(model),
        "local_shapes": local_shapes,
        "meshes": meshes,
        "routers_after_setup": routers_after_setup,
        "all_to_alls": dict(counts),
        "predicted": plan.experts.all_to_alls_per_step(fields.get("activation_checkpointing", "none") != "none")
        if plan.experts
        else None,
        "report": format_plan(plan) if fabric.global_rank == 0 else "",
    }


def _resume(name: str, world: int, path: Path, expert_parallel_size: int = 1) -> Dict[str, Any]:
    """A fresh run (E=1 by default) loads an E=2 checkpoint: params, optimizer state, routers' dtypes; then trains one
    step."""
    fabric = make_fabric(world, "bf16-true", _strategy(expert_parallel_size))
    model = fabric.setup(tiny_model(name, seed=1))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    fabric.load(path, {"model": model, "optimizer": optimizer})
    state = snapshot(model, optimizer)
    params = full_params(model)
    routers = _fp32_router_state(model)
    tokens = rank_slice(global_batch(world, STEPS), fabric.global_rank, world)
    fabric.backward(model(input_ids=tokens, labels=tokens).loss)
    optimizer.step()
    return {"params": params, "routers": routers, "optimizer_state": len(optimizer.state), "state": state}


def _export(name: str, world: int, directory: Path) -> Dict[str, Any]:
    """E=2 set-up exported; a meta E=2 model streams it back in (``load_full_weights``); rank 0 loads it with HF."""
    from lightning_mixedfsdp import load_full_weights

    fabric = make_fabric(world, "bf16-true", _strategy(2))
    model = fabric.setup(tiny_model(name))
    fabric.strategy.export_safetensors(model, directory)
    expected = full_params(model)
    fabric = make_fabric(world, "bf16-true", _strategy(2, init_meta_params=False))
    with fabric.init_module(empty_init=True):
        empty = tiny_model(name, seed=1)
    empty = fabric.setup(empty)
    load_full_weights(empty, directory)
    streamed = full_params(empty)
    if fabric.global_rank != 0:
        return {"streamed": streamed, "expected": expected}
    from safetensors.torch import load_file

    tiny_config(name).save_pretrained(directory)
    loaded = model_class(name).from_pretrained(directory, dtype=torch.bfloat16)
    files = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    return {
        "expected": expected,
        "streamed": streamed,
        "loaded": {n: p.detach().clone() for n, p in loaded.named_parameters()},
        "files": {k: (v.dtype, tuple(v.shape)) for k, v in files.items()},
    }


def _meta_init(world: int, expert_parallel_size: int) -> Dict[str, torch.Tensor]:
    """A model built on the meta device, initialised by the model setup (HF's own init on rank 0, streamed)."""
    fabric = make_fabric(world, "bf16-true", _strategy(expert_parallel_size))
    with fabric.init_module(empty_init=True):
        model = tiny_model("qwen3_moe")
    return full_params(fabric.setup(model))


def _trainer(world: int, expert_parallel_size: int) -> Dict[str, Any]:
    """``Trainer(strategy=MixedFSDP2Strategy(expert_parallel_size=...))`` fitting an HF MoE held by a
    LightningModule (the plan is found on the HF model inside)."""
    import lightning.pytorch as pl

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy
    from lightning_mixedfsdp.testing import accelerator_for

    class MoE(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model("qwen3_moe")
            self.losses: List[float] = []

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(
        accelerator=accelerator_for(world),
        devices=world,
        strategy=MixedFSDP2Strategy(expert_parallel_size=expert_parallel_size, keep_fp32_params=ROUTERS),
        precision="bf16-true",
        max_steps=STEPS,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = MoE()
    rows = torch.cat([global_batch(world, step) for step in range(STEPS)])  # two micro-batches per step and rank
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=len(rows) // (2 * STEPS * world)))
    return {"losses": module.losses, "params": full_params(module.model)}


def _self_sharded(world: int) -> str:
    """E=2 with a ``parallelize_fn`` that calls ``fully_shard`` itself: refused, not silently left without EP."""
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        return fully_shard(model, mesh=mesh["data_parallel"])

    fabric = make_fabric(world, "32-true", _strategy(2, parallelize_fn=parallelize))
    try:
        fabric.setup(tiny_model("qwen3_moe"))
    except ValueError as error:
        return str(error)
    return "no error"


def _two_ranks(rank: int, world: int, root: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {"meta": {e: _meta_init(world, e) for e in (1, 2)}, "self_sharded": _self_sharded(world)}
    out["trainer"] = {e: _trainer(world, e) for e in (1, 2)}
    for name in ARCHITECTURES:
        path = Path(root) / f"{name}.ckpt"
        out[name] = {1: _run(name, world, 1), 2: _run(name, world, 2, save=path)}
        out[name]["resumed"] = _resume(name, world, path)
    out["export"] = _export("gpt_oss", world, Path(root) / "export")
    return out


def _four_ranks(rank: int, world: int, root: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {name: {1: _run(name, world, 1), 2: _run(name, world, 2)} for name in ARCHITECTURES}
    # the 2-rank E=2 checkpoint (experts unsharded by FSDP) on 4 ranks, E=2 with the experts FSDP-sharded over 2
    out["resumed_on_four"] = _resume("qwen3_moe", world, Path(root) / "qwen3_moe.ckpt", expert_parallel_size=2)
    out["hsdp"] = _run("qwen3_moe", world, 2, replicate=2)
    out["checkpointed"] = _run("qwen3_moe", world, 2, activation_checkpointing="full")
    return out


@pytest.fixture(scope="module")
def two(folder: str) -> List[Dict[str, Any]]:
    return run_distributed(_two_ranks, 2, folder, timeout=300)


@pytest.fixture(scope="module")
def four(two: List[Dict[str, Any]], folder: str) -> List[Dict[str, Any]]:  # loads a checkpoint the 2-rank run saved
    return run_distributed(_four_ranks, 4, folder, timeout=300)


def _close(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], rtol: float, atol: float) -> str:
    """Each tensor within ``atol + rtol * max|expected|``; the largest abs and relative (to that max) diffs."""
    assert got.keys() == expected.keys()
    worst, worst_relative = 0.0, 0.0
    for key, value in expected.items():
        diff = (got[key].float() - value.float()).abs().max().item()
        scale = value.float().abs().max().item()
        assert diff <= atol + rtol * scale, (key, diff, scale)
        worst, worst_relative = max(worst, diff), max(worst_relative, diff / scale if scale else 0.0)
    return f"{worst:.2e} ({worst_relative:.1e} of the tensor's max)"


def _assert_matches_e1(results: List[Dict[str, Any]], key: Any, name: str = "", baseline: Any = None) -> None:
    for rank, result in enumerate(results):
        ep = result[key] if not name else result[name][key]
        e1 = result[baseline or name][1]
        torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(e1["losses"]), **LOSS_TOL)
        # the clipped norm spans the dense mesh and the (expert_data_parallel, expert_parallel) mesh
        torch.testing.assert_close(torch.tensor(ep["grad_norms"]), torch.tensor(e1["grad_norms"]), rtol=1e-2, atol=0)
        if rank == 0:
            loss_diff = max(abs(a - b) for a, b in zip(ep["losses"], e1["losses"], strict=True))
            print(f"{name or key}: max |loss diff| {loss_diff:.2e}", end=", ")
            print(f"max |grad diff| {_close(ep['grads'], e1['grads'], **GRAD_TOL)}", end=", ")
            print(f"max |param diff| {_close(ep['params'], e1['params'], **PARAM_TOL)}")
        else:
            _close(ep["grads"], e1["grads"], **GRAD_TOL)
            _close(ep["params"], e1["params"], **PARAM_TOL)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_two_ranks_e2_gives_the_e1_grads_losses_and_params(two: List[Dict[str, Any]], name: str) -> None:
    _assert_matches_e1(two, 2, name)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_four_ranks_dp2_x_e2_gives_the_e1_grads_losses_and_params(four: List[Dict[str, Any]], name: str) -> None:
    _assert_matches_e1(four, 2, name)


def test_hsdp_and_activation_checkpointing_with_e2_give_the_e1_run(four: List[Dict[str, Any]]) -> None:
    _assert_matches_e1(four, "hsdp", baseline="qwen3_moe")
    _assert_matches_e1(four, "checkpointed", baseline="qwen3_moe")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_rank_holds_only_its_experts(two: List[Dict[str, Any]], four: List[Dict[str, Any]], name: str) -> None:
    full = {n: tuple(p.shape) for n, p in two[0][name][1]["params"].items() if ".experts." in n}
    assert full
    for results, shard in ((two, 1), (four, 2)):
        for result in results:
            e2 = result[name][2]
            assert set(e2["local_shapes"]) == set(full)
            for param, shape in full.items():
                experts_here = shape[0] // 2
                # dim 0: this rank's experts (E=2), then FSDP-sharded over the ranks holding the same experts
                assert e2["local_shapes"][param] == (-(-experts_here // shard), *shape[1:]), param
                assert e2["meshes"][param] == ("expert_data_parallel", "expert_parallel")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_routers_stay_fp32_after_setup_and_after_an_e2_to_e1_resume(two: List[Dict[str, Any]], name: str) -> None:
    for result in two:
        for run in (result[name][1]["routers_after_setup"], result[name][2]["routers_after_setup"]):
            assert run and set(run.values()) == {torch.float32}, run
        assert result[name]["resumed"]["routers"] == result[name][2]["routers_after_setup"]
    if name == "deepseek_v3":
        assert any(n.endswith("e_score_correction_bias") for n in two[0][name][2]["routers_after_setup"])
    if name == "gpt_oss":
        assert any(n.endswith("router.bias") for n in two[0][name][2]["routers_after_setup"])


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_checkpoint_saved_at_e2_loads_at_e1(two: List[Dict[str, Any]], name: str) -> None:
    for result in two:
        saved, resumed = result[name][2]["params"], result[name]["resumed"]["params"]
        assert saved.keys() == resumed.keys()
        for key, value in saved.items():
            assert resumed[key].dtype == value.dtype and torch.equal(resumed[key], value), key
        assert result[name]["resumed"]["optimizer_state"] == len(saved)
        # params, buffers and AdamW state (exp_avg, exp_avg_sq, step) bit for bit, experts gathered
        assert_same_state(result[name]["resumed"]["state"], result[name][2]["saved"])


def test_a_checkpoint_saved_on_two_ranks_loads_on_four_with_the_experts_fsdp_sharded(
    two: List[Dict[str, Any]], four: List[Dict[str, Any]]
) -> None:
    saved = two[0]["qwen3_moe"][2]["saved"]
    assert_same_state(four[0]["resumed_on_four"]["state"], saved)  # rank 0 gathers the optimizer state too
    for result in four[1:]:
        assert_same_state(result["resumed_on_four"]["state"], {k: v for k, v in saved.items() if "optim/" not in k})


def test_all_to_alls_per_step_are_the_plans(two: List[Dict[str, Any]], four: List[Dict[str, Any]]) -> None:
    for results in (two, four):
        for name in ARCHITECTURES:
            assert results[0][name][1]["all_to_alls"] == {"in_backward": 0}  # E=1: none
            counted, predicted = results[0][name][2]["all_to_alls"], results[0][name][2]["predicted"]
            assert {k: counted[k] for k in predicted} == predicted, name
    checkpointed = four[0]["checkpointed"]
    assert checkpointed["all_to_alls"]["backward"] == checkpointed["predicted"]["backward"]
    assert checkpointed["predicted"]["backward"] > four[0]["qwen3_moe"][2]["predicted"]["backward"]


def test_report_shows_the_expert_mesh_bytes_and_all_to_alls(two: List[Dict[str, Any]]) -> None:
    report = two[0]["qwen3_moe"][2]["report"]
    assert "expert parallel: expert_parallel=2" in report
    assert "experts per layer 4 -> 2 per rank" in report
    assert "all-to-all per step (predicted): forward 6" in report
    assert "expert-parallel" in report


def test_a_parallelize_fn_that_shards_itself_is_refused_with_the_fix(two: List[Dict[str, Any]]) -> None:
    for result in two:
        assert result["self_sharded"].startswith(
            "mixed_fsdp2: expert_parallel_size=2 is applied by the dtype plan, but `parallelize_fn` sharded the model"
        ), result["self_sharded"]
        assert "Remove `fully_shard` from it" in result["self_sharded"]


def test_a_meta_model_initialises_to_the_e1_values(two: List[Dict[str, Any]]) -> None:
    for result in two:
        e1, e2 = result["meta"][1], result["meta"][2]
        assert e1.keys() == e2.keys()
        for key, value in e1.items():
            assert torch.equal(e2[key], value), key


def test_trainer_with_e2_gives_the_e1_losses_and_params(two: List[Dict[str, Any]]) -> None:
    for result in two:
        e1, e2 = result["trainer"][1], result["trainer"][2]
        assert len(e2["losses"]) == 2 * STEPS
        torch.testing.assert_close(torch.tensor(e2["losses"]), torch.tensor(e1["losses"]), **LOSS_TOL)
        _close(e2["params"], e1["params"], **PARAM_TOL)


def test_export_gathers_the_experts_into_one_hf_loadable_folder_that_streams_back_into_e2(
    two: List[Dict[str, Any]],
) -> None:
    export = two[0]["export"]
    assert export["loaded"].keys() == export["expected"].keys() == export["files"].keys()
    for key, value in export["expected"].items():
        # whole experts, routers in fp32 on disk; HF loads it (here in bf16)
        assert export["files"][key] == (value.dtype, tuple(value.shape)), key
        assert torch.equal(export["loaded"][key], value.to(torch.bfloat16)), key
    assert export["files"]["model.layers.0.mlp.router.weight"][0] == torch.float32
    assert export["files"]["model.layers.0.mlp.experts.gate_up_proj"][1][0] == 4
    for result in two:  # streamed back into E=2 shards, every rank
        assert result["export"]["streamed"].keys() == result["export"]["expected"].keys()
        for key, value in result["export"]["expected"].items():
            assert torch.equal(result["export"]["streamed"][key], value), key
