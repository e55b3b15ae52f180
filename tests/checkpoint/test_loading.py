"""Dtype-aware loading in one process, from torch files and safetensors: every tensor in the dtype its plan gives it,
with the requested dtype as the bulk."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.checkpoint.load import load_weights, read_state_dict
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

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


def _load_both_ways(rank: int, world_size: int, folder: str) -> dict:
    """``load_full_weights`` of an HF folder (sharded in 3 files) into sharded models, every rank reading its own
    part and rank 0 reading alone: a tied Llama, the same under peft LoRA (its base checkpoint), bf16-true."""
    from peft import LoraConfig, get_peft_model

    from lightning_mixedfsdp import load_full_weights
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from tests.scenarios import full_params, make_fabric

    out: dict = {}
    for read in ("own_parts", "rank_zero"):
        for kind in ("tied", "lora"):
            fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(init_meta_params=False))
            with fabric.init_module(empty_init=True):
                model = _tied_llama(seed=5)
            if kind == "lora":
                model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
            model = fabric.setup(model)
            load_full_weights(model, folder, read=read)
            out[(read, kind)] = full_params(model)
    fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(init_meta_params=False))
    with fabric.init_module(empty_init=True):
        model = tiny_model_with_extra_layer()
    model = fabric.setup(model)
    with pytest.raises(ValueError, match=r"does not fit the model: missing keys \['model.layers.2"):
        load_full_weights(model, folder)
    return out


def tiny_model_with_extra_layer() -> torch.nn.Module:
    from tests.hf_models import tiny_model

    return tiny_model("llama", tie_word_embeddings=True, num_hidden_layers=3)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_reads_its_own_part_and_loads_what_rank_zero_alone_loads(tmp_path: Path, world_size: int) -> None:
    from lightning_mixedfsdp.testing import run_distributed

    source = _tied_llama(seed=1).to(torch.bfloat16)
    source.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    saved = read_state_dict(tmp_path)
    for result in run_distributed(_load_both_ways, world_size, str(tmp_path)):
        for kind in ("tied", "lora"):
            own, alone = result[("own_parts", kind)], result[("rank_zero", kind)]
            assert own.keys() == alone.keys()
            # what the checkpoint holds (the adapters are in no base checkpoint: left as allocated)
            for name, value in ((n, v) for n, v in own.items() if "lora_" not in n):
                assert value.dtype == alone[name].dtype and torch.equal(value, alone[name]), (kind, name)
        tied = result[("own_parts", "tied")]
        # the file's bf16 norms widened to fp32 exactly; the tie read from the one key the file holds
        assert tied["model.norm.weight"].dtype == torch.float32
        assert torch.equal(tied["model.norm.weight"], saved["model.norm.weight"].float())
        assert torch.equal(tied["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
        lora = result[("own_parts", "lora")]
        base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
        assert torch.equal(lora[base], saved["model.layers.0.self_attn.q_proj.weight"])


def test_only_a_folder_of_the_checkpoints_own_files_is_read_by_every_rank(tmp_path: Path) -> None:
    from lightning_mixedfsdp.checkpoint.load import _safetensors_folder

    _tied_llama(seed=1).save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert _safetensors_folder(tmp_path / "hf") == tmp_path / "hf"
    save_file({"x": torch.zeros(1)}, str(tmp_path / "hf" / "adapter_model.safetensors"))
    assert _safetensors_folder(tmp_path / "hf") is None  # the reader would read the adapter too: rank 0 reads
    (tmp_path / "alone").mkdir()
    alone = _checkpoint(tmp_path / "alone", "safetensors")
    assert _safetensors_folder(alone) == alone.parent  # a file alone in its folder
    assert _safetensors_folder(_checkpoint(tmp_path / "alone", "pt")) is None  # a torch file: rank 0 reads


def test_a_merged_export_of_lora_it_cannot_merge_layer_by_layer_is_refused_not_dropped() -> None:
    from peft import LoraConfig, get_peft_model

    from lightning_mixedfsdp.checkpoint.export import export_tensors, merged_peft_tensors

    model = get_peft_model(_tied_llama(), LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(TypeError, match=r"merging base_model.model.model.embed_tokens \(Embedding\) is not supported"):
        merged_peft_tensors(model, export_tensors(model))
