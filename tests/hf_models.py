"""Tiny Hugging Face models built from config (no download): the code our users train, not code we wrote."""

from typing import Any

import torch

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    head_dim=8,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
EXTRA = {
    "llama": {},
    "qwen3": {},
    "qwen3_next": dict(
        **MOE,
        num_experts=4,
        shared_expert_intermediate_size=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    ),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "dots1": dict(**MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1),
    "deepseek_v3": dict(
        **MOE,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=1, moe_num_shared_experts=1
    ),
}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **EXTRA[model_type], **overrides})


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` of the tiny config, seeded: HF's own init."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
