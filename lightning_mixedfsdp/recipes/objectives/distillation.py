"""Distillation: a student (the recipe's ``model``) learns a frozen teacher's token distributions (``teacher.*``),
mixed with its labels' cross-entropy (``distill.*``), on text windows or chat and instruction rows.

The teacher is a second child of the LightningModule whose params are all frozen: the strategy shards it in its own
FSDP units at its storage dtype (no grads, no optimizer state, resharded after each of its forwards), it runs under
``no_grad`` (its forward saves nothing), checkpoints leave it out (it is read from ``teacher.pretrained`` again at
every launch, before a checkpoint is restored, and the checkpoint's fingerprint of the frozen tensors is checked
against it) and the export holds the student alone.

Neither model makes its ``[tokens, vocab]`` logits for the loss: a hook on each model's output projection takes the
hidden states it reads, and hands it an empty sequence instead; ``divergences.distillation_sums`` makes the logits a
chunk of tokens at a time. The student's projection weight is the one FSDP gathered for its forward and keeps until
its backward (the root group's, which FSDP does not reshard after the forward: checked at every step); the teacher's
is copied out of its forward, one gathered unit.

Normalisation as for SFT: each micro-batch's loss is its token sums over the step's trained tokens divided by the
micro-batches and data-parallel ranks (text windows: every token; chat: the assistant tokens)."""

from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.load import load_full_weights
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.model.quantized import dequantized
from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.sft import FINE_TUNING
from lightning_mixedfsdp.recipes.data.text import TextCorpus
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
from lightning_mixedfsdp.recipes.objectives.divergences import DIVERGENCES, distillation_sums
from lightning_mixedfsdp.recipes.objectives.frozen import (
    composition_problems,
    frozen_model,
    frozen_model_needs,
    leave_out_of_checkpoints,
    storage_problems,
)
from lightning_mixedfsdp.recipes.objectives.language_modeling import CausalLM
from lightning_mixedfsdp.recipes.objectives.objective import Schedule, TrainingLoss
from lightning_mixedfsdp.recipes.objectives.sft import ChatLM
from lightning_mixedfsdp.recipes.settings.inputs import (
    hf_config_fields,
    is_byte_tokenizer,
    load_hf_tokenizer,
    model_vocab_size,
    pretrained_problems,
    resolved_format,
    tokenizer_vocab_size,
)
from lightning_mixedfsdp.recipes.settings.schema import (
    DistillSection,
    ModelSection,
    PeftSection,
    Recipe,
    TeacherSection,
)

TEACHER = "teacher"
"""The teacher's attribute on the LightningModule: the prefix its tensors would have in a state dict."""


class Distillation(ChatLM):
    """The student (``model``) and the frozen teacher (``teacher``); see the module's docstring."""

    pipelines = False  # a second model (the teacher) in each step: not split into stages yet

    formats: ClassVar[Tuple[str, ...]] = ("text", *FINE_TUNING)
    evaluated = "the student's held-out perplexity"

    def __init__(
        self,
        model: ModelSection,
        schedule: Schedule,
        peft: Optional[PeftSection] = None,
        teacher: Optional[TeacherSection] = None,
        distill: Optional[DistillSection] = None,
        vocab: int = 256,
    ) -> None:
        super().__init__(model, schedule, peft)
        self.teacher_section, self.distill = teacher or TeacherSection(), distill or DistillSection()
        self.vocab = vocab
        """The tokenizer's tokens: the rows of both output projections the divergence compares."""
        self.teacher: Optional[nn.Module] = None
        if self.model is not None:  # a reference student: a reference teacher (an export of one) is built here too
            self.teacher = frozen_model(self._teacher_folder)
        self.teacher_perplexity = Perplexity(ignore_index=IGNORE_INDEX)
        self.teacher_evaluation: Optional[float] = None
        """The teacher's held-out perplexity (the sanity check's)."""
        leave_out_of_checkpoints(self, TEACHER)

    # -- what a batch holds

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        if resolved_format(recipe.data) in FINE_TUNING:
            return ChatLM.data(recipe)
        return CausalLM.data(recipe)

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        if resolved_format(recipe.data) in FINE_TUNING:
            return ChatLM.data_problems(recipe, ranks)
        return CausalLM.data_problems(recipe, ranks)

    @override
    @classmethod
    def asked_for(cls, recipe: Recipe) -> Optional[str]:
        return "teacher.pretrained" if recipe.teacher.pretrained is not None else None

    @override
    @classmethod
    def recipe_problems(cls, recipe: Recipe) -> List[str]:
        return distillation_problems(recipe)

    @override
    @classmethod
    def other_models(cls, recipe: Recipe) -> Dict[str, nn.Module]:
        assert recipe.teacher.pretrained is not None  # checked before launch
        return {TEACHER: frozen_model(recipe.teacher.pretrained)}

    @override
    @classmethod
    def strategy_needs(cls, recipe: Recipe, config: MixedFSDPConfig) -> None:
        """The teacher's fp32 tensors stay fp32 (as a pretrained student's); ``teacher.quantize=nf4``: its Linear
        weights in 4 bits, ``teacher.offload=cpu``: its units' shards on the host (the student trains all of its
        params, so the teacher's are the only frozen ones)."""
        teacher = recipe.teacher
        if teacher.pretrained is not None:
            frozen_model_needs(config, teacher.pretrained, teacher.quantize, teacher.offload)

    @override
    @classmethod
    def recipe_settings(cls, recipe: Recipe) -> Dict[str, Any]:
        vocab = tokenizer_vocab_size(recipe.data.tokenizer, recipe.data.trust_remote_code)
        return {"teacher": recipe.teacher, "distill": recipe.distill, "vocab": vocab}

    # -- the models

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if self.teacher is None:
            self.teacher = frozen_model(self._teacher_folder)

    @override
    def on_fit_start(self) -> None:
        """The teacher from its folder at every launch: checkpoints leave it out, and Lightning restores a checkpoint
        (whose fingerprint of the frozen tensors is compared with these) after this hook."""
        super().on_fit_start()
        assert self.teacher is not None
        load_full_weights(self.teacher, self._teacher_folder)

    @property
    def _teacher_folder(self) -> str:
        folder = self.teacher_section.pretrained
        assert folder is not None  # checked before launch
        return folder

    # -- the loss

    @override
    def training_loss(self, batch: Any) -> TrainingLoss:
        ids, labels, positions = _rows(batch)
        assert self.model is not None and self.teacher is not None  # configure_model built them
        with torch.no_grad():
            teacher_hidden, teacher_weight = hidden_and_output_weight(self.teacher, ids, positions, "teacher")
        student_hidden, student_weight = hidden_and_output_weight(self.model, ids, positions, "student")
        sums = distillation_sums(
            student_hidden[:, :-1],
            student_weight,
            teacher_hidden[:, :-1],
            teacher_weight,
            labels[:, 1:],
            self.vocab,
            self.distill.loss,  # type: ignore[arg-type]  # checked before launch
            self.distill.temperature,
            self.distill.chunk_tokens,
        )
        tokens = max(sums.tokens, 1)
        if isinstance(batch, dict):  # the step's trained tokens, shared by its micro-batches and ranks
            shares = self.trainer.accumulate_grad_batches * self.data_parallel_ranks()
            num_items = float(batch["step_tokens"][0].double() / shares)
        else:  # text windows: every micro-batch trains as many tokens
            num_items = float(tokens)
        weight = self.distill.weight
        loss = (weight * sums.divergence + (1 - weight) * sums.cross_entropy) / num_items
        self.log("train_kd_loss", sums.divergence.detach() / tokens)
        self.log("train_ce_loss", sums.cross_entropy.detach() / tokens)
        return TrainingLoss(loss, loss.detach() * num_items / tokens)

    @override
    def on_after_backward(self) -> None:
        """The loss's backward has remade its chunks from both output weights: their units reshard now."""
        super().on_after_backward()
        assert self.model is not None and self.teacher is not None
        release_output_unit(self.teacher)
        release_output_unit(self.model)

    # -- what is evaluated

    @override
    def evaluate(self, batch: Any) -> None:
        ids, labels, positions = _rows(batch)
        super().evaluate({"input_ids": ids, "labels": labels, "position_ids": positions})
        if self.trainer.sanity_checking:  # the teacher's, once
            assert self.teacher is not None
            logits = _logits(self.teacher, ids, positions)
            self.teacher_perplexity.update(logits[:, :-1].float(), labels[:, 1:])
            release_output_unit(self.teacher)

    @override
    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if not self.trainer.sanity_checking:
            return
        self.teacher_evaluation = self.teacher_perplexity.compute().item()
        self.teacher_perplexity.reset()
        rank_zero_info(f"the teacher's held-out perplexity: {self.teacher_evaluation:.2f}")
        if self.logger is not None:
            self.logger.log_metrics({"teacher_ppl": self.teacher_evaluation}, step=0)

    @override
    @classmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        return "the student's " + CausalLM.summary(untrained, trained, steps, pretrained)


def distillation_problems(recipe: Recipe) -> List[str]:
    """What distillation needs of the recipe, all at once, each with its fix."""
    teacher, distill = recipe.teacher, recipe.distill
    problems = []
    if teacher.pretrained is None:
        problems.append(
            "objective='distillation' needs a teacher: set teacher.pretrained to a local HF model directory or one"
            " of this project's exports"
        )
    problems += storage_problems("teacher.", teacher.quantize, teacher.offload)
    if distill.loss not in DIVERGENCES:
        problems.append(f"distill.loss={distill.loss!r}: use one of {', '.join(DIVERGENCES)}")
    if not distill.temperature > 0:
        problems.append(f"distill.temperature={distill.temperature} must be > 0, e.g. 1.0")
    if not 0 <= distill.weight <= 1:
        problems.append(f"distill.weight={distill.weight} must be in [0, 1] (1: the divergence only, 0: labels only)")
    if distill.chunk_tokens < 1:
        problems.append(f"distill.chunk_tokens={distill.chunk_tokens} must be >= 1, e.g. 1024")
    strategy = recipe.strategy
    problems += composition_problems(
        "distillation",
        strategy.parallelism.context_parallel_size,
        strategy.fault_tolerance is not None,
        "the loss reads each model's hidden states whole",
    )
    if teacher.pretrained is not None:
        problems += _teacher_problems(recipe, teacher.pretrained)
    return problems


def _teacher_problems(recipe: Recipe, folder: str) -> List[str]:
    """The teacher's folder: its config, its logits unsoftcapped, its tokenizer the data's, its vocabulary wide
    enough."""
    missing = pretrained_problems("teacher.pretrained", folder)
    if missing:
        return missing
    problems = []
    source = ModelSection(pretrained=folder)
    fields = hf_config_fields(folder)
    if fields.get("final_logit_softcapping") is not None:
        problems.append(
            f"teacher.pretrained={folder!r} caps its logits (final_logit_softcapping), which the chunked loss does"
            " not apply; distil from a model without it"
        )
    data = recipe.data
    tokenizer_problem = _tokenizer_problem(folder, data.tokenizer, data.trust_remote_code)
    if tokenizer_problem is not None:
        return problems + [tokenizer_problem]
    vocab = tokenizer_vocab_size(data.tokenizer, data.trust_remote_code)
    for key, model in (("teacher.pretrained", source), ("model", recipe.model)):
        size = model_vocab_size(model)
        if size is not None and size < vocab:
            problems.append(
                f"{key}: its vocabulary has {size} rows, fewer than the tokenizer's {vocab} tokens; use a model"
                " whose embedding covers the tokenizer"
            )
    return problems


def _tokenizer_problem(folder: str, data_tokenizer: str, trust_remote_code: bool) -> Optional[str]:
    """The teacher's tokenizer against the data's (the student's): the same tokens, or the refusal naming both."""
    teacher_bytes = is_byte_tokenizer(folder)
    data_bytes = data_tokenizer == "bytes" or is_byte_tokenizer(data_tokenizer)
    if teacher_bytes and data_bytes:
        return None
    if not teacher_bytes and not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"teacher.pretrained={folder!r} holds no tokenizer: save the teacher's tokenizer beside it, so that it"
            " can be compared with data.tokenizer's"
        )
    teacher_vocab = _vocabulary(folder, teacher_bytes, trust_remote_code)
    data_vocab = _vocabulary(data_tokenizer, data_bytes, trust_remote_code)
    if teacher_vocab == data_vocab:
        return None
    return (
        f"teacher.pretrained={folder!r} tokenizes differently from data.tokenizer={data_tokenizer!r} (the teacher's"
        f" {len(teacher_vocab)} tokens, the data's {len(data_vocab)}): distillation compares the two models token"
        " by token; use a teacher and a student that share a tokenizer"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _vocabulary(source: str, byte_level: bool, trust_remote_code: bool) -> Dict[str, int]:
    if byte_level:
        return {f"<byte {index}>": index for index in range(256)}
    return dict(load_hf_tokenizer(source, trust_remote_code).get_vocab())


def _rows(batch: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """``input_ids``, unshifted ``labels`` and ``position_ids`` of a chat batch, or of a text batch (every token its
    own label)."""
    if isinstance(batch, dict):
        return batch["input_ids"], batch["labels"], batch["position_ids"]
    positions = torch.arange(batch.shape[1], device=batch.device).expand_as(batch)
    return batch, batch, positions


def _forward(model: nn.Module, ids: Tensor, positions: Tensor) -> Any:
    if isinstance(model, TinyLlama):
        return model(ids, positions)
    return model(input_ids=ids, position_ids=positions, use_cache=False)


def _logits(model: nn.Module, ids: Tensor, positions: Tensor) -> Tensor:
    out = _forward(model, ids, positions)
    return out if isinstance(out, Tensor) else out.logits


def output_projection(model: nn.Module) -> nn.Module:
    """The module that turns a model's final hidden states into logits."""
    if isinstance(model, TinyLlama):
        return model.output
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Module) or not isinstance(getattr(head, "weight", None), Tensor):
        raise ValueError(f"distillation: {type(model).__name__} has no output projection with a weight")
    return head


def hidden_and_output_weight(model: nn.Module, ids: Tensor, positions: Tensor, who: str) -> Tuple[Tensor, Tensor]:
    """The hidden states ``model``'s output projection reads for ``ids``, and its weight; the projection itself makes
    no logits (its hook hands it an empty sequence).

    FSDP would reshard the output projection's unit when the forward ends (the teacher's, run under ``no_grad``; a
    LoRA student's, whose frozen head sits in a unit of its own); that unit stays gathered instead, so the loss reads
    the weight where it is, without a copy, until :func:`release_output_unit` after the loss's backward (which
    remakes each chunk's logits from it). A trained head is in the root unit, which FSDP keeps gathered until the
    backward anyway, and which reduces the chunks' gradients with the rest."""
    head = output_projection(model)
    unit = _output_unit(model)
    if unit is not None:
        unit.set_reshard_after_forward(False, recurse=False)
    seen: Dict[str, Tensor] = {}

    def take(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        hidden = args[0]
        seen["hidden"] = hidden
        weight = module.weight
        assert isinstance(weight, Tensor)
        seen["weight"] = dequantized(weight.detach()) if who == "teacher" else weight
        return (hidden[..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        _forward(model, ids, positions)
    finally:
        handle.remove()
    weight = seen["weight"]
    if weight.untyped_storage().size() == 0:
        raise RuntimeError(
            f"distillation: the {who}'s output projection was resharded when its forward ended, so the loss, which"
            " reads its weight after the forward, would find it freed. It must be in the root FSDP unit (FSDP keeps"
            " the root's params gathered until the backward); do not make it a wrap unit of its own."
        )
    return seen["hidden"], weight


def release_output_unit(model: nn.Module) -> None:
    """Reshards the FSDP unit :func:`hidden_and_output_weight` kept gathered for ``model`` (nothing if none is)."""
    unit = _output_unit(model)
    if unit is not None:
        unit.reshard()


def _output_unit(model: nn.Module) -> Optional[Any]:
    """The FSDP unit that gathers ``model``'s output projection: its innermost ``fully_shard``-ed ancestor."""
    from torch.distributed.fsdp import FSDPModule

    head = output_projection(model)
    owner = None
    for module in model.modules():  # ancestors before descendants: the last one holding the head is the innermost
        if isinstance(module, FSDPModule) and any(m is head for m in module.modules()):
            owner = module
    return owner
