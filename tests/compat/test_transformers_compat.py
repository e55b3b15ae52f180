"""The transformers APIs the library reads beyond the public model classes, on the installed release (5.23 to 5.25):
which models decode with their cache (from the public ``config.layer_types``, equal to the private ``_is_stateful``
where a release still sets it), and a private API that is gone raising with its name and the version instead of a
default taking its place."""

import dataclasses

import pytest
import torch

from lightning_mixedfsdp.compat import transformers as compat
from lightning_mixedfsdp.compat.versions import UnsupportedVersion, installed_version, private
from tests.hf_models import model_class, tiny_config

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

STATEFUL = {
    "llama": False,
    "qwen3": False,
    "gemma3_text": False,
    "gpt_oss": False,
    "mamba": True,
    "mamba2": True,
    "jamba": True,
    "falcon_h1": True,
    "qwen3_next": True,
    "rwkv": True,  # no layer_types at all: its forward takes a state, not a cache
    "lfm2_moe": True,  # a short convolution's rolling state: 5.23-5.24 did not mark it stateful; decoded without
}  # a cache here (slower, never another distribution)


@pytest.mark.parametrize("model_type", list(STATEFUL))
def test_stateful_models_are_found_from_their_config(model_type: str) -> None:
    with torch.device("meta"):
        model = model_class(model_type).from_config(tiny_config(model_type))
    assert compat.decodes_with_cache(model) is not STATEFUL[model_type]
    legacy = getattr(type(model), "_is_stateful", None)  # 5.23 and 5.24 set it; 5.25 removed it
    if legacy:  # every model those releases marked stateful is found stateful
        assert STATEFUL[model_type]


def test_a_peft_wrapped_model_is_asked_of_its_base() -> None:
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = model_class("llama").from_config(tiny_config("llama"))
    assert compat.decodes_with_cache(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])))


def test_an_image_text_model_is_asked_of_its_decoder() -> None:
    from transformers import AutoConfig, LlavaForConditionalGeneration

    text = tiny_config("jamba").to_dict()
    vision = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=8)  # fmt: skip
    config = AutoConfig.for_model("llava", text_config=text, vision_config=vision)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    assert not compat.decodes_with_cache(model)


def test_a_private_attribute_that_is_gone_names_itself_and_the_version() -> None:
    class FSDPState:
        pass

    with pytest.raises(UnsupportedVersion) as raised:
        private(FSDPState(), "_fsdp_param_groups", "torch")
    message = str(raised.value)
    assert "FSDPState._fsdp_param_groups" in message and f"torch {installed_version('torch')}" in message
    assert "2.11 to 2.15" in message


def test_fsdp_param_groups_raise_when_neither_attribute_exists() -> None:
    from lightning_mixedfsdp.compat.torch import fsdp_param_groups_of_state

    with pytest.raises(UnsupportedVersion, match="_fsdp_param_groups"):
        fsdp_param_groups_of_state(object())


def test_the_cache_keyword_raises_when_the_output_has_neither_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_outputs as outputs

    @dataclasses.dataclass
    class CausalLMOutputWithPast:
        logits: object = None

    monkeypatch.setattr(outputs, "CausalLMOutputWithPast", CausalLMOutputWithPast)
    compat.cache_keyword.cache_clear()
    try:
        with pytest.raises(UnsupportedVersion, match=f"transformers {installed_version('transformers')}"):
            compat.cache_keyword()
    finally:
        compat.cache_keyword.cache_clear()


def test_checkpoint_names_of_a_class_that_splits_a_checkpoint_tensor_are_refused() -> None:
    """HRM's checkpoint holds ``mlp.gate_up_proj`` that the model splits in two: reversed one tensor at a time, the
    stream would send each half under the fused name."""
    from transformers import HrmTextConfig, HrmTextForCausalLM

    config = HrmTextConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2)
    with pytest.raises(
        NotImplementedError, match="HrmTextForCausalLM splits checkpoint tensors .* checkpoint_names=False"
    ):
        compat.checkpoint_tensors(HrmTextForCausalLM, config)


def test_checkpoint_names_of_an_moe_are_what_save_pretrained_writes(tmp_path: object) -> None:
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.hf_models import tiny_model

    model = tiny_model("qwen3_moe")
    convert = compat.checkpoint_tensors(type(model), model.config)
    assert convert is not None
    streamed = {k: v for name, tensor in model.state_dict().items() for k, v in convert(name, tensor).items()}
    model.save_pretrained(Path(str(tmp_path)))
    saved = load_file(Path(str(tmp_path)) / "model.safetensors")
    assert streamed.keys() >= saved.keys() and all(torch.equal(streamed[k], v) for k, v in saved.items())
