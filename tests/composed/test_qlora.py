"""QLoRA on 2 ranks: peft LoRA adapters on a 4-bit (torchao NF4) frozen base of HF Llama and Qwen3-MoE built from
config, under bf16-true and bf16-mixed, against the same LoRA on the bf16 base; CPU offload; meta init and a
pretrained load that quantize each rank's rows; a DCP round trip; the merged export."""

from functools import partial
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from lightning_mixedfsdp.testing import run_distributed
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import clipped_hf_steps, global_batch, make_fabric, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

pytest.importorskip("torchao", reason="QLoRA needs torchao (pip install 'lightning-mixedfsdp[qlora]')")

WORLD = 2
STEPS = 4
VOCAB = 128
# dims whose weights fill whole NF4 double-quantization blocks (16,384 weights) per shard on 2 ranks
QLORA_DIMS = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=VOCAB,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_TOLERANCE = 0.05
"""Largest loss difference between LoRA on the 4-bit base and on the bf16 base, over the first steps (measured:
about 0.02 on these models)."""


def base_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    dims = {k: v for k, v in QLORA_DIMS.items() if model_type == "qwen3_moe" or k != "moe_intermediate_size"}
    return tiny_model(model_type, seed=seed, **dims)


def qlora_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base_model(model_type, seed), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


def _strategy(**fields: Any) -> Any:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    return MixedFSDP2Strategy(**fields)


_train = partial(clipped_hf_steps, world=WORLD, vocab=VOCAB)


def _layout(model: torch.nn.Module) -> Dict[str, Any]:
    """Per param: the local tensor's class, nominal dtype and requires_grad, by canonical name."""
    from lightning_mixedfsdp.model.names import canonical_name
    from lightning_mixedfsdp.model.tensors import local_tensor

    return {
        canonical_name(name): (type(local_tensor(p)).__name__, p.dtype, p.requires_grad)
        for name, p in unwrap(model).named_parameters()
    }


def _base_shards(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's 4-bit base shards, dequantized."""
    from lightning_mixedfsdp.model.names import canonical_name
    from lightning_mixedfsdp.model.quantized import dequantized
    from lightning_mixedfsdp.model.tensors import local_tensor

    return {
        canonical_name(name): dequantized(local_tensor(p)).clone()
        for name, p in unwrap(model).named_parameters()
        if type(local_tensor(p)).__name__ == "NF4Tensor"
    }


def _quantized_chunks(model: torch.nn.Module, names: set, rank: int) -> Dict[str, torch.Tensor]:
    """torchao's quantization of each whole weight (gathered), this rank's chunk, dequantized."""
    from torchao.quantization import to_nf4

    from lightning_mixedfsdp.model.names import canonical_name

    chunks = {}
    for name, param in unwrap(model).named_parameters():
        if canonical_name(name) in names:
            chunks[canonical_name(name)] = torch.chunk(to_nf4(param.full_tensor()), WORLD)[rank].get_original_weight()
    return chunks


def _offloaded(model: torch.nn.Module) -> List[bool]:
    from lightning_mixedfsdp.compat.torch import fsdp_param_groups

    return [type(group.offload_policy).__name__ == "CPUOffloadPolicy" for group in fsdp_param_groups(unwrap(model))]


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for model_type in ("llama", "qwen3_moe"):
        for flag in ("bf16-true", "bf16-mixed"):
            bf16 = make_fabric(WORLD, flag, _strategy())
            bf16_run = _train(bf16, bf16.setup(qlora_model(model_type)), rank, range(STEPS))
            fabric = make_fabric(WORLD, flag, _strategy(quantize_base="nf4"))
            model = fabric.setup(qlora_model(model_type))
            layout = _layout(model)
            run = _train(fabric, model, rank, range(STEPS))
            out[model_type, flag] = {"bf16": bf16_run["losses"], "nf4": run["losses"], "layout": layout}
    # the remaining scenarios on Llama under bf16-true
    flag, folder_path = "bf16-true", Path(folder)
    fabric = make_fabric(WORLD, flag, _strategy(quantize_base="nf4"))
    reference = fabric.setup(qlora_model("llama"))
    out["shards"] = _base_shards(reference)
    first = _train(fabric, reference, rank, range(2))
    fabric.save(folder_path / "ckpt", {"model": reference, "optimizer": first["optimizer"]})
    rest = _train(fabric, reference, rank, range(2, STEPS), first["optimizer"])
    out["uninterrupted"] = first["losses"] + rest["losses"]
    tokens = global_batch(WORLD, 0, vocab=VOCAB)
    with torch.no_grad():
        out["trained_logits"] = reference(input_ids=tokens).logits.float()
    fabric.strategy.export_safetensors(reference, folder_path / "merged", dtype=torch.bfloat16)
    out["checkpoint_keys"] = sorted(fabric.strategy.plan_of(reference).checkpoint_layout)

    resumed = fabric.setup(qlora_model("llama"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad]))
    fabric.load(folder_path / "ckpt", {"model": resumed, "optimizer": optimizer})
    out["resumed"] = _train(fabric, resumed, rank, range(2, STEPS), optimizer)["losses"]

    checkpointed = make_fabric(WORLD, flag, _strategy(quantize_base="nf4", activation_checkpointing="full"))
    out["checkpointed"] = _train(checkpointed, checkpointed.setup(qlora_model("llama")), rank, range(STEPS))["losses"]

    offload = make_fabric(WORLD, flag, _strategy(quantize_base="nf4", offload="cpu"))
    offloaded = offload.setup(qlora_model("llama"))
    out["offload_policies"] = _offloaded(offloaded)
    offload_run = _train(offload, offloaded, rank, range(2))
    offload.save(folder_path / "offload_ckpt", {"model": offloaded, "optimizer": offload_run["optimizer"]})
    offload_run["losses"] += _train(offload, offloaded, rank, range(2, STEPS), offload_run["optimizer"])["losses"]
    out["offload"] = offload_run["losses"]
    resumed_offload = offload.setup(qlora_model("llama"))
    trainable = [p for p in resumed_offload.parameters() if p.requires_grad]
    resumed_optimizer = offload.setup_optimizers(torch.optim.AdamW(trainable, lr=1e-3))
    offload.load(folder_path / "offload_ckpt", {"model": resumed_offload, "optimizer": resumed_optimizer})
    out["offload_resumed"] = _train(offload, resumed_offload, rank, range(2, STEPS), resumed_optimizer)["losses"]
    out["offload_devices"] = {p.device.type for p in offloaded.parameters()} | {
        s.device.type for state in offload_run["optimizer"].state.values() for s in state.values() if torch.is_tensor(s)
    }

    with fabric.init_module(empty_init=True):
        on_meta = qlora_model("llama")
    out["meta_shards"] = _base_shards(fabric.setup(on_meta))
    plain = make_fabric(WORLD, flag, _strategy())
    with plain.init_module(empty_init=True):
        bf16_on_meta = qlora_model("llama")
    out["meta_expected"] = _quantized_chunks(plain.setup(bf16_on_meta), set(out["meta_shards"]), rank)

    if rank == 0:
        base = base_model("llama").to(torch.bfloat16)
        base.save_pretrained(str(folder_path / "pretrained"))
    fabric.barrier()
    from lightning_mixedfsdp import load_full_weights

    with fabric.init_module(empty_init=True):
        to_load = qlora_model("llama")
    loaded = fabric.setup(to_load)
    load_full_weights(loaded, folder_path / "pretrained")
    out["loaded_shards"] = _base_shards(loaded)
    out["fingerprint"] = _resume_onto_another_base(fabric, rank, folder_path)
    return out


def _resume_onto_another_base(fabric: Any, rank: int, folder: Path) -> Dict[str, Any]:
    """A QLoRA run on a pretrained base (not the config's init), checkpointed; resumed onto the config's base (the
    checkpoint leaves the 4-bit base out: its fingerprint refuses it), with strict=False (a warning), and onto the
    pretrained base again (the uninterrupted losses)."""
    import warnings

    from lightning_mixedfsdp import load_full_weights

    if rank == 0:
        base_model("llama", seed=1).to(torch.bfloat16).save_pretrained(str(folder / "pretrained_other"))
    fabric.barrier()

    def on_pretrained() -> torch.nn.Module:
        model = fabric.setup(qlora_model("llama"))
        load_full_weights(model, folder / "pretrained_other")
        return model

    trained = on_pretrained()
    first = _train(fabric, trained, rank, range(2))
    fabric.save(folder / "ckpt_other", {"model": trained, "optimizer": first["optimizer"]})
    uninterrupted = _train(fabric, trained, rank, range(2, STEPS), first["optimizer"])["losses"]

    def resume(model: torch.nn.Module, strict: bool = True) -> Any:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(trainable, lr=1e-3))
        fabric.load(folder / "ckpt_other", {"model": model, "optimizer": optimizer}, strict=strict)
        return optimizer

    out: Dict[str, Any] = {"uninterrupted": uninterrupted}
    try:
        resume(fabric.setup(qlora_model("llama")))
        out["wrong_base"] = None
    except ValueError as error:
        out["wrong_base"] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume(fabric.setup(qlora_model("llama")), strict=False)
    out["not_strict"] = [str(w.message) for w in caught if "frozen base" in str(w.message)]
    right = on_pretrained()
    out["resumed"] = _train(fabric, right, rank, range(2, STEPS), resume(right))["losses"]
    return out


LAUNCH = Launch(_scenarios, WORLD, timeout=600)


def test_a_resume_onto_another_frozen_base_is_refused_and_onto_the_right_one_repeats_the_losses(
    results: list,
) -> None:
    for result in results:
        outcome = result["fingerprint"]
        assert outcome["wrong_base"] is not None, "the config's base was accepted"
        assert "frozen base is not the one the checkpoint" in outcome["wrong_base"]
        assert "load_full_weights" in outcome["wrong_base"] and "frozen tensors differ" in outcome["wrong_base"]
        assert outcome["not_strict"], "strict=False did not warn"
        assert outcome["resumed"] == outcome["uninterrupted"]


def _expected_kind(name: str, model_type: str) -> str:
    if "lora_" in name:
        return "adapter"
    if "norm" in name:
        return "norm"
    linear = any(f".{target}.base_layer.weight" in name for target in TARGETS)
    return "nf4" if linear else "frozen"


CASES = [(m, f) for m in ("llama", "qwen3_moe") for f in ("bf16-true", "bf16-mixed")]


@pytest.mark.parametrize(("model_type", "flag"), CASES)
def test_base_is_4_bit_and_frozen_norms_fp32_adapters_in_their_storage_dtype(
    results: list, model_type: str, flag: str
) -> None:
    adapter_dtype = torch.float32 if flag == "bf16-mixed" else torch.bfloat16
    expected = {
        "nf4": ("NF4Tensor", torch.bfloat16, False),
        "norm": ("Tensor", torch.float32, False),
        "adapter": ("Tensor", adapter_dtype, True),
        "frozen": ("Tensor", torch.bfloat16, False),  # embeddings, the head, Qwen3-MoE's experts and router
    }
    for result in results:
        layout = result[model_type, flag]["layout"]
        kinds = {_expected_kind(name, model_type) for name in layout}
        assert kinds == set(expected), kinds
        for name, found in layout.items():
            assert found == expected[_expected_kind(name, model_type)], (name, found)


@pytest.mark.parametrize(("model_type", "flag"), CASES)
def test_losses_stay_within_tolerance_of_lora_on_the_bf16_base(results: list, model_type: str, flag: str) -> None:
    for result in results:
        run = result[model_type, flag]
        assert all(abs(a - b) <= LOSS_TOLERANCE for a, b in zip(run["nf4"], run["bf16"], strict=True)), run
        assert run["nf4"] != run["bf16"]  # the base really is quantized


def test_dcp_round_trip_resumes_to_equal_losses_and_holds_no_4_bit_weight(results: list, folder: Path) -> None:
    for result in results:
        assert result["resumed"] == result["uninterrupted"][2:]
        assert not any("base_layer" in key for key in result["checkpoint_keys"])
        assert any("lora_A" in key for key in result["checkpoint_keys"])
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder / "ckpt")).read_metadata()
    saved = set(metadata.state_dict_metadata)
    assert not any("base_layer" in key for key in saved), sorted(saved)[:5]
    assert any("lora_B" in key for key in saved)


def test_merged_export_loads_with_from_pretrained_and_its_logits_are_close(results: list, folder: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(next((folder / "merged").glob("*.safetensors"))), "pt") as exported:
        assert exported.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "BF16"
        assert exported.get_slice("model.norm.weight").get_dtype() == "F32"
        assert not any("lora" in key or "base_layer" in key for key in exported.keys())
    loaded = AutoModelForCausalLM.from_pretrained(str(folder / "merged"))  # fp32, so every exported value is kept
    with torch.no_grad():
        logits = loaded(input_ids=global_batch(WORLD, 0, vocab=VOCAB)).logits.float()
    trained = results[0]["trained_logits"]
    # the export holds the dequantized base plus the adapters merged and rounded once to bf16
    assert (logits - trained).abs().max() < 0.1
    assert (logits.argmax(-1) == trained.argmax(-1)).float().mean() > 0.95


def test_cpu_offload_equals_the_run_without_and_keeps_params_and_states_on_the_cpu(results: list) -> None:
    for result in results:
        assert result["offload"] == result["llama", "bf16-true"]["nf4"]
        assert result["offload_resumed"] == result["offload"][2:]  # clipped steps, a DCP round trip, resumed exactly
        assert result["offload_policies"] and all(result["offload_policies"])
        assert result["offload_devices"] == {"cpu"}


def test_activation_checkpointing_composes_with_the_4_bit_base_bit_for_bit(results: list) -> None:
    for result in results:
        assert result["checkpointed"] == result["llama", "bf16-true"]["nf4"]


def _hsdp(rank: int, world_size: int) -> Dict[str, Any]:
    """4 ranks, HSDP 2 x 2: the 4-bit base with offload and activation checkpointing, against it without either."""
    out = {}
    for name, fields in (
        ("plain", dict(quantize_base="nf4")),
        ("composed", dict(quantize_base="nf4", offload="cpu", activation_checkpointing="full")),
    ):
        fabric = make_fabric(world_size, "bf16-true", _strategy(data_parallel_replicate_size=2, **fields))
        model = fabric.setup(qlora_model("llama"))
        losses = _train(fabric, model, rank, range(3), world=world_size)["losses"]
        out[name] = {"losses": losses, "nf4": len(_base_shards(model)), "offloaded": _offloaded(model)}
    return out


def test_hsdp_composes_with_the_4_bit_base_offload_and_activation_checkpointing() -> None:
    results = run_distributed(_hsdp, 4, timeout=300)
    for result in results:
        assert result["composed"]["losses"] == result["plain"]["losses"]
        assert result["composed"]["nf4"] == result["plain"]["nf4"] == 14
        assert all(result["composed"]["offloaded"]) and not any(result["plain"]["offloaded"])


def test_meta_init_and_a_pretrained_load_quantize_each_ranks_rows_as_the_whole_weight_would(results: list) -> None:
    for result in results:
        # meta init: rank 0 initialises each weight, every rank quantizes its rows with the whole weight's mean
        expected = result["meta_expected"]
        assert expected and set(result["meta_shards"]) == set(expected)
        for name, shard in result["meta_shards"].items():
            assert torch.equal(shard, expected[name]), name
        # a pretrained load: every rank reads and quantizes its own rows; the same as the model built in memory
        assert set(result["loaded_shards"]) == set(result["shards"])
        for name, shard in result["shards"].items():
            assert torch.equal(result["loaded_shards"][name], shard), name
        assert not torch.equal(result["meta_shards"][name], result["shards"][name])  # two different inits
