"""Train a small Llama-style model with fp32 norms and a bf16 bulk on 2 CPU processes.

python examples/fabric_quickstart.py            # Fabric launches the 2 processes itself
python examples/fabric_quickstart.py --steps 3
"""

import argparse

import torch
from lightning.fabric import Fabric

import lightning_mixedfsdp  # noqa: F401  registers strategy="mixed_fsdp2"
from lightning_mixedfsdp import format_plan
from lightning_mixedfsdp.recipes.models import TinyLlama, TinyLlamaConfig, causal_lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="mixed_fsdp2", precision="bf16-true")
    fabric.launch()

    fabric.seed_everything(0)
    model = TinyLlama(TinyLlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, hidden_dim=128))
    model = fabric.setup(model)  # no hand-written fully_shard: norms stay fp32, the rest is bf16
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    fabric.print(format_plan(fabric.strategy.plan_of(model)))

    for step in range(args.steps):
        # learnable toy data: arithmetic token sequences
        start = torch.randint(0, 64, (8, 1))
        tokens = (start + torch.randint(1, 4, (8, 1)) * torch.arange(32)) % 64
        loss = causal_lm_loss(model(tokens), tokens)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:3d}  loss {loss.item():.4f}")

    norm, wq = model.layers[0].ffn_norm.weight, model.layers[0].attention.wq.weight
    fabric.print(f"final loss {loss.item():.4f}; norm weight dtype {norm.dtype}, wq dtype {wq.dtype}")


if __name__ == "__main__":
    main()
