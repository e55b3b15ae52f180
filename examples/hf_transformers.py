"""A Hugging Face model built from a small config (no download) under Fabric(strategy="mixed_fsdp2").

gpt_oss declares `_keep_in_fp32_modules` for its norms; transformers applies that list only for fp16, so a bf16 run
would lose them. mixed_fsdp2 keeps them fp32 under bf16-true. Needs the `hf` extra: pip install -e ".[hf]"

    python examples/hf_transformers.py --steps 5
"""

import argparse

import torch
from lightning.fabric import Fabric
from transformers import GptOssConfig, GptOssForCausalLM

from lightning_mixedfsdp import format_plan
from lightning_mixedfsdp.fabric import MixedFSDP2Strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--export", default=None, help="folder for a safetensors export loadable by from_pretrained")
    args = parser.parse_args()

    # keep_fp32_modules=[]: only the model's own _keep_in_fp32_modules decides what stays fp32 here
    fabric = Fabric(
        accelerator="cpu", devices=2, strategy=MixedFSDP2Strategy(keep_fp32_modules=[]), precision="bf16-true"
    )
    fabric.launch()
    fabric.seed_everything(0)
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = fabric.setup(GptOssForCausalLM(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.print(format_plan(fabric.strategy.plan_of(model)))

    for step in range(args.steps):
        start = torch.randint(0, 64, (4, 1))
        tokens = (start + torch.arange(32)) % 64
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:3d}  loss {loss.item():.4f}")
    if args.export:
        fabric.strategy.export_safetensors(model, args.export, dtype=torch.bfloat16)
    fabric.print(f"final loss {loss.item():.4f}; model.norm {model.model.norm.weight.dtype}")


if __name__ == "__main__":
    main()
