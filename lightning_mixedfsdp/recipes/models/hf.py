"""Hugging Face models built from a config on the meta device (the strategy initialises or loads them shard by
shard): causal LMs, and image-text models (any ``AutoModelForImageTextToText`` architecture); params frozen by
``model.freeze``'s patterns, LoRA-wrapped when asked (adapters never on a frozen module)."""

import re
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_mixedfsdp.compat.extras import optional_import

TOWER_PATTERNS = (
    r"(^|\.)(vision_tower|vision_model|vision_encoder|image_encoder|audio_tower|audio_encoder)\.",
    r"(^|\.)visual\.(?!merger\.)",
)
"""What an image-text recipe freezes unless ``model.freeze`` says otherwise: the encoder towers by the names HF models
give them (Llava, Gemma 3, Llama 4, Mistral 3: ``vision_tower`` / ``vision_model``; Qwen2/2.5/3-VL: ``visual`` less
its ``merger``, the projector). Projectors train."""


def is_image_text(hf_config: Any) -> bool:
    """Whether ``AutoModelForImageTextToText`` builds ``hf_config``'s architecture."""
    from transformers import AutoModelForImageTextToText

    return type(hf_config) in AutoModelForImageTextToText._model_mapping


def freeze_patterns(hf_config: Any, freeze: Optional[Sequence[str]]) -> List[str]:
    """``model.freeze``, or for ``None`` an image-text model's towers (:data:`TOWER_PATTERNS`), else nothing."""
    if freeze is not None:
        return list(freeze)
    return list(TOWER_PATTERNS) if is_image_text(hf_config) else []


def build_hf_model(
    hf_config: Any,
    lora: Optional[Dict[str, Any]] = None,
    freeze: Optional[Sequence[str]] = None,
    lora_key: str = "peft.enabled=true",
    trust_remote_code: bool = False,
) -> nn.Module:
    """``AutoModelForCausalLM`` (or ``AutoModelForImageTextToText``) ``.from_config(hf_config)`` on the meta device,
    the params matching ``freeze_patterns(hf_config, freeze)`` frozen; with ``lora`` (``peft.LoraConfig``'s
    arguments) wrapped by ``peft.get_peft_model``, no adapter on a frozen module (``lora_key``: what asked for the
    adapters, as a missing peft is reported). ``trust_remote_code``: a config read from a folder's own code builds
    the model that code defines."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    patterns = freeze_patterns(hf_config, freeze)
    auto = AutoModelForImageTextToText if is_image_text(hf_config) else AutoModelForCausalLM
    with torch.device("meta"):
        built = auto.from_config(hf_config, trust_remote_code=trust_remote_code)
        freeze_matching(built, patterns)
        if lora is not None:
            with optional_import("peft", lora_key):
                from peft import LoraConfig, get_peft_model

            if patterns:  # peft matches the whole module name against a string
                lora = {**lora, "exclude_modules": ".*(" + "|".join(f"(?:{p})" for p in patterns) + ").*"}
            built = get_peft_model(built, LoraConfig(**lora))
    return built


def freeze_matching(model: nn.Module, patterns: Sequence[str]) -> List[str]:
    """Freeze every param whose name a pattern finds (``re.search``); the names frozen."""
    compiled = [re.compile(p) for p in patterns]
    frozen = []
    for name, param in model.named_parameters():
        if any(p.search(name) for p in compiled):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def frozen_summary(model: nn.Module, patterns: Sequence[str]) -> Optional[str]:
    """What ``patterns`` froze, as the console says it: the count and the outermost modules frozen whole (None when
    there are no patterns)."""
    if not patterns:
        return None
    compiled = [re.compile(p) for p in patterns]
    names = [n for n, _ in model.named_parameters() if any(p.search(n) for p in compiled)]
    count = sum(p.numel() for n, p in model.named_parameters() if n in set(names))
    whole: List[str] = []
    for module_name, module in model.named_modules():
        own = [f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters()]
        if own and set(own) <= set(names) and not any(module_name.startswith(f"{w}.") for w in whole):
            whole.append(module_name)
    where = ", ".join(whole[:6]) + (f" and {len(whole) - 6} more" if len(whole) > 6 else "")
    return f"model.freeze froze {len(names)} tensors ({count:,} params) matching {list(patterns)}: {where or 'none'}"
