"""peft LoRA on an HF Llama built from config, on 2 ranks: the frozen base in the compute dtype, fp32 adapters, fp32
norms, grads and optimizer state for the adapters only; adapter export in PEFT's own format and a merged export."""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import full_params, global_batch, make_fabric, rank_slice, unwrap

WORLD = 2
STEPS = 4
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def lora_model(seed: int = 0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", seed=seed), LoraConfig(**LORA))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts lora_B at zero; a nonzero B makes the merged export differ from the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02, generator=generator)
    return model


def _train(rank: int, precision: str, folder: Path) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(WORLD, precision, MixedFSDP2Strategy())
    model = fabric.setup(lora_model())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, with_grads = [], set()
    for step in range(STEPS):
        tokens = rank_slice(global_batch(WORLD, step % 2), rank, WORLD)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        with_grads |= {n for n, p in unwrap(model).named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    plan = fabric.strategy.plan_of(model)
    fabric.strategy.export_adapter(model, folder / "adapter")
    fabric.strategy.export_safetensors(model, folder / "merged", dtype=torch.float32)
    return {
        "losses": losses,
        "keys": {n: (p.key.storage, p.key.compute, p.requires_grad) for n, p in plan.params.items()},
        "dtypes": {n: p.dtype for n, p in unwrap(model).named_parameters()},
        "with_grads": with_grads,
        "optimizer_states": len(optimizer.state),
        "trainable": len(trainable),
        "values": full_params(model),
    }


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    return {flag: _train(rank, flag, Path(folder) / flag) for flag in ("bf16-mixed", "bf16-true")}


LAUNCH = Launch(_scenarios, WORLD, timeout=300)


def _kind(name: str) -> str:
    if "lora_" in name:
        return "adapter"
    return "norm" if "norm" in name else "base"


@pytest.mark.parametrize("flag", ["bf16-mixed", "bf16-true"])
def test_frozen_base_in_the_compute_dtype_norms_fp32_and_adapters_per_flag(results: list, flag: str) -> None:
    adapter_storage = torch.float32 if flag == "bf16-mixed" else torch.bfloat16
    expected = {
        "base": (torch.bfloat16, torch.bfloat16, False),
        "norm": (torch.float32, torch.float32, False),
        "adapter": (adapter_storage, torch.bfloat16, True),
    }
    for result in results:
        out = result[flag]
        assert {_kind(n) for n in out["keys"]} == {"base", "norm", "adapter"}
        for name, key in out["keys"].items():
            assert key == expected[_kind(name)], (name, key)
            assert out["dtypes"][name] == key[0], name


@pytest.mark.parametrize("flag", ["bf16-mixed", "bf16-true"])
def test_only_the_adapters_get_grads_and_optimizer_state_and_training_lowers_the_loss(results: list, flag: str) -> None:
    for result in results:
        out = result[flag]
        assert out["with_grads"] == {n for n in out["keys"] if "lora_" in n}
        assert out["optimizer_states"] == out["trainable"] == 2 * 2 * len(LORA["target_modules"])
        assert out["losses"][2] < out["losses"][0] and out["losses"][3] < out["losses"][1]  # same batches again


def test_adapter_export_loads_with_peft_to_the_trained_values(results: list, folder: Path) -> None:
    from peft import PeftModel

    trained = results[0]["bf16-mixed"]["values"]
    loaded = PeftModel.from_pretrained(tiny_model("llama"), str(folder / "bf16-mixed" / "adapter"))
    adapters = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(adapters) == {n for n in trained if "lora_" in n}
    for name, value in adapters.items():
        assert value.dtype == torch.float32 and torch.equal(value, trained[name]), name


def test_merged_export_loads_with_from_pretrained_and_equals_peft_merge_of_the_trained_model(
    results: list, folder: Path
) -> None:
    from transformers import AutoModelForCausalLM

    trained = results[0]["bf16-mixed"]["values"]
    reference = lora_model()
    reference.load_state_dict(trained, strict=False)
    expected = reference.merge_and_unload().state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(str(folder / "bf16-mixed" / "merged"), dtype=torch.float32)
    merged = loaded.state_dict()
    assert set(merged) == set(expected)
    base_q = trained["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].float()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base_q)  # the adapter was merged in
    for name, value in expected.items():
        # the base is held in bf16, so the merged weight is rounded to bf16 once; the reference merges in fp32
        torch.testing.assert_close(merged[name], value.float(), rtol=2**-8, atol=1e-7, msg=name)
