"""Image-text fine-tuning: an HF image-text model (``AutoModelForImageTextToText``) on image-text conversations
(``data/vision.py``), the loss on the assistant turns only, normalised over the step's trained tokens as in
:class:`~lightning_mixedfsdp.recipes.objectives.sft.ChatLM`. Its tower is frozen unless ``model.freeze`` says
otherwise (``models/hf.py``).

Evaluated by held-out perplexity on the trained tokens and by the held-out answer accuracy: the share of rows with
an image whose every answer token is the model's most likely next token (teacher-forced, which is greedy decoding
for an answer it gets right)."""

from typing import ClassVar, Dict, List, Optional, Tuple

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics.aggregation import SumMetric
from typing_extensions import override

from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.text import TextCorpus
from lightning_mixedfsdp.recipes.data.vision import VisionCorpus, model_inputs, vision_data_problems
from lightning_mixedfsdp.recipes.models.hf import is_image_text
from lightning_mixedfsdp.recipes.objectives.objective import Schedule
from lightning_mixedfsdp.recipes.objectives.sft import ChatLM
from lightning_mixedfsdp.recipes.settings.inputs import load_hf_config, model_vocab_size, reference_model_config
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection, Recipe

Batch = Dict[str, Tensor]
VISION_FORMAT = "vision"


def model_key(recipe: Recipe) -> Optional[str]:
    """The recipe key naming an image-text model (``model.pretrained`` or ``model.hf_config``), or None."""
    model = recipe.model
    if model.hf_source() is None:
        return None
    try:
        image_text = reference_model_config(model) is None and is_image_text(
            load_hf_config(model.hf_source(), model.trust_remote_code)
        )
    except (FileNotFoundError, ValueError):  # named by the inputs' own checks
        return None
    if not image_text:
        return None
    return "model.pretrained" if model.pretrained is not None else "model.hf_config"


class VisionChatLM(ChatLM):
    """:class:`ChatLM` for an image-text model: rows with images (and text-only ones), one per row."""

    pipelines = False  # an image tower beside the decoder: not split into stages yet

    formats: ClassVar[Tuple[str, ...]] = (VISION_FORMAT, "chat")
    evaluated = "held-out perplexity on the trained tokens"

    def __init__(self, model: ModelSection, schedule: Schedule, peft: Optional[PeftSection] = None) -> None:
        super().__init__(model, schedule, peft)
        self.answers_right = SumMetric()
        self.answers = SumMetric()
        self.accuracies: Dict[str, float] = {}
        """The held-out answer accuracy of this launch's evaluations: ``untrained``, ``step N``."""

    @override
    @classmethod
    def asked_for(cls, recipe: Recipe) -> Optional[str]:
        return model_key(recipe)

    @override
    @classmethod
    def recipe_problems(cls, recipe: Recipe) -> List[str]:
        problems = []
        if model_key(recipe) is None:
            problems.append(
                "data: the rows hold images, and the model is not an image-text model; set model.pretrained (or"
                " model.hf_config) to one AutoModelForImageTextToText builds (Llava, Qwen2-VL, Gemma 3, ...)"
            )
        context = recipe.strategy.parallelism.context_parallel_size
        if context != 1:
            problems.append(
                f"strategy.parallelism.context_parallel_size={context} splits every sequence across ranks, and an"
                " image's features go to its image tokens, wherever they fall; set it to 1 for image-text models"
            )
        return problems

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        micro_batches = recipe.trainer.max_steps * recipe.trainer.accumulate_grad_batches
        accumulate = recipe.trainer.accumulate_grad_batches
        return VisionCorpus(recipe.data, recipe.model.pretrained, recipe.trainer.seed, micro_batches, accumulate)

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        model = recipe.model
        config = load_hf_config(model.hf_source(), model.trust_remote_code) if model_key(recipe) is not None else None
        image_token = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
        vocab = model_vocab_size(recipe.model)
        return vision_data_problems(recipe.data, recipe.model.pretrained, ranks, vocab, image_token)

    @override
    def _loss(self, batch: Batch, num_items: Tensor) -> Tensor:
        assert self.model is not None  # configure_model built it
        inputs = model_inputs(batch)
        out = self.model(**inputs, labels=batch["labels"], use_cache=False, num_items_in_batch=num_items)
        return out.loss

    @override
    def evaluate(self, batch: Batch) -> None:  # type: ignore[override]
        assert self.model is not None  # configure_model built it
        logits = self.model(**model_inputs(batch), use_cache=False).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        self.held_out_perplexity.update(logits.float(), targets)
        answered = targets != IGNORE_INDEX
        right = ((logits.argmax(dim=-1) == targets) | ~answered).all(dim=1) & answered.any(dim=1)
        counted = batch["has_image"]
        self.answers_right.update((right & counted).sum().float())
        self.answers.update(counted.sum().float())

    @override
    def on_validation_epoch_end(self) -> None:
        right, total = self.answers_right.compute(), self.answers.compute()
        self.answers_right.reset()
        self.answers.reset()
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        accuracy = float(right / total) if float(total) > 0 else float("nan")
        self.accuracies[when] = accuracy
        rank_zero_info(f"held-out answer accuracy ({when}): {accuracy:.1%} of {int(total)} questions about images")
        if not self.trainer.sanity_checking:
            self.log("val_accuracy", torch.tensor(accuracy), sync_dist=True)  # equal on all ranks already
        super().on_validation_epoch_end()

    @override
    def on_fit_end(self) -> None:
        first, last = self.accuracies.get("untrained"), self.accuracies.get(f"step {self.global_step}")
        if first is not None and last is not None:
            rank_zero_info(f"held-out answer accuracy: {first:.1%} before -> {last:.1%} after {self.global_step} steps")
