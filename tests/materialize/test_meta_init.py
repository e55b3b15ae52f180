"""Meta-device models on 2 ranks, initialised by the model's own init and streamed into the shards one chunk at a
time: HF models by HF's ``_init_weights`` (RoPE ``inv_freq`` rebuilt), equal to a single-process init; streaming
loads of a saved HF checkpoint; a module no init covers raises on every rank."""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from torch import nn

from tests.conftest import Launch
from tests.hf_models import tiny_config
from tests.scenarios import full_params, make_fabric, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 2
SEED = 7


def _build_on_meta(fabric: Any, model_type: str, **overrides: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return model


def _tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = full_params(model)
    out.update({n: b.detach().clone() for n, b in unwrap(model).named_buffers()})
    return out


def _meta_init(rank: int, model_type: str, **overrides: Any) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=[r"A_log$"]))
    model = _build_on_meta(fabric, model_type, **overrides)
    torch.manual_seed(SEED)
    model = fabric.setup(model)
    values = _tensors(model)
    inner = unwrap(model)
    tied = getattr(inner, "lm_head", None) is not None and inner.lm_head.weight is inner.model.embed_tokens.weight
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"values": values, "losses": losses, "tied": tied}


def _save_pretrained(folder: Path) -> Dict[str, torch.Tensor]:
    """An HF Llama saved as the user has it: bf16 weights, fp32 norms, sharded safetensors with an index, tied."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=True)).to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data = (param.data.float() + torch.linspace(-0.1, 0.1, param.numel())).float()
    model.save_pretrained(folder, max_shard_size="20KB")
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _load_into_meta(rank: int, folder: str) -> Dict[str, Any]:
    from lightning_mixedfsdp import load_full_weights
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(init_meta_params=False))
    model = fabric.setup(_build_on_meta(fabric, "llama", tie_word_embeddings=True))
    load_full_weights(model, folder, chunk_bytes=4096)
    return {"values": _tensors(model), "loss": model(input_ids=torch.arange(16)[None] % 64, labels=None).logits.sum()}


class _NoInit(nn.Module):
    """A param and no reset_parameters(): nothing can initialise it on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _uninitialisable(rank: int) -> str:
    fabric = make_fabric(WORLD, "bf16-true")
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), _NoInit())
    try:
        fabric.setup(model)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _lora_on_meta(rank: int) -> Dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    fabric = make_fabric(WORLD, "bf16-mixed")
    model = get_peft_model(_build_on_meta(fabric, "llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(SEED)
    return {"values": _tensors(fabric.setup(model))}


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    return {
        "lora": _lora_on_meta(rank),
        "llama": _meta_init(rank, "llama"),
        "llama_tied": _meta_init(rank, "llama", tie_word_embeddings=True),
        "qwen3_next": _meta_init(rank, "qwen3_next"),
        "load": _load_into_meta(rank, folder),
        "error": _uninitialisable(rank),
    }


@pytest.fixture(scope="module")
def saved(folder: Path) -> Any:
    return folder, _save_pretrained(folder)


@pytest.fixture(scope="module")
def pretrained(saved: Any) -> Path:
    """The folder the HF checkpoint is saved in, once it is."""
    return saved[0]


LAUNCH = Launch(_scenarios, WORLD, timeout=300, with_folder=False, fixtures=("pretrained",))


def _reference(model_type: str, **overrides: Any) -> Dict[str, torch.Tensor]:
    """One process: the same meta model, initialised by ``init_meta_module_``."""
    from transformers import AutoModelForCausalLM

    from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
    from lightning_mixedfsdp.apply.applier import apply_dtypes
    from lightning_mixedfsdp.materialize.meta import init_meta_module_

    # built as `init_module()` builds under bf16-true (bf16 default dtype, as Lightning's own), initialised in the
    # dtypes README gives: keep-fp32 tensors in fp32, the rest in the dtype they were built in
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    finally:
        torch.set_default_dtype(default)
    apply_dtypes(model, plan_sharding(model, MixedFSDPConfig(keep_fp32_params=[r"A_log$"]), "bf16-true"))
    torch.manual_seed(SEED)
    init_meta_module_(model)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("scenario", ["llama", "llama_tied", "qwen3_next"])
def test_meta_init_of_an_hf_model_equals_a_single_process_hf_init_on_every_rank(results: list, scenario: str) -> None:
    model_type, overrides = scenario.split("_")[0], {"tie_word_embeddings": True} if "tied" in scenario else {}
    model_type = "qwen3_next" if scenario == "qwen3_next" else model_type
    reference = _reference(model_type, **overrides)
    for result in results:
        values = result[scenario]["values"]
        assert set(values) == set(reference)
        for name, expected in reference.items():
            assert values[name].dtype == expected.dtype and torch.equal(values[name], expected.detach()), name
        assert result[scenario]["losses"][1] < result[scenario]["losses"][0]  # it trains


def test_meta_init_uses_hf_init_rebuilds_rope_and_keeps_ties(results: list) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    from_config = AutoModelForCausalLM.from_config(tiny_config("llama"))
    values = results[0]["llama"]["values"]
    std = tiny_config("llama").initializer_range
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert abs(values[name].float().std().item() - std) < 0.2 * std, name
        assert abs(from_config.state_dict()[name].std().item() - std) < 0.2 * std, name
    assert all(torch.all(values[n] == 1) for n in values if n.endswith("norm.weight"))
    for name in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        expected = dict(from_config.named_buffers())[name]
        assert values[name].dtype == torch.float32 and torch.equal(values[name], expected), name
    assert results[0]["llama_tied"]["tied"] and results[1]["llama_tied"]["tied"]


def test_streaming_load_into_a_meta_model_gives_the_checkpoint_values_in_the_planned_dtypes(
    results: list, saved: Any
) -> None:
    from transformers import AutoModelForCausalLM

    folder, checkpoint = saved
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # sharded with an index
    rope = dict(AutoModelForCausalLM.from_config(tiny_config("llama")).named_buffers())
    for result in results:
        values = result["load"]["values"]
        for name, expected in checkpoint.items():
            if name == "lm_head.weight":
                continue  # tied: the same param as the embeddings
            planned = torch.float32 if "norm" in name else torch.bfloat16
            assert values[name].dtype == planned and torch.equal(values[name], expected.to(planned)), name
        # non-persistent: in no checkpoint, rebuilt by the rotary embedding's own init
        assert torch.equal(values["model.rotary_emb.inv_freq"], rope["model.rotary_emb.inv_freq"])


def test_a_module_no_init_covers_raises_on_every_rank_with_the_fix(results: list) -> None:
    for result in results:
        message = result["error"]
        assert "1 tensor(s) were left uninitialised" in message and "1.scale (_NoInit)" in message
        assert "Give each class a `reset_parameters()` method" in message


def test_lora_adapters_on_meta_get_peft_init_so_the_untrained_adapter_changes_nothing(results: list) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_mixedfsdp.materialize.meta import init_meta_module_

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(tiny_config("llama"))
        reference = get_peft_model(reference, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(SEED)
    expected = dict(init_meta_module_(reference).named_parameters())
    for result in results:
        values = result["lora"]["values"]
        lora_b = [n for n in values if "lora_B" in n]
        assert lora_b and all(torch.all(values[n] == 0) for n in lora_b)
        assert all(values[n].abs().sum() > 0 for n in values if "lora_A" in n)
        for name in (n for n in expected if "lora_" in n):
            assert torch.equal(values[name], expected[name].detach()), name
