"""Supervised fine-tuning: the recipes' causal LM on chat or instruction rows (``chat_corpus.py``), the loss on the
trained tokens only (the assistant turns, the completions).

Each micro-batch's loss is the sum of its token losses over ``num_items``: the step's trained tokens (every
micro-batch, every data-parallel rank: ``step_tokens``, which the stream carries) divided by
``accumulate_grad_batches`` and the data-parallel ranks, since Lightning divides each micro-batch's loss by the first
and FSDP averages gradients over the second. The step's gradient is then the gradient of the sum of its token
losses over its trained tokens, however the rows are split into micro-batches and ranks (transformers'
``num_items_in_batch``, which HF models take as it is). Context-parallel ranks share their rows and split them, as
for the text recipes."""

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.lm import CausalLM
from lightning_mixedfsdp.recipes.models import TinyLlama

Batch = Dict[str, Tensor]


class ChatLM(CausalLM):
    """:class:`CausalLM` on fine-tuning rows: ``input_ids``, unshifted ``labels`` (-100 where nothing is trained),
    ``position_ids`` (restarting at each packed example) and, in training, ``step_tokens``."""

    evaluated = "held-out perplexity on the trained tokens"

    @override
    def training_step(self, batch: Batch, _: int) -> Tensor:  # type: ignore[override]
        ranks = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]  # type: ignore[attr-defined]
        num_items = batch["step_tokens"][0].double() / (self.trainer.accumulate_grad_batches * ranks)
        loss = self._loss(batch, num_items.float())
        trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().clamp_min(1)
        # the mean over this micro-batch's trained tokens, comparable between steps
        self.log("train_loss", loss.detach() * num_items / trained, prog_bar=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def _loss(self, batch: Batch, num_items: Tensor) -> Tensor:
        """The sum of this micro-batch's token losses over ``num_items``."""
        assert self.model is not None  # configure_model built it
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        context = self._context_parallel()
        if not isinstance(self.model, TinyLlama):
            out = self.model(
                input_ids=ids, labels=labels, position_ids=positions, use_cache=False, num_items_in_batch=num_items
            )
            return out.loss
        if context is None:
            summed = _summed_loss(self.model(ids, positions)[:, :-1], labels[:, 1:])
            return summed / num_items
        logits, local_labels = self._split_logits(ids, context, labels)
        return context.loss(_summed_loss(logits, local_labels), num_items)

    @override
    def validation_step(self, batch: Batch, _: int) -> None:  # type: ignore[override]
        assert self.model is not None  # configure_model built it
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        context = self._context_parallel()
        if context is not None:  # each rank its part of every row: the metric adds the parts up
            logits, local_labels = self._split_logits(ids, context, labels)
            self.held_out_perplexity.update(logits.float(), local_labels)
            return
        if isinstance(self.model, TinyLlama):
            logits = self.model(ids, positions)
        else:
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        self.held_out_perplexity.update(logits[:, :-1].float(), labels[:, 1:])

    def trained_loss(self, when: str) -> Optional[float]:
        """The held-out loss on the trained tokens at ``when`` (``untrained``, ``step N``)."""
        perplexity = self.perplexities.get(when)
        return None if perplexity is None else float(torch.tensor(perplexity).log())


def _summed_loss(logits: Tensor, targets: Tensor) -> Tensor:
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
