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
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "olmo2": {},
    "granite": {},
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
    "qwen3_moe": dict(**MOE, num_experts=4),
    "gemma3_text": dict(sliding_window=16),
    # MiniMax's lightning attention keeps four decay buffers that its forward multiplies with activations
    "minimax": dict(
        num_local_experts=4, num_experts_per_tok=2, block_size=16, layer_types=["linear_attention", "full_attention"]
    ),
    "mamba": dict(hidden_size=64, state_size=16, expand=2, time_step_rank=8),
    "mamba2": dict(hidden_size=64, num_heads=8, head_dim=16, n_groups=1, state_size=16, expand=2, chunk_size=16),
    "falcon_h1": dict(
        mamba_d_ssm=64,
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=16,
        mamba_expand=2,
    ),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
    ),
    "rwkv": dict(attention_hidden_size=32, context_length=128),
    "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0),
    "lfm2_moe": dict(**MOE, num_experts=4, num_dense_layers=1, layer_types=["conv", "full_attention"]),
}
# DeepSeek-V3.2's lightning indexer picks the keys each query attends to: its params never get a grad
EXTRA["deepseek_v32"] = dict(**EXTRA["deepseek_v3"], index_n_heads=2, index_head_dim=16, index_topk=4)
SEQ2SEQ = ("t5",)


def tiny_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **EXTRA[model_type], **overrides})


def model_class(model_type: str) -> Any:
    """The Auto class that builds ``model_type`` with its LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if model_type in SEQ2SEQ else AutoModelForCausalLM


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``AutoModelFor...LM.from_config`` of the tiny config, seeded: HF's own init."""
    torch.manual_seed(seed)
    return model_class(model_type).from_config(tiny_config(model_type, **overrides))


class AuxFreeBalancing:
    """DeepSeek-V3's auxiliary-loss-free load balancing, as a user adds it to an HF DeepSeek-V3: after each backward
    every router's ``e_score_correction_bias`` moves by ``rate`` towards the experts this rank's tokens used least
    (torchtitan all-reduces the loads first; a user who does not gets biases that differ per rank).
    ``used[-1]``: the biases the last forward routed with, by router."""

    def __init__(self, model: torch.nn.Module, rate: float = 1e-2) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads: dict = {}
        self.used: list = []
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, _inputs: Any, outputs: Any) -> None:
        indices = outputs[-1]
        self.loads[router] = torch.bincount(indices.reshape(-1), minlength=router.e_score_correction_bias.numel())
        if router is self.routers[0]:
            self.used.append([])
        self.used[-1].append(router.e_score_correction_bias.detach().clone())

    @torch.no_grad()
    def update(self) -> None:
        for router in self.routers:
            load = self.loads[router].float()
            router.e_score_correction_bias.add_(self.rate * torch.sign(load.mean() - load))


VLM_TEXT = dict(COMMON, max_position_embeddings=256)
IMAGE_TOKEN = 60
"""The image placeholder id of the tiny VLMs (inside the vocabulary of 64)."""


def tiny_vlm_config(model_type: str) -> Any:
    """A tiny image-text config from HF's own classes: ``llava`` (a SigLIP tower, 32x32 images in 16 patches) or
    ``qwen2_vl`` (its own tower, a 16x16 image in 16 patches merged into 4 tokens)."""
    from transformers import AutoConfig

    if model_type == "llava":
        vision = dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
        return AutoConfig.for_model(
            "llava",
            text_config=dict(VLM_TEXT, model_type="llama"),
            vision_config=vision,
            image_token_id=IMAGE_TOKEN,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
        )
    text = dict(VLM_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=1, eos_token_id=2)
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=32,
        num_heads=4,
        mlp_ratio=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_chans=3,
    )
    return AutoConfig.for_model(
        "qwen2_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=61,
        vision_start_token_id=58,
        vision_end_token_id=59,
    )


def tiny_vlm(model_type: str, seed: int = 0) -> torch.nn.Module:
    """``AutoModelForImageTextToText.from_config`` of :func:`tiny_vlm_config`, seeded: HF's own init."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(tiny_vlm_config(model_type))


def vlm_row(model_type: str, seed: int, with_image: bool, length: int = 24) -> dict:
    """One training row for :func:`tiny_vlm`: text tokens, and with an image its placeholder tokens and pixels."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 58, (length,), generator=generator)
    if not with_image:
        return {"input_ids": text[None], "labels": text[None].clone()}
    if model_type == "llava":
        image = [IMAGE_TOKEN] * 16
        extra = {"pixel_values": torch.randn(1, 3, 32, 32, generator=generator)}
    else:
        image = [58, *([IMAGE_TOKEN] * 4), 59]
        extra = {
            "pixel_values": torch.randn(16, 3 * 2 * 4 * 4, generator=generator),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        }
    ids = torch.cat([text[:4], torch.tensor(image), text[4:]])[None]
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN] = -100
    if model_type == "qwen2_vl":  # its multimodal rotary positions read which tokens are the image's
        extra["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    return {"input_ids": ids, "labels": labels, **extra}
