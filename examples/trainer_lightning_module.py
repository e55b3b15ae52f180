"""A LightningModule trained by the Trainer with strategy="mixed_fsdp2": no configure_model, no fully_shard.

python examples/trainer_lightning_module.py            # the Trainer launches 2 CPU processes itself
python examples/trainer_lightning_module.py --steps 5
"""

import argparse

import lightning.pytorch as pl
import torch

import lightning_mixedfsdp  # noqa: F401  registers strategy="mixed_fsdp2"
from lightning_mixedfsdp.recipes.models import TinyLlama, TinyLlamaConfig, causal_lm_loss


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # layer 1 is a Mamba-style mixer whose bare A_log sits beside dt_bias; the Mixer class declares
        # _keep_in_fp32_modules = ["A_log"] as HF models do and the default rules name dt_bias, so the strategy
        # replicates both in fp32
        self.model = TinyLlama(TinyLlamaConfig(vocab_size=64, dim=64, n_layers=2, hidden_dim=128, mixer_layers=[1]))

    def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
        loss = causal_lm_loss(self.model(tokens), tokens)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def arithmetic_sequences(count: int, length: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (count, 1), generator=generator)
    return (start + torch.randint(1, 4, (count, 1), generator=generator) * torch.arange(length)) % 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="mixed_fsdp2",
        precision="bf16-true",
        max_steps=args.steps,
        max_epochs=1,
        accumulate_grad_batches=2,  # syncs gradients once per optimizer step
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    model = LanguageModel()
    loader = torch.utils.data.DataLoader(arithmetic_sequences(8 * 2 * 2 * args.steps), batch_size=8)
    trainer.fit(model, loader)
    a_log, norm = model.model.layers[1].attention.A_log, model.model.norm.weight
    trainer.print(f"final loss {trainer.callback_metrics['train_loss']:.4f}; A_log {a_log.dtype}, norm {norm.dtype}")


if __name__ == "__main__":
    main()
