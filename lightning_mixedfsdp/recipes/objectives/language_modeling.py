"""Language modelling: next-token prediction on text windows (``data/text.py``), the loss the mean over every
token, held-out perplexity from torchmetrics."""

import math
from typing import Any, ClassVar, List, Optional, Tuple

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_mixedfsdp.apply.context_parallel import ContextParallel, shifted_labels
from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.text import TextCorpus, data_problems
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss
from lightning_mixedfsdp.recipes.objectives.objective import (
    UNTRAINED_PPL,
    Objective,
    PipelineBatch,
    Schedule,
    TrainingLoss,
)
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection, Recipe


class CausalLM(Objective):
    """A causal LM (the reference model, or an HF model from config or a pretrained directory, optionally with LoRA
    adapters) on windows of tokens; evaluated by held-out perplexity."""

    formats: ClassVar[Tuple[str, ...]] = ("text",)
    evaluated = "held-out perplexity"
    pipelines = True

    def __init__(
        self,
        model: ModelSection,
        schedule: Schedule,
        peft: Optional[PeftSection] = None,
    ) -> None:
        super().__init__(model, schedule, peft)
        self.held_out_perplexity = Perplexity(ignore_index=IGNORE_INDEX)

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        micro_batches = recipe.trainer.max_steps * recipe.trainer.accumulate_grad_batches
        return TextCorpus(recipe.data, recipe.trainer.seed, micro_batches)

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        return data_problems(recipe.data, ranks)

    def logits(self, tokens: Tensor) -> Tensor:
        assert self.model is not None  # configure_model built it
        if isinstance(self.model, TinyLlama):
            return self.model(tokens)
        return self.model(input_ids=tokens).logits

    def split_logits(
        self, tokens: Tensor, context: ContextParallel, targets: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
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
    def training_loss(self, tokens: Tensor) -> TrainingLoss:
        context = self.context_parallel()
        if context is None:
            loss = causal_lm_loss(self.logits(tokens), tokens)
        else:
            logits, labels = self.split_logits(tokens, context)
            summed = summed_token_loss(logits, labels)
            loss = context.loss(summed, (shifted_labels(tokens) != IGNORE_INDEX).sum())
        return TrainingLoss(loss, loss.detach())

    @override
    def pipeline_batch(self, tokens: Tensor) -> PipelineBatch:
        return PipelineBatch(tokens, tokens, lambda output, target: causal_lm_loss(output_logits(output), target))

    def evaluate_pipelined(self, inputs: Any, labels: Tensor) -> None:
        """The held-out batch through the stages; the last stage's ranks add their logits to the metric (the others
        add nothing: the metric's sums over every rank count each replica's batch once)."""

        def update(output: Any, target: Tensor) -> Tensor:
            logits = output_logits(output)[:, :-1].float()
            self.held_out_perplexity.update(logits, target[:, 1:])
            return logits.new_zeros(())

        strategy: Any = self.trainer.strategy
        strategy.pipeline_eval(self.model, inputs, target=labels, loss_fn=update)

    @override
    def evaluate(self, tokens: Tensor) -> None:
        if self.schedule.pipelined:
            self.evaluate_pipelined(tokens, tokens)
            return
        context = self.context_parallel()
        if context is None:
            self.held_out_perplexity.update(self.logits(tokens)[:, :-1].float(), tokens[:, 1:])
        else:  # each rank its part of every sequence: the metric adds the parts up
            logits, labels = self.split_logits(tokens, context)
            self.held_out_perplexity.update(logits.float(), labels)

    @override
    def on_validation_epoch_end(self) -> None:
        perplexity = self.held_out_perplexity.compute()
        self.held_out_perplexity.reset()
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        self.evaluations[when] = perplexity.item()
        rank_zero_info(f"{self.evaluated} ({when}): {perplexity.item():.2f} (loss {math.log(perplexity.item()):.4f})")
        if not self.trainer.sanity_checking:
            # equal on all ranks already; the bar shows it until the next evaluation, the console line is this one's
            self.log("val_ppl", perplexity, prog_bar=True, sync_dist=True)
            self.log("val_loss", perplexity.log(), sync_dist=True)
        elif self.logger is not None:  # Lightning keeps what the sanity check logs from the loggers; write it at step 0
            self.logger.log_metrics({UNTRAINED_PPL: perplexity.item()}, step=0)

    @override
    @classmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        """Held-out perplexity before and after; the start is "untrained" for a model trained from scratch, "before"
        for pretrained weights."""
        start = "before" if pretrained else "untrained"
        first = f"{untrained:.2f} {start}" if untrained is not None else f"not evaluated {start}"
        finish = f"{trained:.2f}" if trained is not None else "not evaluated"
        return f"held-out perplexity: {first} -> {finish} after {steps} steps"


def output_logits(output: Any) -> Tensor:
    """The logits of a model's output: an HF output object's, or the tensor itself (the reference model)."""
    return output if isinstance(output, Tensor) else output.logits


def summed_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The sum of the token losses of ``logits`` against ``targets`` (``IGNORE_INDEX`` left out), in fp32."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
