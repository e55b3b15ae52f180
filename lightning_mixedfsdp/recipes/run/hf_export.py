"""What makes the runner's export a Hugging Face model directory a user can load: for the reference model, its
``config.json`` and code (HF's custom-code convention); for byte-level runs, a tokenizer (known again when a recipe
names it: ``inputs.is_byte_tokenizer``); and :func:`load_export`, which loads any export with every tensor in the dtype
the export holds it in.

How each export loads (docs/recipes.md, "Loading the exports"):

- the main job (reference model): ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``; the config
  names the export's fp32 tensors, the model class keeps exactly those fp32 (``_keep_in_fp32_modules_strict``) and
  the rest in the config's ``dtype`` (bf16);
- an HF model: ``from_pretrained(dir)`` builds it in the config's ``dtype``, the bulk's stored dtype (bf16: its
  fp32 norms load as bf16 unless the class keeps them fp32); ``from_pretrained(dir, dtype=torch.float32)`` loads
  every value exactly; ``load_export(dir)`` keeps the bf16 tensors bf16 and the fp32 ones fp32, as trained.
"""

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from lightning_mixedfsdp.checkpoint.load import load_weights
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.recipes.models import tiny_llama
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlamaConfig
from lightning_mixedfsdp.recipes.settings.inputs import (
    REFERENCE_MODEL_TYPE,
    REFERENCE_MODULE,
    byte_tokenizer_json,
    checkpoint_fp32_patterns,
    project_export,
)

REFERENCE_CODE = (Path(tiny_llama.__file__).with_name(f"{REFERENCE_MODULE}.py"), Path(tiny_llama.__file__))
"""The reference model's code an export carries: its HF wrapper (``auto_map`` names it; found beside the model, not
imported, which would import transformers' modelling code into every launch) and the model it wraps."""
"""The reference model's HF wrapper and the model itself, copied into the export."""


def write_reference_config(directory: Path, model: TinyLlamaConfig, dtype: torch.dtype) -> None:
    """``config.json`` and code for the reference model, beside its safetensors (written first: the config names the
    tensors they hold in fp32)."""
    config: Dict[str, Any] = {
        "model_type": REFERENCE_MODEL_TYPE,  # with the auto_map, how inputs.project_export knows its own export
        "architectures": ["TinyLlamaForCausalLM"],
        "auto_map": {
            "AutoConfig": f"{REFERENCE_MODULE}.TinyLlamaHFConfig",
            "AutoModelForCausalLM": f"{REFERENCE_MODULE}.TinyLlamaForCausalLM",
        },
        "vocab_size": model.vocab_size,
        "dim": model.dim,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "hidden_dim": model.hidden_dim,
        "mixer_layers": list(model.mixer_layers),
        "norm_eps": model.norm_eps,
        "keep_in_fp32": checkpoint_fp32_patterns(str(directory)),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for source in REFERENCE_CODE:
        shutil.copyfile(source, directory / source.name)


def write_byte_tokenizer(directory: Path, chat_template: Optional[str] = None) -> None:
    """The runner's byte tokenizer (token i is byte i) as an HF fast tokenizer in ``directory``, written as plain JSON
    so the default install (no transformers, no tokenizers) exports it too: a BPE over GPT-2's 256 byte symbols with
    no merges and HF's ByteLevel pre-tokenizer and decoder, so ``encode(text)`` gives ``list(text.encode("utf-8"))``
    and ``decode`` the text back. No special tokens: the vocabulary is the model's 256 (documents were separated by a
    blank line in training). The layout is ``tokenizers``' own serialisation (format "1.0"). ``chat_template``: the
    template a chat fine-tuning rendered its conversations with, for ``apply_chat_template``."""
    tokenizer = byte_tokenizer_json()
    config: Dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if chat_template is not None:  # a fine-tuned chat model: tokenizer.apply_chat_template renders as in training
        config["chat_template"] = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_export(
    directory: Union[str, Path], dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False
) -> nn.Module:
    """An export of the runner (any model) with every tensor in the dtype the export holds it in, ``dtype`` for
    the bulk (e.g. bf16 weights and fp32 norms, as trained), and the dtype boundaries installed so a plain forward
    runs (an fp32 norm computes in fp32 and returns ``dtype``). The reference model's export runs its own modelling
    file without being asked (the runner wrote it); any other model's code runs only with ``trust_remote_code=True``.
    Built on the CPU by the model's own ``from_config``, then loaded by ``load_weights``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    trust_remote_code = trust_remote_code or project_export(directory)
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    # the export's own fp32 tensors, and no other rule: each tensor keeps the dtype the export holds it in
    rules = MixedFSDPConfig(
        keep_fp32_modules=[], keep_fp32_params=checkpoint_fp32_patterns(str(directory)), honor_hf_keep_in_fp32=False
    )
    return load_weights(model, Path(directory), dtype, rules).eval()
