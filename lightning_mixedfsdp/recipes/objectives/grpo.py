"""Reinforcement learning with verifiable rewards (``objective: grpo``): the policy (the recipe's ``model``) samples
completions of its prompts, a reward scores them, and GRPO's loss (or Dr. GRPO's, or DAPO's) moves it toward the
better ones of each prompt's group.

Each optimizer step, each rank takes ``rl.prompts_per_step`` prompts of its own and samples ``rl.group_size``
completions of each from the current policy (``rl/rollouts.py``), keeping the sampling log-prob of every token. The
reward (``rl/rewards.py``) scores the decoded completions; the loss (``rl/losses.py``) is PPO's clipped ratio of the
training forward's log-probs to the generator's, ``rl.updates_per_rollout`` optimizer steps on each rollout, plus
``rl.beta`` times a k3 KL to a frozen reference (``copy`` or ``adapters_off``, as preference tuning holds them).

Precision: generator and trainer compute the same tokens' probabilities with different kernels (a KV cache one
token at a time, one forward over the sequence), and the importance ratio amplifies their difference. With
``rl.fp32_head`` (the default) the output head is in ``dtypes.fp32_compute_modules``: stored and sharded in bf16,
its matmul and the logits in fp32 in both places, a tied embedding untouched. ``logprob_mismatch`` logs the
difference: the mean over completion tokens of ``|exp(train - generator) - 1|``, from the first training forward
on each rollout; a launch's first rollout above ``rl.mismatch_limit`` raises on every rank (a generator that samples
another distribution than the trainer scores must not train quietly).

Off-policy corrections (``rl.correction``, ``rl/corrections.py``): the loss holds three log-probs, the generator's
(mu), pi_old (the first training forward's on the rollout, detached: the same weights the rollout was sampled
from) and pi_theta. Without a correction PPO's ratio is taken against mu; with one against pi_old, and the
importance weight pi_old / mu (truncated or masked) multiplies the policy-gradient term; rejected tokens leave the
loss and its denominators. Each rollout's first update logs ``token_mult_prob_error`` and ``max_prob_gap`` (and with
a correction ``is_weight_mean``, ``is_masked_fraction``).

Rollouts decode on the sharded model (``rl.generation``): ``gathered`` all-gathers each unit once per rollout and
holds the whole model for its length (``apply/gathered.py``); ``sharded`` keeps FSDP's per-forward all-gathers, and
every rank then runs as many decoding steps as the longest (a flag all-reduced each step). Either way ranks whose
completions differ in length stay in step.

Held out: greedy completions of the held-out prompts, their mean reward (``val_reward``) before training and at each
evaluation; the run ends with ``held-out reward: A before -> B after N steps``. A resume regenerates the rollout of
the step it resumes at from the restored weights and the step's seed, so with ``updates_per_rollout`` 1 it repeats
the straight run; inside a rollout's updates it samples afresh."""

import math
from dataclasses import replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_mixedfsdp.checkpoint.load import load_full_weights
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.model.names import is_peft_model, user_class_name
from lightning_mixedfsdp.recipes.data.prompts import PROMPTS, Prompt, PromptCorpus, prompts_problems
from lightning_mixedfsdp.recipes.data.text import TextCorpus
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
from lightning_mixedfsdp.recipes.objectives.frozen import (
    composition_problems,
    frozen_model,
    frozen_model_needs,
    leave_out_of_checkpoints,
)
from lightning_mixedfsdp.recipes.objectives.objective import (
    Objective,
    Schedule,
    TrainingLoss,
    before_after,
    build_model,
)
from lightning_mixedfsdp.recipes.objectives.rollout_source import RolloutSource
from lightning_mixedfsdp.recipes.rl.corrections import (
    Correction,
    Weights,
    correction_of,
    correction_problems,
    importance_weights,
    mismatch_logs,
)
from lightning_mixedfsdp.recipes.rl.generation import GENERATIONS
from lightning_mixedfsdp.recipes.rl.generator_ranks import GeneratorRanks
from lightning_mixedfsdp.recipes.rl.losses import LOSSES, LossSettings, grpo_loss
from lightning_mixedfsdp.recipes.rl.rewards import (
    EXACT_MATCH,
    load_rewards,
    reward_problems,
    reward_specs,
)
from lightning_mixedfsdp.recipes.rl.rollouts import (
    Rollout,
    Sampling,
    completion_log_probs,
    log_prob_mismatch,
)
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection, Recipe, RlSection

REFERENCE = "reference"
COPY, ADAPTERS_OFF = "copy", "adapters_off"
UNTRAINED_REWARD = "untrained_reward"


def rl_reference_kind(settings: RlSection, peft_enabled: bool) -> Optional[str]:
    """The reference the KL needs: None without one (``beta`` 0), else ``rl.reference`` or its default."""
    if not settings.beta:
        return None
    if settings.reference is not None:
        return settings.reference
    return ADAPTERS_OFF if peft_enabled else COPY


def output_head_name(model: ModelSection) -> str:
    """The qualified name of the model's output embedding (``get_output_embeddings()``; the reference model's
    ``output``), from the model built on the meta device."""
    with torch.device("meta"):
        built = build_model(model, PeftSection())
    if isinstance(built, TinyLlama):
        return "output"
    head = built.get_output_embeddings()  # type: ignore[operator]
    return next(name for name, module in built.named_modules() if module is head)


def needed_fields(settings: RlSection) -> Tuple[str, ...]:
    """The fields every prompt line must hold for the reward."""
    return ("answer",) if any(spec == EXACT_MATCH for spec, _ in reward_specs(settings.reward)) else ()


def starting_weights(model: ModelSection) -> str:
    assert model.pretrained is not None  # checked before launch
    return model.pretrained


def loss_settings(settings: RlSection) -> LossSettings:
    clip_high = settings.clip_high if settings.clip_high is not None else settings.clip
    return LossSettings(settings.loss, settings.group_size, settings.clip, clip_high, settings.max_new_tokens,
                        settings.beta)  # fmt: skip


def reference_log_probs(
    kind: Optional[str],
    policy: Optional[nn.Module],
    reference: Optional[nn.Module],
    rollout: Rollout,
    temperature: float,
    vocab: int,
    top_p: float = 1.0,
) -> Optional[Tensor]:
    """The reference's log-probs of the completion tokens (of its own distribution, filtered as the policy's is): the
    frozen copy's, or the policy's with its adapters off; None without a reference."""
    if kind is None:
        return None
    with torch.no_grad():
        if kind == ADAPTERS_OFF:
            assert policy is not None
            with policy.disable_adapter():  # type: ignore[operator]  # a PeftModel (checked before launch)
                return completion_log_probs(policy, rollout, temperature, vocab, top_p)
        assert reference is not None
        return completion_log_probs(reference, rollout, temperature, vocab, top_p)


def all_ranks_tokens(mask: Tensor, group: Any = None) -> Optional[Tensor]:
    """The completion tokens of every data-parallel rank's rollout (DAPO's denominator); None in one process."""
    return all_ranks_sum(mask.sum().float(), group)


def all_ranks_completions(mask: Tensor, group: Any = None) -> Optional[Tensor]:
    """The completions of every data-parallel rank's rollout that keep a token (GRPO's denominator); None in one
    process."""
    return all_ranks_sum((mask.sum(-1) > 0).sum().float(), group)


def all_ranks_sum(value: Tensor, group: Any = None) -> Optional[Tensor]:
    """``value`` summed over ``group`` (the data-parallel ranks: tensor-parallel ranks share one rollout, which
    must count once)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    dist.all_reduce(value, group=group)
    return value


def mismatch_limit(settings: RlSection, precision: str) -> float:
    """``rl.mismatch_limit``, or the precision's: 1e-3 in fp32 (32-true), 1e-2 in bf16."""
    if settings.mismatch_limit is not None:
        return settings.mismatch_limit
    return 1e-3 if precision == "32-true" else 1e-2


def policy_class_name(model: nn.Module) -> str:
    """The policy's own class (not FSDP's subclass, not peft's wrapper)."""
    return user_class_name(model.get_base_model() if is_peft_model(model) else model)


def check_first_mismatch(mismatch: Tensor, settings: RlSection, precision: str, policy: nn.Module) -> bool:
    """Raise on every rank when any rank's generator and trainer disagree by more than the limit
    (:func:`mismatch_limit`) on the launch's first rollout (the largest over the ranks, all-reduced, so every rank
    raises together): the rollouts would be another distribution's samples, and the loss's ratios against them would
    train on noise. True once checked."""
    limit, model_class = mismatch_limit(settings, precision), policy_class_name(policy)
    worst = mismatch.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if float(worst) > limit:
        raise RuntimeError(
            f"GroupRelativePolicyOptimization: on {model_class}, the first rollout's logprob_mismatch (the mean of"
            f" |p_train / p_generator - 1| over its tokens) is {float(worst):.3g}, above rl.mismatch_limit={limit:g}:"
            " the generator samples another distribution than the trainer scores, so the rollouts are not the"
            " policy's. A cache that decodes differently from the model's forward does this (a recurrent state"
            " fed other inputs than in training); report the model class. Raise rl.mismatch_limit only if the"
            " difference is the kernels' rounding (bf16)."
        )
    return True


def log_generator_mismatch(
    objective: Objective, trained: Tensor, generated: Tensor, mask: Tensor, correction: Correction, weights: Weights
) -> Tensor:
    """Log the generator against the trainer on a rollout's first update (``logprob_mismatch``,
    ``token_mult_prob_error``, ``max_prob_gap``; with a correction its weights' mean and rejected share); the
    mismatch."""
    mismatch = log_prob_mismatch(trained, generated, mask)
    objective.log("logprob_mismatch", mismatch, sync_dist=True)
    logs = mismatch_logs(trained, generated, mask, weights)
    objective.log("token_mult_prob_error", logs["token_mult_prob_error"], sync_dist=True)
    objective.log("max_prob_gap", logs["max_prob_gap"], sync_dist=True, reduce_fx="max")
    if correction.enabled:
        objective.log("is_weight_mean", logs["is_weight_mean"], sync_dist=True)
        objective.log("is_masked_fraction", logs["is_masked_fraction"], sync_dist=True)
    return mismatch


class GroupRelativePolicyOptimization(RolloutSource):
    """The policy, its optional reference, and the rollout in use (see the module's docstring)."""

    formats: ClassVar[Tuple[str, ...]] = (PROMPTS,)
    evaluated = "held-out reward"
    untrained_key = UNTRAINED_REWARD

    def __init__(
        self,
        model: ModelSection,
        schedule: Schedule,
        peft: Optional[PeftSection] = None,
        rl: Optional[RlSection] = None,
        seed: int = 0,
        recipe: Optional[Recipe] = None,
    ) -> None:
        super().__init__(model, schedule, peft)
        self.rl = rl or RlSection()
        self.seed = seed
        self.generators: Optional[GeneratorRanks] = None
        if self.rl.generation == "ranks":
            assert recipe is not None  # from_recipe passes it
            bucket = int(self.rl.sync_bucket_mb * 2**20)
            self.generators = GeneratorRanks(self.rl.generator_ranks, recipe, bucket, self.rl.verify_sync)
        self.rewards = load_rewards(self.rl.reward)
        self.reference_kind = rl_reference_kind(self.rl, self.peft.enabled)
        self.reference: Optional[nn.Module] = None
        if self.model is not None and self.reference_kind == COPY:
            self.reference = frozen_model(starting_weights(self.model_section))
        self.rollout: Optional[Rollout] = None  # in use: sampled at step rollout_index * updates_per_rollout
        self.rollout_index = -1
        self.rollout_rewards: Optional[Tensor] = None
        self.old_log_probs: Optional[Tensor] = None  # pi_old of the rollout in use (rl.correction)
        self.correction = correction_of(self.rl.correction, self.rl.correction_level, self.rl.correction_bounds)
        self.first_update = self.mismatch_checked = False
        self.held_out_reward = MeanMetric()
        leave_out_of_checkpoints(self, REFERENCE)

    # -- what a batch holds

    @override
    @classmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        data = replace(recipe.data, batch_size=recipe.rl.prompts_per_step)
        return PromptCorpus(data, recipe.trainer.seed, recipe.trainer.max_steps, needed_fields(recipe.rl))

    @override
    @classmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        return prompts_problems(recipe.data, ranks, needed_fields(recipe.rl), recipe.rl.max_new_tokens)

    @override
    @classmethod
    def recipe_problems(cls, recipe: Recipe) -> List[str]:
        return grpo_problems(recipe)

    @override
    @classmethod
    def other_models(cls, recipe: Recipe) -> Dict[str, nn.Module]:
        if rl_reference_kind(recipe.rl, recipe.peft.enabled) != COPY:
            return {}
        assert recipe.model.pretrained is not None  # checked before launch
        return {REFERENCE: frozen_model(recipe.model.pretrained)}

    @override
    @classmethod
    def strategy_needs(cls, recipe: Recipe, config: MixedFSDPConfig) -> None:
        if recipe.rl.fp32_head:
            head = f"^{output_head_name(recipe.model).replace('.', '[.]')}$"
            config.dtypes.fp32_compute_modules = [*config.dtypes.fp32_compute_modules, head]
        if rl_reference_kind(recipe.rl, recipe.peft.enabled) == COPY and recipe.model.pretrained is not None:
            frozen_model_needs(config, recipe.model.pretrained, "none", "none")

    @override
    @classmethod
    def recipe_settings(cls, recipe: Recipe) -> Dict[str, Any]:
        return {"rl": recipe.rl, "seed": recipe.trainer.seed, "recipe": recipe}

    # -- the models

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if self.reference is None and self.reference_kind == COPY:
            self.reference = frozen_model(starting_weights(self.model_section))

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.reference_kind == COPY:
            assert self.reference is not None
            load_full_weights(self.reference, starting_weights(self.model_section))
        if self.generators is not None:
            self.generators.start()

    @override
    def teardown(self, stage: str) -> None:
        if self.generators is not None:
            self.generators.close()

    @override
    def configure_callbacks(self) -> List[pl.Callback]:
        return [StopGeneratorsOnException()] if self.generators is not None else []

    # -- the loss

    @override
    def training_loss(self, batch: List[Prompt]) -> TrainingLoss:
        assert self.model is not None
        if self.rl.disable_dropout:  # one mode for sampling, pi_old, pi_theta, the reference: no dropout masks
            for model in (self.model, self.reference):
                if model is not None:
                    model.eval()
        self._rollout_for(batch)
        rollout, rewards, settings = self.rollout, self.rollout_rewards, self.rl
        assert rollout is not None and rewards is not None
        log_probs = completion_log_probs(self.model, rollout, settings.temperature, self._vocab(), settings.top_p)
        mask, generated = rollout.completion_mask, rollout.generator_log_probs
        if self.first_update:
            self.old_log_probs = log_probs.detach()  # pi_old: the weights the rollout was sampled from
        old = self.old_log_probs if self.correction.enabled else generated
        assert old is not None and self.old_log_probs is not None
        weights = importance_weights(old, generated, mask, self.correction)
        if self.first_update:
            mismatch = log_generator_mismatch(self, self.old_log_probs, generated, mask, self.correction, weights)
            if not self.mismatch_checked:  # the launch's first rollout
                self.mismatch_checked = check_first_mismatch(mismatch, self.rl, str(self.trainer.precision), self.model)
        group = self.data_parallel_group()
        all_tokens = all_ranks_tokens(weights.kept, group) if settings.loss == "dapo" else None
        all_completions = all_ranks_completions(weights.kept, group) if settings.loss == "grpo" else None
        model, reference, vocab = self.model, self.reference, self._vocab()
        reference_probs = reference_log_probs(
            self.reference_kind, model, reference, rollout, settings.temperature, vocab, settings.top_p
        )
        parts = grpo_loss(log_probs, old, weights.kept, rewards, loss_settings(settings), reference_probs, all_tokens,
                          self.data_parallel_ranks(), weights.weights if self.correction.enabled else None,
                          all_completions)  # fmt: skip
        self.log("clip_fraction", parts.clip_fraction, sync_dist=True)
        if self.reference_kind is not None:
            self.log("kl", parts.kl, sync_dist=True)
        return TrainingLoss(parts.loss, parts.loss.detach())

    # -- what is evaluated

    @override
    def evaluate(self, batch: List[Prompt]) -> None:
        rollout = self.complete(batch, Sampling(self.rl.max_new_tokens, temperature=0.0), None)
        rewards, _ = self.score(batch, rollout)
        self.held_out_reward.update(rewards.float())

    @override
    def on_validation_epoch_end(self) -> None:
        value = float(self.held_out_reward.compute().item())
        self.held_out_reward.reset()
        when = "untrained" if self.trainer.sanity_checking else f"step {self.global_step}"
        self.evaluations[when] = value
        rank_zero_info(f"{self.evaluated} ({when}): {value:.3f} (greedy completions of the held-out prompts)")
        if not self.trainer.sanity_checking:
            self.log("val_reward", value, prog_bar=True, sync_dist=True)  # equal on all ranks already
        elif self.logger is not None:
            self.logger.log_metrics({UNTRAINED_REWARD: value}, step=0)

    @override
    @classmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        return before_after(cls.evaluated, untrained, trained, steps)


class StopGeneratorsOnException(pl.Callback):
    """Lightning calls no ``teardown`` after an exception: the generator processes are stopped (without a word to
    them: they may be sending) and their folder removed here."""

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        generators = getattr(pl_module, "generators", None)
        if isinstance(generators, GeneratorRanks):
            generators.terminate()


def grpo_problems(recipe: Recipe) -> List[str]:
    """What GRPO needs of the recipe, all at once, each with its fix."""
    return [*rl_setting_problems(recipe.rl), *reference_problems(recipe), *grpo_composition_problems(recipe),
            *generator_rank_problems(recipe)]  # fmt: skip


def rl_setting_problems(settings: RlSection) -> List[str]:
    """The ``rl`` section's values: the reward, the group, sampling, the loss, the correction."""
    problems = reward_problems(settings.reward)
    problems += correction_problems(settings.correction, settings.correction_level, settings.correction_bounds)
    if settings.group_size < 2:
        problems.append(
            f"rl.group_size={settings.group_size}: advantages compare each completion with the others of its prompt's"
            " group, so a group needs 2 completions at least; set rl.group_size to 2 or more (8 is common)"
        )
    for name, value, minimum in (
        ("prompts_per_step", settings.prompts_per_step, 1),
        ("max_new_tokens", settings.max_new_tokens, 1),
        ("updates_per_rollout", settings.updates_per_rollout, 1),
    ):
        if value < minimum:
            problems.append(f"rl.{name}={value} must be at least {minimum}")
    if not (settings.temperature > 0 and math.isfinite(settings.temperature)):
        problems.append(
            f"rl.temperature={settings.temperature} must be > 0 (sampling; 1.0 samples the policy as it is)"
        )
    if not 0 < settings.top_p <= 1:
        problems.append(f"rl.top_p={settings.top_p} must be in (0, 1] (1: off)")
    if settings.loss not in LOSSES:
        problems.append(f"rl.loss={settings.loss!r}: use one of {', '.join(LOSSES)}")
    if not settings.clip > 0:
        problems.append(f"rl.clip={settings.clip} must be > 0, e.g. 0.2")
    if settings.clip_high is not None and not settings.clip_high > 0:
        problems.append(f"rl.clip_high={settings.clip_high} must be > 0 (e.g. 0.28), or unset to use rl.clip")
    if settings.beta < 0:
        problems.append(f"rl.beta={settings.beta} must be >= 0 (0: no reference)")
    if settings.generation not in GENERATIONS:
        problems.append(f"rl.generation={settings.generation!r}: use one of {', '.join(GENERATIONS)}")
    if settings.mismatch_limit is not None and not settings.mismatch_limit > 0:
        problems.append(f"rl.mismatch_limit={settings.mismatch_limit} must be > 0, or unset for the precision's")
    return problems


def reference_problems(recipe: Recipe) -> List[str]:
    """The KL's reference against ``rl.beta``, peft and ``model.pretrained``."""
    settings, problems = recipe.rl, []
    kind = rl_reference_kind(settings, recipe.peft.enabled)
    if settings.reference is not None and not settings.beta:
        problems.append(
            f"rl.reference={settings.reference!r} is the reference of the KL penalty, and rl.beta=0 holds none: set"
            " rl.beta (e.g. 0.04), or leave rl.reference unset"
        )
    elif kind not in (None, COPY, ADAPTERS_OFF):
        problems.append(f"rl.reference={kind!r}: use copy or adapters_off")
    elif kind == ADAPTERS_OFF and not recipe.peft.enabled:
        problems.append(
            "rl.reference=adapters_off is the policy's base with its LoRA adapters disabled, and peft is off: set"
            " peft.enabled=true, or use rl.reference=copy"
        )
    elif kind == COPY and recipe.model.pretrained is None:
        problems.append("rl.reference=copy is a frozen copy of model.pretrained: set model.pretrained")
    return problems


def grpo_composition_problems(recipe: Recipe) -> List[str]:
    """What GRPO does not compose with: accumulation, context parallelism, fault tolerance, semi-synchronous
    replicas."""
    problems = []
    if recipe.trainer.accumulate_grad_batches != 1:
        problems.append(
            f"trainer.accumulate_grad_batches={recipe.trainer.accumulate_grad_batches}: a GRPO step is one rollout of"
            " rl.prompts_per_step prompts per rank; set it to 1 and raise rl.prompts_per_step for larger steps"
        )
    strategy = recipe.strategy
    problems += composition_problems(
        "GRPO",
        strategy.parallelism.context_parallel_size,
        strategy.fault_tolerance is not None,
        "rollouts decode whole sequences on each rank",
    )
    if strategy.parallelism.replicate_sync != "every_step":
        problems.append(
            f"GRPO with strategy.parallelism.replicate_sync={strategy.parallelism.replicate_sync!r} is not supported"
            " (the replicas would sample from policies that drift apart between syncs, off the rollouts' policy);"
            " set it to every_step"
        )
    return problems


def generator_rank_problems(recipe: Recipe) -> List[str]:
    """``rl.generation: ranks`` and what it needs: the generator count, staleness, buckets; what it does not compose
    with yet."""
    settings, problems = recipe.rl, []
    count, ranks_mode, trainers = settings.generator_ranks, settings.generation == "ranks", recipe.world_size
    if ranks_mode and count < 1:
        problems.append("rl.generation=ranks samples on generator processes: set rl.generator_ranks (1 or more)")
    if count and not ranks_mode:
        problems.append(f"rl.generator_ranks={count} needs rl.generation=ranks (or set rl.generator_ranks=0)")
    if ranks_mode and count > trainers:
        problems.append(
            f"rl.generator_ranks={count} with {trainers} trainer ranks (trainer.devices x trainer.num_nodes): each"
            f" generator samples whole trainer ranks' rollouts; use at most {trainers}"
        )
    if settings.max_staleness not in (0, 1):
        problems.append(f"rl.max_staleness={settings.max_staleness}: 0 (synchronous) or 1 (one step stale)")
    elif settings.max_staleness == 1 and not ranks_mode:
        problems.append(
            "rl.max_staleness=1 samples the next rollout while the trainers train, on generator ranks: set"
            " rl.generation=ranks and rl.generator_ranks, or rl.max_staleness=0"
        )
    if not settings.sync_bucket_mb > 0:
        problems.append(f"rl.sync_bucket_mb={settings.sync_bucket_mb} must be > 0 (e.g. 64)")
    if ranks_mode:
        problems += [f"rl.generation=ranks with {what} is not supported yet ({why})" for what, why in
                     generator_rank_compositions(recipe)]  # fmt: skip
    return problems


def generator_rank_compositions(recipe: Recipe) -> List[Tuple[str, str]]:
    """What generator ranks do not take yet, each with why."""
    parallelism, found = recipe.strategy.parallelism, []
    whole = "a generator holds the policy whole on one device; set it to 1"
    for name, size in (
        ("tensor", parallelism.tensor_parallel_size),
        ("expert", parallelism.expert_parallel_size),
        ("pipeline", parallelism.pipeline_parallel_size),
    ):
        if isinstance(size, int) and size > 1:
            found.append((f"strategy.parallelism.{name}_parallel_size={size}", whole))
    quantized = recipe.strategy.memory.quantize_base
    if quantized is not None:
        why = "a generator would need the 4-bit base and the adapters; set rl.generation=gathered"
        found.append((f"strategy.memory.quantize_base={quantized!r}", why))
    if recipe.trainer.num_nodes > 1:
        why = "the generators start beside trainer rank 0, on its node; train on one node"
        found.append((f"trainer.num_nodes={recipe.trainer.num_nodes}", why))
    return found
