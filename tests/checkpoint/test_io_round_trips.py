"""Exports and loads at the sizes people train, on HF models: each model trains on 2 ranks and exports (streamed,
bf16 with its fp32 tensors), then loads back with every rank reading its own part on 4 ranks and on 2, and trains on
from there with equal losses; ``from_pretrained`` of each export gives the trained model's logits."""

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from lightning_mixedfsdp.testing import run_distributed
from tests.hf_models import tiny_model
from tests.scenarios import global_batch, make_fabric, rank_slice

ROUTERS = [r"mlp\.gate\.weight$"]
CASES = ("llama_tied", "qwen3_moe_ep2", "llama_lora")
PROBE = torch.arange(24).reshape(2, 12) % 64


def _model(case: str, seed: int = 0) -> torch.nn.Module:
    if case == "llama_tied":
        return tiny_model("llama", seed=seed, tie_word_embeddings=True)
    if case == "qwen3_moe_ep2":
        return tiny_model("qwen3_moe", seed=seed)
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", seed=seed), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # peft starts lora_B at zero: a nonzero B makes the merge visible
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def _strategy(case: str, **fields: Any) -> Any:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    experts = 2 if case == "qwen3_moe_ep2" else 1
    return MixedFSDP2Strategy(expert_parallel_size=experts, keep_fp32_params=ROUTERS, **fields)


def _steps(fabric: Any, model: Any, optimizer: Any, steps: range) -> List[float]:
    """Training steps on the same global batches (2 ranks' worth) whatever the world size; the global losses."""
    import torch.distributed as dist

    losses = []
    for step in steps:
        tokens = rank_slice(global_batch(2, step, vocab=64), fabric.global_rank, fabric.world_size)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    return losses


def _train_and_export(rank: int, world: int, folder: str) -> Dict[str, Any]:
    from lightning_mixedfsdp.model.tensors import local_tensor
    from lightning_mixedfsdp.planning.memory import estimate_io

    out: Dict[str, Any] = {}
    for case in CASES:
        fabric = make_fabric(world, "bf16-true", _strategy(case))
        model = fabric.setup(_model(case))
        if case == "qwen3_moe_ep2":  # the planner's prediction of what a load reads per rank, against the shards
            held = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
            plan = fabric.strategy.plan_of(model)
            out["predicted_read"] = (estimate_io(plan, shard_ranks=world).load_read_per_rank, held)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        _steps(fabric, model, optimizer, range(2))
        fabric.strategy.export_safetensors(model, Path(folder) / case, dtype=torch.bfloat16)
        if case == "llama_lora":
            fabric.strategy.export_adapter(model, Path(folder) / f"{case}-adapter")
        with torch.no_grad():
            out[case] = model(input_ids=PROBE).logits.float()
    return out


def _load_and_train_on(rank: int, world: int, folder: str) -> Dict[str, Any]:
    from lightning_mixedfsdp import load_full_weights

    out: Dict[str, Any] = {}
    for case in CASES:
        fabric = make_fabric(world, "bf16-true", _strategy(case, init_meta_params=False))
        with fabric.init_module(empty_init=True):
            # the merged LoRA export is a plain Llama: it loads into the base model
            model = tiny_model("llama", seed=1) if case == "llama_lora" else _model(case, seed=1)
        model = fabric.setup(model)
        load_full_weights(model, Path(folder) / case)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        out[case] = _steps(fabric, model, optimizer, range(2, 5))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("io")
    trained = run_distributed(_train_and_export, 2, str(folder), timeout=300)[0]
    on_four = run_distributed(_load_and_train_on, 4, str(folder), timeout=300)[0]
    on_two = run_distributed(_load_and_train_on, 2, str(folder), timeout=300)[0]
    return {"folder": folder, "trained": trained, "on_four": on_four, "on_two": on_two}


@pytest.mark.parametrize("case", CASES)
def test_an_export_loads_back_at_another_world_size_and_trains_on_with_equal_losses(
    runs: Dict[str, Any], case: str
) -> None:
    four, two = runs["on_four"][case], runs["on_two"][case]
    # the same params, data and optimizer: only the order of the data-parallel sums differs (bf16 grads)
    torch.testing.assert_close(torch.tensor(four), torch.tensor(two), rtol=2e-2, atol=0)
    assert four[0] == pytest.approx(two[0], rel=1e-3)  # the first loss is a forward of the loaded params


@pytest.mark.parametrize("case", CASES)
def test_from_pretrained_of_an_export_gives_the_trained_models_logits(runs: Dict[str, Any], case: str) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_mixedfsdp.recipes.run.hf_export import load_export

    folder = runs["folder"] / case
    trained = runs["trained"][case]
    # transformers' own load: the config states the bulk's stored dtype, bf16 (the norms load bf16 there)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert plain.config.dtype == torch.bfloat16 and plain.model.norm.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = plain(input_ids=PROBE).logits.float()
    torch.testing.assert_close(logits, trained, rtol=0.05, atol=0.05)  # bf16 norms against the trained fp32 ones
    # in fp32, every value of the export exact
    exact = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert exact.model.norm.weight.dtype == torch.float32
    with torch.no_grad():
        logits = exact(input_ids=PROBE).logits
    torch.testing.assert_close(logits, trained, rtol=0.05, atol=0.05)  # fp32 compute against the trained bf16
    # in the export's own dtypes (bf16 bulk, fp32 norms), as trained
    with torch.no_grad():
        same_dtypes = load_export(folder, torch.bfloat16)(input_ids=PROBE).logits.float()
    torch.testing.assert_close(same_dtypes, trained, rtol=1e-2, atol=1e-2)


def test_the_planner_predicts_the_bytes_a_rank_reads(runs: Dict[str, Any]) -> None:
    predicted, held = runs["trained"]["predicted_read"]
    assert predicted == held  # rank 0: its shard of each sharded param (experts split by EP too), replicas whole


def test_the_adapter_export_loads_with_peft(runs: Dict[str, Any]) -> None:
    from peft import PeftModel

    adapter = PeftModel.from_pretrained(tiny_model("llama"), runs["folder"] / "llama_lora-adapter")
    trained = runs["trained"]["llama_lora"]
    with torch.no_grad():
        logits = adapter.to(torch.bfloat16)(input_ids=PROBE).logits.float()
    torch.testing.assert_close(logits, trained, rtol=0.05, atol=0.05)
