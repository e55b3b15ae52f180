"""A new objective as a user or a later issue writes one: this file and one registration, nothing else touched.

Next-token prediction with label smoothing, evaluated by held-out next-token accuracy. Run as the runner with the
registration first: ``python tests/recipes/throwaway_objective.py --config ... objective=smoothed_next_token``."""

import sys
from typing import List, Optional

import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_mixedfsdp.recipes.data.text import TextCorpus, data_problems
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
from lightning_mixedfsdp.recipes.objectives.objective import Objective, Schedule, TrainingLoss
from lightning_mixedfsdp.recipes.objectives.registry import OBJECTIVES
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection, Recipe


class SmoothedNextToken(Objective):
    formats = ("text",)
    evaluated = "held-out next-token accuracy"

    def __init__(
        self,
        model: ModelSection,
        schedule: Schedule,
        peft: Optional[PeftSection] = None,
    ) -> None:
        super().__init__(model, schedule, peft)
        self.accuracy = MeanMetric()

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        return TextCorpus(recipe.data, recipe.trainer.seed, recipe.trainer.max_steps)

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        return data_problems(recipe.data, ranks)

    def _logits(self, tokens: Tensor) -> Tensor:
        assert isinstance(self.model, TinyLlama)
        return self.model(tokens)[:, :-1].float()

    @override
    def training_loss(self, tokens: Tensor) -> TrainingLoss:
        logits = self._logits(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), label_smoothing=0.1)
        return TrainingLoss(loss, loss.detach())

    @override
    def evaluate(self, tokens: Tensor) -> None:
        self.accuracy.update((self._logits(tokens).argmax(-1) == tokens[:, 1:]).float())

    @override
    def on_validation_epoch_end(self) -> None:
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        self.evaluations[when] = self.accuracy.compute().item()
        self.accuracy.reset()
        rank_zero_info(f"{self.evaluated} ({when}): {self.evaluations[when]:.4f}")

    @override
    @classmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        return f"{cls.evaluated}: {untrained} -> {trained} after {steps} steps"


if __name__ == "__main__":
    from lightning_mixedfsdp.recipes.run.runner import main

    OBJECTIVES["smoothed_next_token"] = SmoothedNextToken  # the one registration
    main(sys.argv[1:])
