"""The LightningModule of the recipes: a causal LM (the reference model, or an HF model from config or a pretrained
directory, optionally with LoRA adapters) with held-out perplexity from torchmetrics."""

import math
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_mixedfsdp.apply.context_parallel import ContextParallel, shifted_labels
from lightning_mixedfsdp.checkpoint.load import load_full_weights
from lightning_mixedfsdp.compat.extras import optional_import
from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.inputs import load_hf_config, reference_model_config
from lightning_mixedfsdp.recipes.models import TinyLlama, causal_lm_loss
from lightning_mixedfsdp.recipes.plot import UNTRAINED_PPL
from lightning_mixedfsdp.recipes.schema import ModelSection, PeftSection


def warmup_cosine(step: int, warmup_steps: int, max_steps: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 10%."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def build_hf_model(model: ModelSection, peft: PeftSection) -> nn.Module:
    """The HF model on the meta device (the strategy initialises or loads it shard by shard), LoRA-wrapped if asked."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(load_hf_config(model.hf_source()))
        if peft.enabled:
            with optional_import("peft", "peft.enabled=true"):
                from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=peft.r, lora_alpha=peft.alpha, lora_dropout=peft.dropout, target_modules=list(peft.target_modules)
            )
            built = get_peft_model(built, lora)
    return built


class CausalLM(pl.LightningModule):
    def __init__(
        self,
        model: ModelSection,
        lr: float,
        weight_decay: float,
        betas: List[float],
        warmup_steps: int,
        max_steps: int,
        peft: Optional[PeftSection] = None,
    ) -> None:
        super().__init__()
        self.model_section, self.peft = model, peft or PeftSection()
        # the reference model (or its export) is built here; an HF model in configure_model, on the meta device
        reference = reference_model_config(model)
        self.model: Optional[nn.Module] = TinyLlama(reference) if reference is not None else None
        self.lr, self.weight_decay, self.betas = lr, weight_decay, (betas[0], betas[1])
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.held_out_perplexity = Perplexity(ignore_index=IGNORE_INDEX)
        self.perplexities: Dict[str, float] = {}

    @override
    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_hf_model(self.model_section, self.peft)

    @override
    def on_fit_start(self) -> None:
        # a resumed run restores its own weights; only a fresh run starts from the pretrained directory
        if self.model_section.pretrained is not None and self.trainer.ckpt_path is None:
            assert self.model is not None  # configure_model built it
            load_full_weights(self.model, self.model_section.pretrained)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.model is not None  # configure_model built it
        if isinstance(self.model, TinyLlama):
            return self.model(tokens)
        return self.model(input_ids=tokens).logits

    @override
    def on_train_start(self) -> None:
        """The learning rate is a pure function of the step and this command's ``lr``, ``warmup_steps`` and
        ``max_steps``, as the data order is of the step: a resumed run restores the scheduler's step, and a run
        extended with a larger ``max_steps`` continues on the cosine planned to the new end (the LR rises from
        where the shorter schedule left it to the new curve's value at this step). The checkpoint's optimizer and
        scheduler hold the old run's rates; set them from the plan."""
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        factor = warmup_cosine(self.global_step, self.warmup_steps, self.max_steps)
        scheduler.base_lrs = [self.lr for _ in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = self.lr * factor

    def _context_parallel(self) -> Optional[ContextParallel]:
        """The strategy's context parallelism when it splits sequences (None otherwise)."""
        strategy = self.trainer.strategy
        context = getattr(strategy, "context_parallel", None)
        return context if isinstance(context, ContextParallel) and context.enabled else None

    def _split_logits(
        self, tokens: torch.Tensor, context: ContextParallel, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits and next-token labels of ``tokens`` (or of ``targets``, unshifted labels) under context
        parallelism: the labels shifted over the whole sequence, then split; an HF model is split by the strategy at
        its call, the reference model here (with its tokens' global positions)."""
        assert self.model is not None  # configure_model built it
        labels = shifted_labels(tokens if targets is None else targets)
        if isinstance(self.model, TinyLlama):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            local, where, local_labels = context.split(tokens, positions, labels, dims=(1, 0, 1))
            return self.model(local, where), local_labels
        return self.model(input_ids=tokens).logits, context.shard(labels)

    @override
    def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
        context = self._context_parallel()
        if context is None:
            loss = causal_lm_loss(self.logits(tokens), tokens)
        else:
            logits, labels = self._split_logits(tokens, context)
            summed = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            loss = context.loss(summed, (shifted_labels(tokens) != IGNORE_INDEX).sum())
        self.log("train_loss", loss, prog_bar=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])  # the rate this step's update uses
        return loss

    @override
    def validation_step(self, tokens: torch.Tensor, _: int) -> None:
        context = self._context_parallel()
        if context is None:
            self.held_out_perplexity.update(self.logits(tokens)[:, :-1].float(), tokens[:, 1:])
        else:  # each rank its part of every sequence: the metric adds the parts up
            logits, labels = self._split_logits(tokens, context)
            self.held_out_perplexity.update(logits.float(), labels)

    evaluated = "held-out perplexity"
    """What the held-out evaluation measures, as the console says it."""

    @override
    def on_validation_epoch_end(self) -> None:
        perplexity = self.held_out_perplexity.compute()
        self.held_out_perplexity.reset()
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        self.perplexities[when] = perplexity.item()
        rank_zero_info(f"{self.evaluated} ({when}): {perplexity.item():.2f} (loss {math.log(perplexity.item()):.4f})")
        if not self.trainer.sanity_checking:
            # equal on all ranks already; the bar shows it until the next evaluation, the console line is this one's
            self.log("val_ppl", perplexity, prog_bar=True, sync_dist=True)
            self.log("val_loss", perplexity.log(), sync_dist=True)
        elif self.logger is not None:  # Lightning keeps what the sanity check logs from the loggers; write it at step 0
            self.logger.log_metrics({UNTRAINED_PPL: perplexity.item()}, step=0)

    @override
    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]  # LoRA: the adapters only
        optimizer = torch.optim.AdamW(trainable, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.warmup_steps, self.max_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @property
    def untrained_perplexity(self) -> Optional[float]:
        return self.perplexities.get("untrained")
