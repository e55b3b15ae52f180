"""Where a GRPO step's rollout comes from (``objective: grpo``): sampled on the trainers from the sharded policy
(``rl.generation``: ``gathered`` or ``sharded``), or asked of the generator ranks (``ranks``), scored by the reward;
a new one every ``rl.updates_per_rollout`` steps, and at a resume."""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from lightning_mixedfsdp.recipes.data.prompts import Prompt, PromptCorpus
from lightning_mixedfsdp.recipes.objectives.objective import Objective
from lightning_mixedfsdp.recipes.rl.generation import generate
from lightning_mixedfsdp.recipes.rl.generator_ranks import GeneratorRanks, seed_of
from lightning_mixedfsdp.recipes.rl.rewards import Reward, score_completions
from lightning_mixedfsdp.recipes.rl.rollouts import Rollout, Sampling
from lightning_mixedfsdp.recipes.settings.schema import RlSection


def log_rollout(objective: Objective, rollout: Rollout, rewards: Tensor, means: Dict[str, float]) -> None:
    """A new rollout's ``train_reward`` (and each reward's), its ``completion_length``."""
    objective.log("train_reward", rewards.mean(), prog_bar=True, sync_dist=True)
    for name, mean in means.items():
        objective.log(f"train_reward_{name}", mean, sync_dist=True)
    objective.log("completion_length", rollout.completion_lengths.float().mean(), sync_dist=True)


def check_the_asked_prompts(batch: List[Prompt], asked: List[Prompt], step: int) -> None:
    """The step's prompts (the stream's) against those the generator ranks were asked for: never train on
    another rollout's prompts (compared by content: Lightning copies a batch)."""
    if [(p.text, p.ids) for p in batch] != [(p.text, p.ids) for p in asked]:
        raise RuntimeError(
            f"GroupRelativePolicyOptimization: step {step}'s prompts are not those the generator ranks were asked"
            " for; report this with the recipe"
        )


class RolloutSource(Objective):
    """The rollout in use, and how the next one is made (GRPO's policy side; ``grpo.py`` the loss)."""

    rl: RlSection
    seed: int
    rewards: List[Reward]
    generators: Optional[GeneratorRanks]
    rollout: Optional[Rollout]
    rollout_index: int
    rollout_rewards: Optional[Tensor]
    first_update: bool

    def _corpus(self) -> PromptCorpus:
        return self.trainer.datamodule  # type: ignore[attr-defined]  # data() made it

    def _vocab(self) -> int:
        """The tokenizer's ids: what is sampled and scored (a wider embedding's extra rows never)."""
        return int(self._corpus().tokenizer.vocab_size)

    def complete(self, prompts: List[Prompt], sampling: Sampling, generator: Optional[torch.Generator]) -> Rollout:
        """Completions of ``prompts`` (each repeated as the caller wants it) from the current policy."""
        assert self.model is not None
        maker, ids = self._corpus().maker, [p.ids for p in prompts]
        return generate(
            self.model, self, ids, sampling, maker.end, maker.pad, self.rl.generation, generator, self._vocab()
        )

    def score(self, prompts: List[Prompt], rollout: Rollout) -> Tuple[Tensor, Dict[str, float]]:
        """The rewards of ``rollout``'s completions and each reward's mean."""
        total, means = score_completions(self.rewards, self._corpus().maker, prompts, rollout)
        return torch.tensor(total, device=self.device), means

    def _rollout_for(self, batch: List[Prompt]) -> None:
        """The step's rollout: sampled anew at every ``updates_per_rollout``-th step (and at a resume), scored."""
        index = self.global_step // self.rl.updates_per_rollout
        if index == self.rollout_index and self.rollout is not None:
            self.first_update = False
            return
        settings = self.rl
        rank = int(self.trainer.strategy.distributed_sampler_kwargs["rank"])  # type: ignore[attr-defined]
        generator = torch.Generator(self.device).manual_seed(seed_of(self.seed, index, rank))
        if self.generators is not None:
            rollout, rewards, means = self._from_generators(batch, index)
        else:
            prompts = [prompt for prompt in batch for _ in range(settings.group_size)]
            sampling = Sampling(settings.max_new_tokens, settings.temperature, settings.top_p)
            rollout = self.complete(prompts, sampling, generator)
            rewards, means = self.score(prompts, rollout)
        self.rollout, self.rollout_rewards, self.rollout_index, self.first_update = rollout, rewards, index, True
        log_rollout(self, rollout, rewards, means)

    def _from_generators(self, batch: List[Prompt], index: int) -> Tuple[Rollout, Tensor, Dict[str, float]]:
        """Rollout ``index`` from the generator ranks (``rl/generator_ranks.py``); one step stale, the next one is
        asked for before this one trains."""
        link, model, every = self.generators, self.model, self.rl.updates_per_rollout
        assert link is not None and model is not None
        corpus, step = self._corpus(), self.global_step
        prompts = corpus.step_indices(step)  # a resume inside a rollout's updates samples afresh, at its step
        check_the_asked_prompts(batch, [corpus.train_set[i] for i in prompts], step)  # type: ignore[index]
        upcoming = None
        if self.rl.max_staleness == 1 and (index + 1) * every < self.trainer.max_steps:
            upcoming = corpus.step_indices((index + 1) * every)
        keep_fp32 = set(self.trainer.strategy.plan_of(model).fp32_names)  # type: ignore[attr-defined]
        produced = link.rollout(model, keep_fp32, index, step, prompts, upcoming, self.seed, self.device)
        self.log("rollout_version", float(produced.version), sync_dist=True)
        return produced.rollout, produced.rewards, produced.means
