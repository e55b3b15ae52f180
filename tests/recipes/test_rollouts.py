"""GRPO's generator samples the distribution its trainer scores, on the architectures the strategy trains: HF models
built from config (attention caches: Llama, Qwen3, Gemma 3 with sliding windows; recurrent states: Mamba-1, Mamba-2;
hybrids: Jamba, Falcon-H1) decode left-padded prompts of different lengths token by token, and the training forward's
probability of every sampled token equals the generator's in fp32 (``|p_train / p_gen - 1| <= 1e-5`` for each
token). One process, no launch: the sampler and the forward are the code every rank runs."""

import pytest
import torch

from lightning_mixedfsdp.compat.transformers import decodes_with_cache
from lightning_mixedfsdp.recipes.rl.rollouts import Sampling, completion_log_probs, sample
from tests.hf_models import tiny_model

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

ARCHITECTURES = {
    "llama": True,
    "qwen3": True,
    "gemma3_text": True,
    "mamba": False,
    "mamba2": False,
    "jamba": False,
    "falcon_h1": False,
}
"""Each architecture, and whether it decodes with its cache (attention only) or reruns the sequence (stateful)."""
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13] * 7, [20, 21]]


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_every_sampled_tokens_probability_is_the_trainers_in_fp32(model_type: str) -> None:
    extra = {} if model_type.startswith("mamba") else {"attn_implementation": "sdpa"}
    model = tiny_model(model_type, **extra).eval()
    assert decodes_with_cache(model) == ARCHITECTURES[model_type]
    generator = torch.Generator().manual_seed(1)
    rollout = sample(model, PROMPTS, Sampling(max_new_tokens=12), end=[], pad=0, generator=generator)
    assert rollout.completion_mask.sum() == len(PROMPTS) * 12
    with torch.no_grad():
        trained = completion_log_probs(model, rollout, temperature=1.0)
    on = rollout.completion_mask.bool()
    per_token = (torch.exp(trained - rollout.generator_log_probs) - 1).abs()[on]
    assert per_token.max() <= 1e-5, (model_type, float(per_token.max()))


def test_with_top_p_every_log_prob_is_of_the_nucleus_sampled() -> None:
    """``top_p < 1``: the generator's log-prob of each token is of the renormalised nucleus it was drawn from, and the
    training forward scores the same distribution (NeMo RL's convention), so the ratio stays 1 on-policy; the
    unfiltered log-prob would be off by the nucleus's mass."""
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(1)
    rollout = sample(model, PROMPTS, Sampling(max_new_tokens=12, top_p=0.5), end=[], pad=0, generator=generator)
    on = rollout.completion_mask.bool()
    with torch.no_grad():
        filtered = completion_log_probs(model, rollout, temperature=1.0, top_p=0.5)
        unfiltered = completion_log_probs(model, rollout, temperature=1.0)
    assert (torch.exp(filtered - rollout.generator_log_probs) - 1).abs()[on].max() <= 1e-5
    kept_mass = torch.exp(unfiltered - filtered)[on]  # the nucleus's probability, where each token was drawn
    assert kept_mass.max() <= 1 + 1e-6 and kept_mass.min() < 0.9
