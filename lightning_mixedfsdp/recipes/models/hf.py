"""Hugging Face causal LMs built from a config on the meta device (the strategy initialises or loads them shard by
shard), LoRA-wrapped when asked."""

from typing import Any, Dict, Optional

import torch
from torch import nn

from lightning_mixedfsdp.compat.extras import optional_import


def build_hf_causal_lm(hf_config: Any, lora: Optional[Dict[str, Any]] = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config(hf_config)`` on the meta device; with ``lora`` (``peft.LoraConfig``'s
    arguments) wrapped by ``peft.get_peft_model``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(hf_config)
        if lora is not None:
            with optional_import("peft", "peft.enabled=true"):
                from peft import LoraConfig, get_peft_model

            built = get_peft_model(built, LoraConfig(**lora))
    return built
