"""Checkpoints keep every dtype and bit: sharded and full, across world sizes, exact resume, atomic, export."""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.testing import run_distributed
from tests.kill_during_save import kill_during_save
from tests.scenarios import (
    A_LOG,
    MIXER,
    BufferedLlama,
    assert_same_state,
    full_params,
    global_batch,
    make_fabric,
    rank_slice,
    snapshot,
)

MODES = {"sharded": True, "full": False}
SAVE_AT, STEPS = 3, 6


def _setup(world_size: int, distributed_checkpoint: bool, seed: int = 0) -> Any:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(keep_fp32_params=A_LOG, save_distributed_checkpoint=distributed_checkpoint)
    fabric = make_fabric(world_size, "bf16-true", strategy)
    torch.manual_seed(seed)
    model = fabric.setup(BufferedLlama(MIXER))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def _step(fabric: Any, model: Any, optimizer: Any, step: int) -> float:
    import torch.distributed as dist

    from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss

    data_parallel = fabric.strategy.meshes.data_parallel
    # the same global batch of 2 ranks' worth, split over however many ranks this run has
    tokens = rank_slice(global_batch(2, step), data_parallel.get_local_rank(), data_parallel.size())
    loss = causal_lm_loss(model(tokens), tokens)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def _train_save_resume_export(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for mode, distributed in MODES.items():
        path = Path(folder) / f"{mode}-2ranks"
        fabric, model, optimizer = _setup(world_size, distributed)
        losses = [_step(fabric, model, optimizer, s) for s in range(SAVE_AT)]
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVE_AT})
        saved = snapshot(model, optimizer)
        losses += [_step(fabric, model, optimizer, s) for s in range(SAVE_AT, STEPS)]

        fabric, model, optimizer = _setup(world_size, distributed, seed=99)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        loaded = snapshot(model, optimizer)
        resumed = [_step(fabric, model, optimizer, s) for s in range(state["step"], STEPS)]
        out[mode] = {"saved": saved, "loaded": loaded, "losses": losses, "resumed": resumed, "is_dir": path.is_dir()}
        if mode == "sharded":
            fabric.strategy.export_safetensors(model, Path(folder) / "export", dtype=torch.bfloat16)
            fabric.strategy.export_safetensors(
                model,
                Path(folder) / "export-sharded",
                dtype=torch.bfloat16,
                max_shard_bytes=20_000,
            )
            out["exported_from"] = full_params(model)
    return out


def _load_then_save(rank: int, world_size: int, folder: str, source: str, target: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for mode, distributed in MODES.items():
        fabric, model, optimizer = _setup(world_size, distributed, seed=7)
        fabric.load(Path(folder) / f"{mode}-{source}", {"model": model, "optimizer": optimizer})
        out[mode] = snapshot(model, optimizer)
        if target:
            fabric.save(Path(folder) / f"{mode}-{target}", {"model": model, "optimizer": optimizer})
    return out


@pytest.fixture(scope="module")
def two_ranks(folder: Path) -> list:
    return run_distributed(_train_save_resume_export, 2, str(folder))


@pytest.fixture(scope="module")
def one_rank(two_ranks: list, folder: Path) -> list:
    return run_distributed(_load_then_save, 1, str(folder), "2ranks", "1rank")


@pytest.fixture(scope="module")
def two_from_one(one_rank: list, folder: Path) -> list:
    return run_distributed(_load_then_save, 2, str(folder), "1rank", "")


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_on_two_ranks_keeps_every_dtype_and_bit(two_ranks: list, mode: str) -> None:
    result = two_ranks[0][mode]
    assert result["is_dir"] == MODES[mode]
    saved = result["saved"]
    assert saved["param/layers.0.attention.A_log"].dtype == torch.float32
    assert saved["param/layers.0.attention_norm.weight"].dtype == torch.float32
    assert saved["param/output.weight"].dtype == torch.bfloat16
    assert saved["optim/layers.0.attention.A_log/exp_avg"].dtype == torch.float32
    assert saved["optim/output.weight/exp_avg_sq"].dtype == torch.bfloat16
    assert saved["buffer/logit_scale"].dtype == torch.float32  # a buffer keeps the dtype it was built in
    for rank_result in two_ranks:
        loaded = rank_result[mode]["loaded"]
        params_and_buffers = {k: v for k, v in rank_result[mode]["saved"].items() if not k.startswith("optim/")}
        assert_same_state({k: v for k, v in loaded.items() if not k.startswith("optim/")}, params_and_buffers)
    assert_same_state(result["loaded"], saved)


@pytest.mark.parametrize("mode", MODES)
def test_resume_reproduces_the_uninterrupted_losses_bit_exactly(two_ranks: list, mode: str) -> None:
    result = two_ranks[0][mode]
    assert result["resumed"] == result["losses"][SAVE_AT:]


@pytest.mark.parametrize("mode", MODES)
def test_two_rank_checkpoints_load_on_one_rank(two_ranks: list, one_rank: list, mode: str) -> None:
    assert_same_state(one_rank[0][mode], two_ranks[0][mode]["saved"])


@pytest.mark.parametrize("mode", MODES)
def test_one_rank_checkpoints_load_on_two_ranks(two_ranks: list, two_from_one: list, mode: str) -> None:
    assert_same_state(two_from_one[0][mode], two_ranks[0][mode]["saved"])


def test_export_keeps_the_plans_fp32_params_fp32_and_the_rest_in_the_save_dtype(two_ranks: list, folder: Path) -> None:
    from lightning_mixedfsdp.checkpoint.load import load_weights

    exported = load_file(str(folder / "export" / "model.safetensors"))
    params = two_ranks[0]["exported_from"]
    assert set(params) <= set(exported)
    for name, value in params.items():
        pinned = name.endswith("A_log") or "norm" in name
        assert exported[name].dtype == (torch.float32 if pinned else torch.bfloat16), name
        assert torch.equal(exported[name], value.to(exported[name].dtype)), name
    assert exported["logit_scale"].dtype == torch.float32  # planned fp32, exported fp32

    from lightning_mixedfsdp import MixedFSDPConfig

    reloaded = load_weights(
        BufferedLlama(MIXER), folder / "export", torch.bfloat16, MixedFSDPConfig(keep_fp32_params=A_LOG)
    )
    for name, value in reloaded.state_dict().items():
        assert value.dtype == exported[name].dtype and torch.equal(value, exported[name]), name


def test_export_with_a_shard_limit_writes_an_index_and_keeps_the_plans_fp32_set(two_ranks: list, folder: Path) -> None:
    import json

    from lightning_mixedfsdp.checkpoint.load import read_state_dict

    directory = folder / "export-sharded"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((directory / f).is_file() for f in files)
    state = read_state_dict(directory)
    assert set(state) == set(index["weight_map"])
    assert state["layers.0.attention.A_log"].dtype == torch.float32
    assert state["layers.0.attention_norm.weight"].dtype == torch.float32  # the plan's keep-fp32 set
    assert state["layers.0.feed_forward.w1.weight"].dtype == torch.bfloat16
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.parametrize("mode", MODES)
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path, mode: str) -> None:
    # a rank of its own, killed by SIGKILL midway through its second save
    with pytest.raises(AssertionError, match=r"died with exit codes \[-9\]"):
        run_distributed(kill_during_save, 1, str(tmp_path), mode, "save", timeout=180)
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers, "the second save was killed before it wrote anything"
    # the previous checkpoint loads, equal to the first save's weights
    assert run_distributed(kill_during_save, 1, str(tmp_path), mode, "load", timeout=180) == [True]


def test_a_sharded_checkpoint_holds_the_plans_layout_whichever_groups_torch_allows(
    two_ranks: list, folder: Path
) -> None:
    """Every model tensor of a real DCP checkpoint has the global shape and dtype the plan gives it, and the plan for
    a torch that groups mixed dtypes natively gives the same: gaining the feature changes no checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_mixedfsdp import MixedFSDPConfig
    from lightning_mixedfsdp.planning.options import PlanOptions
    from lightning_mixedfsdp.planning.planner import plan_model

    config = MixedFSDPConfig(keep_fp32_params=A_LOG)
    bulk, options = config.bulk_dtypes("bf16-true"), PlanOptions.of(config)
    layouts = [
        plan_model(BufferedLlama(MIXER), bulk, options, mixed_dtype_groups=native).checkpoint_layout
        for native in (False, True)
    ]
    metadata = FileSystemReader(str(folder / "sharded-2ranks")).read_metadata().state_dict_metadata
    saved = {
        key[len("model.") :]: (tuple(entry.size), entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith("model.")
    }
    assert saved == layouts[0] == layouts[1]
    assert saved["layers.0.attention.A_log"][1] == torch.float32 and saved["output.weight"][1] == torch.bfloat16
