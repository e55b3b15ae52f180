"""Preference tuning: the policy (the recipe's ``model``, from ``model.pretrained``) learns to prefer each pair's chosen
answer over its rejected one, measured against a frozen reference (``preference.*``): DPO's sigmoid loss or IPO's.

Each micro-batch holds ``data.batch_size`` pairs, both answers of a pair in one forward. An answer's log-probability
is the sum of its trained tokens' (the answer and its end-of-turn marker; the prompt untrained); IPO takes their
mean. Per pair, with the policy's ``pc``, ``pr`` and the reference's ``rc``, ``rr`` (chosen, rejected):

- ``sigmoid`` (DPO): ``-log sigmoid(beta ((pc - rc) - (pr - rr)))``
- ``ipo``: ``((pc - rc) - (pr - rr) - 1 / (2 beta))**2``, on per-token means

plus ``sft_weight`` times the chosen answer's per-token negative log-likelihood. The loss is the mean over the
micro-batch's pairs: every micro-batch holds as many, so Lightning's division by ``accumulate_grad_batches`` and
FSDP's average over the ranks make it the mean over the step's pairs.

The reference (``preference.reference``) is one of:

- ``copy`` (the default without peft): the frozen copy of the starting weights, a second child of the LightningModule
  held as distillation's teacher is (``frozen.py``): sharded at its storage dtype, no grads, no optimizer state, read
  from ``model.pretrained`` at every launch, left out of checkpoints and the export;
- ``adapters_off`` (the default with peft): the policy itself with its LoRA adapters disabled (peft's
  ``disable_adapter``), which is the starting weights, since only the adapters train: no second model;
- ``precomputed``: the policy's scores at its starting weights, of every pair, computed before training and stored
  with the run (``precomputed_reference.py``): no reference model in training.

Logged: each pair's rewards ``beta (pc - rc)`` and ``beta (pr - rr)``, their margin and accuracy (the chosen reward
above the rejected one; a tie counts half), in training (``train_``) and on the held-out pairs (``val_``, with the
held-out loss and how often the policy itself gives the chosen answer the higher log-probability)."""

from typing import Any, ClassVar, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.load import load_full_weights
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.preference import PREFERENCE, PreferenceCorpus, pair_batch, preference_problems
from lightning_mixedfsdp.recipes.data.text import TextCorpus
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
from lightning_mixedfsdp.recipes.objectives.frozen import (
    composition_problems,
    frozen_model,
    frozen_model_needs,
    leave_out_of_checkpoints,
    storage_problems,
)
from lightning_mixedfsdp.recipes.objectives.objective import Objective, Schedule, TrainingLoss, before_after
from lightning_mixedfsdp.recipes.objectives.precomputed_reference import StoredScores, looked_up, stored_or_scored
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection, PreferenceSection, Recipe

REFERENCE = "reference"
"""The reference's attribute on the LightningModule."""
LOSSES = ("sigmoid", "ipo")
COPY, ADAPTERS_OFF, PRECOMPUTED = "copy", "adapters_off", "precomputed"
REFERENCES = (COPY, ADAPTERS_OFF, PRECOMPUTED)


def reference_kind(settings: PreferenceSection, peft_enabled: bool) -> str:
    """``preference.reference``, or its default: ``adapters_off`` with peft, ``copy`` without."""
    if settings.reference is not None:
        return settings.reference
    return ADAPTERS_OFF if peft_enabled else COPY


class PreferenceScores(NamedTuple):
    loss: Tensor
    """Each pair's loss (the SFT term included)."""
    chosen_reward: Tensor
    rejected_reward: Tensor
    policy_prefers_chosen: Tensor
    """Whether the policy itself gives the chosen answer the higher log-probability."""


def preference_scores(
    policy: Tuple[Tensor, Tensor],
    reference: Tuple[Tensor, Tensor],
    tokens: Tuple[Tensor, Tensor],
    kind: str,
    beta: float,
    sft_weight: float,
) -> PreferenceScores:
    """The pairs' losses and rewards from the summed log-probabilities of the chosen and rejected answers under the
    policy and the reference, and the answers' trained tokens (see the module's docstring)."""
    (pc, pr), (rc, rr), (nc, nr) = policy, reference, (tokens[0].clamp_min(1), tokens[1].clamp_min(1))
    if kind == "ipo":
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    chosen_reward, rejected_reward = beta * (pc - rc), beta * (pr - rr)
    if kind == "sigmoid":
        loss = -F.logsigmoid(chosen_reward - rejected_reward)
    else:
        loss = ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2
    if sft_weight:
        loss = loss + sft_weight * -policy[0] / nc
    return PreferenceScores(loss, chosen_reward.detach(), rejected_reward.detach(), (policy[0] > policy[1]).detach())


def answer_log_probs(model: nn.Module, ids: Tensor, labels: Tensor, positions: Tensor) -> Tuple[Tensor, Tensor]:
    """Each row's summed log-probability of its trained tokens (labels not ``IGNORE_INDEX``), in fp32, and their
    count."""
    if isinstance(model, TinyLlama):
        logits = model(ids, positions)
    else:
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    targets = labels[:, 1:]
    trained = targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (picked * trained).sum(-1), trained.sum(-1)


class PreferenceTuning(Objective):
    """The policy (``model``) and its reference (see the module's docstring); ``run_folder``: where a precomputed
    reference's scores are stored (None: nowhere, scored at every launch)."""

    formats: ClassVar[Tuple[str, ...]] = (PREFERENCE,)
    evaluated = "held-out reward accuracy"

    def __init__(
        self,
        model: ModelSection,
        schedule: Schedule,
        peft: Optional[PeftSection] = None,
        preference: Optional[PreferenceSection] = None,
        run_folder: Optional[str] = None,
    ) -> None:
        super().__init__(model, schedule, peft)
        self.preference = preference or PreferenceSection()
        self.reference_kind = reference_kind(self.preference, self.peft.enabled)
        self.run_folder = run_folder
        self.reference: Optional[nn.Module] = None
        if self.model is not None and self.reference_kind == COPY:  # a reference-model policy: its copy too
            self.reference = frozen_model(self._starting_weights)
        self.precomputed: Dict[str, Tensor] = {}
        """A precomputed reference's scores: ``train`` and ``held_out``, ``[pairs, 2]`` (chosen, rejected)."""
        self.held_out = {name: MeanMetric() for name in ("loss", "reward_accuracy", "reward_margin", "prefers")}
        self.add_module("held_out_metrics", nn.ModuleDict(self.held_out))  # moved to the device with the module
        self.preference_rates: Dict[str, float] = {}
        """How often the policy prefers the chosen answer on the held-out pairs: ``untrained``, ``step N``."""
        leave_out_of_checkpoints(self, REFERENCE)

    @property
    def _starting_weights(self) -> str:
        assert self.model_section.pretrained is not None  # checked before launch
        return self.model_section.pretrained

    # -- what a batch holds

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        micro_batches = recipe.trainer.max_steps * recipe.trainer.accumulate_grad_batches
        return PreferenceCorpus(recipe.data, recipe.trainer.seed, micro_batches)

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        return preference_problems(recipe.data, ranks)

    @override
    @classmethod
    def recipe_problems(cls, recipe: Recipe) -> List[str]:
        return preference_tuning_problems(recipe)

    @override
    @classmethod
    def other_models(cls, recipe: Recipe) -> Dict[str, nn.Module]:
        assert recipe.model.pretrained is not None  # checked before launch
        if reference_kind(recipe.preference, recipe.peft.enabled) != COPY:
            return {}
        return {REFERENCE: frozen_model(recipe.model.pretrained)}

    @override
    @classmethod
    def strategy_needs(cls, recipe: Recipe, config: MixedFSDPConfig) -> None:
        settings = recipe.preference
        copy = reference_kind(settings, recipe.peft.enabled) == COPY
        if recipe.model.pretrained is not None and copy:
            frozen_model_needs(config, recipe.model.pretrained, settings.reference_quantize, settings.reference_offload)

    @override
    @classmethod
    def recipe_settings(cls, recipe: Recipe) -> Dict[str, Any]:
        return {"preference": recipe.preference, "run_folder": recipe.output.dir}

    # -- the models

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if self.reference is None and self.reference_kind == COPY:
            self.reference = frozen_model(self._starting_weights)

    @override
    def on_fit_start(self) -> None:
        """The reference from the starting weights at every launch (checkpoints leave it out; Lightning restores a
        checkpoint after this hook): the copy's weights, or the precomputed scores."""
        super().on_fit_start()
        if self.reference_kind == COPY:
            assert self.reference is not None
            load_full_weights(self.reference, self._starting_weights)
        elif self.reference_kind == PRECOMPUTED:
            assert self.model is not None
            model, datamodule, folder = self.model, self.trainer.datamodule, self._starting_weights  # type: ignore[attr-defined]
            resumed = self.trainer.ckpt_path is not None  # its own weights are restored after this hook
            self.precomputed = stored_or_scored(
                lambda ids, labels, positions: answer_log_probs(model, ids, labels, positions)[0],
                {"train": datamodule.train_set, "held_out": datamodule.val_set},
                datamodule.data.batch_size,
                self.device,
                StoredScores(self.run_folder, folder),
                self.trainer.strategy,
                (lambda: load_full_weights(model, folder)) if resumed else None,
            )

    # -- the loss

    def reference_scores(self, batch: Dict[str, Tensor], split: str) -> Tensor:
        """The reference's summed log-probabilities of the micro-batch's rows (:func:`pair_batch`'s order); ``split``
        (``train`` or ``held_out``) says where a precomputed reference looks them up."""
        ids, labels, positions = pair_batch(batch)
        if self.reference_kind == PRECOMPUTED:
            return looked_up(self.precomputed[split], batch["pair_index"])
        with torch.no_grad():
            if self.reference_kind == ADAPTERS_OFF:
                assert self.model is not None
                with self.model.disable_adapter():  # type: ignore[operator]  # a PeftModel (checked before launch)
                    return answer_log_probs(self.model, ids, labels, positions)[0]
            assert self.reference is not None  # configure_model built it
            return answer_log_probs(self.reference, ids, labels, positions)[0]

    def scores(self, batch: Dict[str, Tensor], split: str) -> PreferenceScores:
        assert self.model is not None  # configure_model built it
        reference = self.reference_scores(batch, split)
        policy, tokens = answer_log_probs(self.model, *pair_batch(batch))
        mine, theirs, counts = (
            (rows[: len(rows) // 2], rows[len(rows) // 2 :]) for rows in (policy, reference, tokens)
        )
        settings = self.preference
        return preference_scores(mine, theirs, counts, settings.loss, settings.beta, settings.sft_weight)

    @override
    def training_loss(self, batch: Dict[str, Tensor]) -> TrainingLoss:
        scores = self.scores(batch, "train")
        margin = scores.chosen_reward - scores.rejected_reward
        self.log("train_rewards_chosen", scores.chosen_reward.mean())
        self.log("train_rewards_rejected", scores.rejected_reward.mean())
        self.log("train_reward_margin", margin.mean())
        self.log("train_reward_accuracy", _accuracy(margin).mean())
        loss = scores.loss.mean()
        return TrainingLoss(loss, loss.detach())

    # -- what is evaluated

    @override
    def evaluate(self, batch: Dict[str, Tensor]) -> None:
        scores = self.scores(batch, "held_out")
        margin = scores.chosen_reward - scores.rejected_reward
        for name, values in (
            ("loss", scores.loss),
            ("reward_accuracy", _accuracy(margin)),
            ("reward_margin", margin),
            ("prefers", scores.policy_prefers_chosen.float()),
        ):
            self.held_out[name].update(values.detach().float())

    @override
    def on_validation_epoch_end(self) -> None:
        values = {name: _computed_and_reset(metric) for name, metric in self.held_out.items()}
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        self.evaluations[when] = values["reward_accuracy"]
        self.preference_rates[when] = values["prefers"]
        rank_zero_info(
            f"{self.evaluated} ({when}): {values['reward_accuracy']:.3f}, margin {values['reward_margin']:.4f},"
            f" loss {values['loss']:.4f}; the model prefers the chosen answer in {values['prefers']:.1%} of the"
            " held-out pairs"
        )
        if not self.trainer.sanity_checking:
            for name, value in values.items():
                key = "val_policy_prefers_chosen" if name == "prefers" else f"val_{name}"
                # equal on all ranks already (the metrics reduce over them)
                self.log(key, value, prog_bar=name == "reward_accuracy", sync_dist=True)
        elif self.logger is not None:
            self.logger.log_metrics({"untrained_policy_prefers_chosen": values["prefers"]}, step=0)

    @override
    @classmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        return before_after(cls.evaluated, untrained, trained, steps)


def _computed_and_reset(metric: MeanMetric) -> float:
    value = metric.compute().item()
    metric.reset()
    return value


def _accuracy(margin: Tensor) -> Tensor:
    """1 where the chosen reward is above the rejected one, 0.5 for a tie (the untrained policy is its reference)."""
    return (margin > 0).float() + 0.5 * (margin == 0).float()


def preference_tuning_problems(recipe: Recipe) -> List[str]:
    """What preference tuning needs of the recipe, all at once, each with its fix."""
    settings = recipe.preference
    problems = []
    if recipe.model.pretrained is None:
        problems.append(
            "preference tuning compares the policy with a frozen copy of its starting weights: set model.pretrained"
            " to the model to tune (an SFT run's export, or a save_pretrained() directory)"
        )
    kind = reference_kind(settings, recipe.peft.enabled)
    if kind not in REFERENCES:
        problems.append(f"preference.reference={kind!r}: use one of {', '.join(REFERENCES)}")
    if kind == ADAPTERS_OFF and not recipe.peft.enabled:
        problems.append(
            "preference.reference=adapters_off is the policy's base with its LoRA adapters disabled, and peft is off:"
            " set peft.enabled=true, or use preference.reference=copy or precomputed"
        )
    if kind == COPY and recipe.peft.enabled:
        problems.append(
            "preference.reference=copy with peft.enabled=true would hold a second copy of the frozen base the"
            " adapters sit on: use preference.reference=adapters_off (the default with peft) or precomputed"
        )
    if kind != COPY and (settings.reference_quantize, settings.reference_offload) != ("none", "none"):
        problems.append(
            f"preference.reference_quantize and reference_offload set how a copied reference is held, and"
            f" preference.reference={kind!r} holds none: leave them at none, or use preference.reference=copy"
        )
    problems += storage_problems("preference.reference_", settings.reference_quantize, settings.reference_offload)
    if settings.loss not in LOSSES:
        problems.append(f"preference.loss={settings.loss!r}: use one of {', '.join(LOSSES)}")
    if not settings.beta > 0:
        problems.append(f"preference.beta={settings.beta} must be > 0, e.g. 0.1")
    if settings.sft_weight < 0:
        problems.append(f"preference.sft_weight={settings.sft_weight} must be >= 0 (0: off)")
    strategy = recipe.strategy
    problems += composition_problems(
        "preference tuning",
        strategy.parallelism.context_parallel_size,
        strategy.fault_tolerance is not None,
        "an answer's log-probability would be summed over the ranks' parts",
    )
    return problems
