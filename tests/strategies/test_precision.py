"""Frozen modules, the leak check, meta init, rank-0-only loads and an HF model on 2 ranks."""

import warnings
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from tests.conftest import Launch
from tests.scenarios import (
    A_LOG,
    MIXER,
    TOWER_UNITS,
    TowerModel,
    describe_params,
    full_params,
    global_batch,
    make_fabric,
    rank_slice,
    train_hf_steps,
    unwrap,
)

WORLD = 2
META_SEED = 123


def _tower_run(world_size: int, pin: bool) -> Dict[str, Any]:
    from lightning_mixedfsdp.diagnostics.leaks import DtypeLeakWarning
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(wrap_units=TOWER_UNITS, pin_frozen_modules=pin, check_dtype_leaks=True)
    fabric = make_fabric(world_size, "bf16-mixed", strategy)
    torch.manual_seed(0)
    model = fabric.setup(TowerModel())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    seen: Dict[str, Any] = {}

    def record_tower_output(_module: Any, _args: Any, output: torch.Tensor) -> None:
        seen.setdefault("tower_output", output.dtype)

    unwrap(model).tower.register_forward_hook(record_tower_output)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.backward(model(torch.randn(4, 16)).float().pow(2).mean())
    optimizer.step()
    buffers = {n: b.dtype for n, b in unwrap(model).named_buffers()}
    leak_messages = [str(w.message) for w in caught if issubclass(w.category, DtypeLeakWarning)]
    return {"params": describe_params(model), "buffers": buffers, "leaks": leak_messages, **seen}


def _meta_init(world_size: int) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=A_LOG))
    with fabric.init_module(empty_init=True):
        model = TinyLlama(MIXER)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(META_SEED)
    model = fabric.setup(model)
    values = full_params(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = rank_slice(global_batch(world_size, 0), fabric.global_rank, world_size)
    fabric.backward(causal_lm_loss(model(tokens), tokens))
    optimizer.step()
    return {"values": values, "params": describe_params(model)}


def _rank0_load(world_size: int, checkpoint: str) -> Dict[str, Any]:
    import safetensors.torch

    from lightning_mixedfsdp.checkpoint.load import load_full_weights
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(wrap_units=TOWER_UNITS, init_meta_params=False))
    with fabric.init_module(empty_init=True):
        model = TowerModel()
    model = fabric.setup(model)
    if fabric.global_rank != 0:

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"rank {fabric.global_rank} opened a checkpoint: {args[:1]}")

        torch.load = refuse
        safetensors.torch.load_file = refuse
    load_full_weights(model, checkpoint)
    buffers = {n: (b.dtype, b.detach().clone()) for n, b in unwrap(model).named_buffers()}
    return {"values": full_params(model), "params": describe_params(model), "buffers": buffers}


def _hf_gpt_oss(world_size: int, export_dir: str) -> Dict[str, Any]:
    from transformers import GptOssForCausalLM

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(keep_fp32_modules=[]))
    torch.manual_seed(0)
    model = fabric.setup(GptOssForCausalLM(tiny_gpt_oss_config()))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = train_hf_steps(fabric, model, optimizer, steps=6, batches=2)
    plan = fabric.strategy.plan_of(model)
    fabric.strategy.export_safetensors(model, export_dir, dtype=torch.bfloat16)
    return {
        "losses": losses,
        "params": describe_params(model),
        "rules": {n: None if p.rule is None else str(p.rule) for n, p in plan.params.items()},
        "values": full_params(model),
    }


def tiny_gpt_oss_config() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )


def _scenarios(rank: int, world_size: int, checkpoint: str, export_dir: str) -> Dict[str, Any]:
    return {
        "pinned": _tower_run(world_size, pin=True),
        "unpinned": _tower_run(world_size, pin=False),
        "meta": _meta_init(world_size),
        "rank0_load": _rank0_load(world_size, checkpoint),
        "hf": _hf_gpt_oss(world_size, export_dir),
    }


@pytest.fixture(scope="module")
def tower_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full checkpoint with fp32 params and buffers, as a user would ship it."""
    from safetensors.torch import save_file

    torch.manual_seed(5)
    model = TowerModel()
    with torch.no_grad():
        model.tower.normalizer.std_bias.add_(0.25)
    path = tmp_path_factory.mktemp("weights") / "tower.safetensors"
    save_file(model.state_dict(), str(path))
    return path


@pytest.fixture(scope="module")
def hf_export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_export")


LAUNCH = Launch(_scenarios, WORLD, timeout=180, with_folder=False, fixtures=("tower_checkpoint", "hf_export_dir"))


def test_frozen_tower_is_pinned_to_bf16_except_keep_fp32_modules_and_the_projector_gets_bf16(results: list) -> None:
    out = results[0]["pinned"]
    params, buffers = out["params"], out["buffers"]
    assert params["tower.embed.weight"]["dtype"] == torch.bfloat16
    assert params["tower.norm.weight"]["dtype"] == torch.float32  # LayerNorm: keep-fp32 even when frozen
    assert params["projector.proj.weight"]["dtype"] == torch.float32  # trainable bulk: fp32 master weights
    assert buffers == {"tower.normalizer.std_bias": torch.bfloat16, "tower.normalizer.std_scale": torch.bfloat16}
    assert out["tower_output"] == torch.bfloat16
    assert out["leaks"] == []


def test_leak_check_names_the_leaking_modules_when_frozen_pinning_is_off(results: list) -> None:
    out = results[0]["unpinned"]
    assert out["buffers"]["tower.normalizer.std_bias"] == torch.float32
    assert out["tower_output"] == torch.float32
    assert len(out["leaks"]) == 1
    message = out["leaks"][0]
    assert "2 module(s) return floating outputs that are not bfloat16" in message
    assert "tower.normalizer (Normalizer): float32" in message and "tower (FrozenTower): float32" in message


def test_meta_init_on_two_ranks_equals_a_single_process_init(results: list) -> None:
    from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
    from lightning_mixedfsdp.apply.applier import apply_dtypes
    from lightning_mixedfsdp.materialize.meta import init_meta_module_
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama

    # `init_module()` under bf16-true builds in bf16, as Lightning's own does; keep-fp32 params are initialised in
    # fp32 (the rule in docs/dtypes.md), the rest in the dtype they were built in
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            reference = TinyLlama(MIXER)
    finally:
        torch.set_default_dtype(default)
    apply_dtypes(reference, plan_sharding(reference, MixedFSDPConfig(keep_fp32_params=A_LOG), "bf16-true"))
    torch.manual_seed(META_SEED)
    init_meta_module_(reference)
    for result in results:
        for name, expected in reference.state_dict().items():
            got = result["meta"]["values"][name]
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
    # sharded params really differ across shards (no rank-duplicated values)
    weight = results[0]["meta"]["values"]["layers.0.feed_forward.w1.weight"]
    assert not torch.equal(weight[: weight.shape[0] // 2], weight[weight.shape[0] // 2 :])


def test_rank0_only_load_gives_every_rank_the_checkpoint_values_in_the_planned_dtypes(
    results: list, tower_checkpoint: Path
) -> None:
    from safetensors.torch import load_file

    checkpoint = load_file(str(tower_checkpoint))
    for result in results:
        out = result["rank0_load"]
        for name, value in out["values"].items():
            planned = out["params"][name]["dtype"]
            assert value.dtype == planned
            assert torch.equal(value, checkpoint[name].to(planned)), name
        assert out["params"]["tower.norm.weight"]["dtype"] == torch.float32
        assert out["params"]["projector.proj.weight"]["dtype"] == torch.bfloat16
        for name, (dtype, value) in out["buffers"].items():
            assert torch.equal(value, checkpoint[name].to(dtype)), name


def test_hf_gpt_oss_keep_in_fp32_modules_are_honoured_under_bf16_and_it_trains(results: list) -> None:
    out = results[0]["hf"]
    norms = [n for n in out["params"] if n.endswith("layernorm.weight") or n == "model.norm.weight"]
    assert len(norms) == 5
    for name, info in out["params"].items():
        expected = torch.float32 if name in norms else torch.bfloat16
        assert info["dtype"] == expected, name
    assert out["rules"]["model.norm.weight"] == "hf:_keep_in_fp32_modules[norm]"
    assert out["losses"][-1] < out["losses"][0]


def test_hf_export_loads_with_from_pretrained_without_losing_a_bit(results: list, hf_export_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import GptOssForCausalLM

    exported = load_file(str(hf_export_dir / "model.safetensors"))
    assert exported["model.norm.weight"].dtype == torch.float32
    assert exported["model.embed_tokens.weight"].dtype == torch.bfloat16
    # transformers itself would load the fp32 norms as bf16 under dtype="auto" (it keeps _keep_in_fp32_modules
    # fp32 only for fp16): load in fp32, which represents both file dtypes exactly
    loaded = GptOssForCausalLM.from_pretrained(str(hf_export_dir), dtype=torch.float32).state_dict()
    trained = results[0]["hf"]["values"]
    for name, value in trained.items():
        assert torch.equal(loaded[name], exported[name].float()), name
        assert torch.equal(exported[name], value.to(exported[name].dtype)), name
