"""The LightningModule of the main job: a causal LM with held-out perplexity from torchmetrics."""

import math
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics.text import Perplexity

from lightning_mixedfsdp.recipes.models import TinyLlama, TinyLlamaConfig, causal_lm_loss


def warmup_cosine(step: int, warmup_steps: int, max_steps: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 10%."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


class CausalLM(pl.LightningModule):
    def __init__(
        self,
        model: TinyLlamaConfig,
        lr: float,
        weight_decay: float,
        betas: List[float],
        warmup_steps: int,
        max_steps: int,
    ) -> None:
        super().__init__()
        self.model = TinyLlama(model)
        self.optim = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas)}
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.held_out_perplexity = Perplexity()
        self.perplexities: Dict[str, float] = {}

    def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
        loss = causal_lm_loss(self.model(tokens), tokens)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, tokens: torch.Tensor, _: int) -> None:
        logits = self.model(tokens)
        self.held_out_perplexity.update(logits[:, :-1].float(), tokens[:, 1:])

    def on_validation_epoch_end(self) -> None:
        perplexity = self.held_out_perplexity.compute()
        self.held_out_perplexity.reset()
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        self.perplexities[when] = perplexity.item()
        rank_zero_info(f"held-out perplexity ({when}): {perplexity.item():.2f}")
        if not self.trainer.sanity_checking:
            self.log("val_ppl", perplexity, prog_bar=True, sync_dist=True)  # equal on all ranks already

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), **self.optim)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.warmup_steps, self.max_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @property
    def untrained_perplexity(self) -> Optional[float]:
        return self.perplexities.get("untrained")
