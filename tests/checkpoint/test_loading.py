"""Dtype-aware loading in one process, from torch files and safetensors: every tensor in the dtype its plan gives it,
with the requested dtype as the bulk."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.checkpoint.load import load_weights, read_state_dict
from lightning_mixedfsdp.recipes.models import TinyLlama, TinyLlamaConfig

CONFIG = TinyLlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, hidden_dim=32, mixer_layers=(0,))
PINNED = MixedFSDPConfig(keep_fp32_params=[r"A_log$"])


def _checkpoint(tmp_path: Path, fmt: str, a_log_dtype: torch.dtype = torch.float32) -> Path:
    torch.manual_seed(3)
    state = {k: v.to(torch.bfloat16) for k, v in TinyLlama(CONFIG).state_dict().items()}
    state["layers.0.attention.A_log"] = torch.linspace(0.1, 2.0, 16, dtype=torch.float64).to(a_log_dtype)
    path = tmp_path / f"weights.{fmt}"
    save_file(state, str(path)) if fmt == "safetensors" else torch.save(state, path)
    return path


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_bf16_request_keeps_a_checkpoint_fp32_pinned_param_fp32(tmp_path: Path, fmt: str) -> None:
    path = _checkpoint(tmp_path, fmt)
    model = load_weights(TinyLlama(CONFIG), path, torch.bfloat16, PINNED)
    a_log = model.layers[0].attention.A_log
    assert a_log.dtype == torch.float32
    assert torch.equal(a_log, read_state_dict(path)["layers.0.attention.A_log"])
    assert model.layers[0].attention.dt_bias.dtype == torch.bfloat16
    # pinned by the RMSNorm rule and bf16 in the file: the plan keeps it fp32, holding the file's values exactly
    norm = model.layers[0].attention_norm.weight
    assert norm.dtype == torch.float32
    assert torch.equal(norm, read_state_dict(path)["layers.0.attention_norm.weight"].float())
    assert a_log.requires_grad


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_fp32_request_gives_fp32_everywhere(tmp_path: Path, fmt: str) -> None:
    model = load_weights(TinyLlama(CONFIG), _checkpoint(tmp_path, fmt), torch.float32, PINNED)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_pinned_param_stored_bf16_in_the_checkpoint_is_widened_exactly(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "pt", torch.bfloat16)
    model = load_weights(TinyLlama(CONFIG), path, torch.bfloat16, PINNED)
    a_log = model.layers[0].attention.A_log
    assert a_log.dtype == torch.float32
    assert torch.equal(a_log, read_state_dict(path)["layers.0.attention.A_log"].float())


def test_loading_into_a_meta_model_assigns_real_tensors(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = TinyLlama(CONFIG)
    load_weights(model, _checkpoint(tmp_path, "safetensors"), torch.bfloat16, PINNED)
    assert not any(p.is_meta for p in model.parameters())


def test_a_nested_checkpoint_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "fabric.ckpt"
    torch.save({"model": {"w": torch.zeros(1)}, "step": 3}, path)
    with pytest.raises(ValueError, match=r"does not hold a flat name -> tensor dict; .* pass its 'model' entry"):
        read_state_dict(path)


def _tied_llama(seed: int = 0) -> torch.nn.Module:
    from tests.hf_models import tiny_model

    return tiny_model("llama", seed=seed, tie_word_embeddings=True)


def test_tied_params_stay_one_tensor_loaded_from_every_tied_name(tmp_path: Path) -> None:
    source = _tied_llama(seed=1)
    state = source.state_dict()
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= state.keys()  # a tied model's state dict holds both
    path = tmp_path / "tied.safetensors"
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(path))
    model = load_weights(_tied_llama(), path, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"].to(torch.bfloat16))
    with torch.no_grad():  # one tensor: a change through one name shows through the other
        model.model.embed_tokens.weight[0, 0] = 7.0
    assert model.lm_head.weight[0, 0] == 7.0


def test_tied_params_load_from_one_name_alone(tmp_path: Path) -> None:
    state = _tied_llama(seed=1).state_dict()
    del state["lm_head.weight"]
    model = load_weights(_tied_llama(), state, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"].to(torch.bfloat16))


def test_tied_copies_that_differ_are_refused_with_the_fix(tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in _tied_llama(seed=1).state_dict().items()}
    state["lm_head.weight"] += 1
    with pytest.raises(ValueError, match=r"ties .* holds different values for .*tie_word_embeddings=False"):
        load_weights(_tied_llama(), state, torch.bfloat16)
