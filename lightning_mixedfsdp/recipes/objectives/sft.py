"""Supervised fine-tuning: the recipes' causal LM on chat or instruction rows (``data/chat_corpus.py``), the loss on
the trained tokens only (the assistant turns, the completions).

Each micro-batch's loss is the sum of its token losses over ``num_items``: the step's trained tokens (every
micro-batch, every data-parallel rank: ``step_tokens``, which the stream carries) divided by
``accumulate_grad_batches`` and the data-parallel ranks, since Lightning divides each micro-batch's loss by the first
and FSDP averages gradients over the second. The step's gradient is then the gradient of the sum of its token
losses over its trained tokens, however the rows are split into micro-batches and ranks (transformers'
``num_items_in_batch``, which HF models take as it is). Context-parallel ranks share their rows and split them, as
for the text recipes."""

import math
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from torch import Tensor
from typing_extensions import override

from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.chat_corpus import ChatCorpus
from lightning_mixedfsdp.recipes.data.sft import FINE_TUNING, fine_tuning_problems
from lightning_mixedfsdp.recipes.data.text import TextCorpus
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
from lightning_mixedfsdp.recipes.objectives.language_modeling import CausalLM, output_logits, summed_token_loss
from lightning_mixedfsdp.recipes.objectives.objective import PipelineBatch, TrainingLoss
from lightning_mixedfsdp.recipes.settings.schema import Recipe

Batch = Dict[str, Tensor]


def packs_rows(recipe: Recipe) -> bool:
    """Whether the run packs several examples per row: asked for, and no context parallelism (whose attention takes
    no packed-document mask)."""
    return recipe.data.packing and recipe.strategy.parallelism.context_parallel_size == 1


class ChatLM(CausalLM):
    """:class:`CausalLM` on fine-tuning rows: ``input_ids``, unshifted ``labels`` (-100 where nothing is trained),
    ``position_ids`` (restarting at each packed example) and, in training, ``step_tokens``."""

    formats: ClassVar[Tuple[str, ...]] = FINE_TUNING
    evaluated = "held-out perplexity on the trained tokens"

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        micro_batches = recipe.trainer.max_steps * recipe.trainer.accumulate_grad_batches
        accumulate = recipe.trainer.accumulate_grad_batches
        return ChatCorpus(recipe.data, recipe.trainer.seed, micro_batches, accumulate, packs_rows(recipe))

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        return fine_tuning_problems(recipe.data, ranks, packs_rows(recipe))

    def _num_items(self, batch: Batch) -> Tensor:
        """This rank's share of the step's trained tokens: what its summed token loss is divided by, so that FSDP's
        mean over the data-parallel ranks makes the step's loss the mean over all of them."""
        return batch["step_tokens"][0].double() / (self.trainer.accumulate_grad_batches * self.data_parallel_ranks())

    @override
    def pipeline_batch(self, batch: Batch) -> PipelineBatch:  # type: ignore[override]
        """Token-normalised over the whole step: each micro-batch's summed token loss over the step's share
        (``sum``), exact however the trained tokens fall into the micro-batches."""
        num_items = self._num_items(batch).float()
        positions = "positions" if isinstance(self.model, TinyLlama) else "position_ids"
        inputs = {"input_ids": batch["input_ids"], positions: batch["position_ids"]}

        def loss(output: Any, labels: Tensor) -> Tensor:
            return summed_token_loss(output_logits(output)[:, :-1], labels[:, 1:]) / num_items

        return PipelineBatch(inputs, batch["labels"], loss, "sum")

    @override
    def training_loss(self, batch: Batch) -> TrainingLoss:  # type: ignore[override]
        num_items = self._num_items(batch)
        loss = self._loss(batch, num_items.float())
        trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().clamp_min(1)
        # the mean over this micro-batch's trained tokens, comparable between steps
        return TrainingLoss(loss, loss.detach() * num_items / trained)

    def _loss(self, batch: Batch, num_items: Tensor) -> Tensor:
        """The sum of this micro-batch's token losses over ``num_items``."""
        assert self.model is not None  # configure_model built it
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        context = self.context_parallel()
        if not isinstance(self.model, TinyLlama):
            out = self.model(
                input_ids=ids, labels=labels, position_ids=positions, use_cache=False, num_items_in_batch=num_items
            )
            return out.loss
        if context is None:
            summed = summed_token_loss(self.model(ids, positions)[:, :-1], labels[:, 1:])
            return summed / num_items
        logits, local_labels = self.split_logits(ids, context, labels)
        return context.loss(summed_token_loss(logits, local_labels), num_items)

    @override
    def evaluate(self, batch: Batch) -> None:  # type: ignore[override]
        assert self.model is not None  # configure_model built it
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        if self.schedule.pipelined:
            name = "positions" if isinstance(self.model, TinyLlama) else "position_ids"
            self.evaluate_pipelined({"input_ids": ids, name: positions}, labels)
            return
        context = self.context_parallel()
        if context is not None:  # each rank its part of every row: the metric adds the parts up
            logits, local_labels = self.split_logits(ids, context, labels)
            self.held_out_perplexity.update(logits.float(), local_labels)
            return
        if isinstance(self.model, TinyLlama):
            logits = self.model(ids, positions)
        else:
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        self.held_out_perplexity.update(logits[:, :-1].float(), labels[:, 1:])

    @override
    @classmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        """The loss on the trained tokens before and after, and its perplexity."""
        start = "before" if pretrained else "untrained"
        if untrained is None or trained is None:
            return f"held-out loss on the trained tokens: not evaluated at both ends of the {steps} steps"
        return (
            f"held-out loss on the trained tokens: {math.log(untrained):.4f} {start} -> {math.log(trained):.4f} after"
            f" {steps} steps (perplexity {untrained:.2f} -> {trained:.2f})"
        )
