"""Off-policy corrections (``rl.correction``): each correction's loss and gradient against the formula written out
token by token here, rejected tokens out of the denominators, the logs' figures, and each refusal. One process: the
loss is a function of per-token tensors; ``test_grpo.py`` runs a corrected loss on two sharded ranks."""

import math
from typing import List, Optional

import pytest
import torch

from lightning_mixedfsdp.recipes.rl.corrections import (
    Correction,
    correction_of,
    correction_problems,
    importance_weights,
    mismatch_logs,
)
from lightning_mixedfsdp.recipes.rl.losses import LossSettings, grpo_loss
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError
from tests.recipes.grpo_formula import written_advantages

GROUP, ROWS, LENGTH, MAX_NEW, CLIP = 4, 8, 9, 7, 0.2
KINDS = ("tis", "mis", "icepop")
LEVELS = ("token", "sequence", "geometric")


def _rollout() -> dict:
    """pi_theta (trained), pi_old (0.05 away), mu (the generator's: up to 0.9 away, so bounds bite), a completion mask
    of 1 to 7 tokens per row, rewards with every group mixed."""
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(ROWS, LENGTH, generator=generator) * 3
    theta = (old + (torch.rand(ROWS, LENGTH, generator=generator) - 0.5) * 0.1).requires_grad_()
    mu = old + (torch.rand(ROWS, LENGTH, generator=generator) - 0.5) * 1.8
    mask = torch.zeros(ROWS, LENGTH)
    for row in range(ROWS):
        mask[row, 2 : 2 + 1 + (row * 3) % MAX_NEW] = 1
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    return {"theta": theta, "old": old, "mu": mu, "mask": mask, "rewards": rewards}


def _weight(kind: str, level: str, low: float, high: float, ratios: List[float], t: int) -> float:
    """The weight of token ``t`` of a completion whose tokens' pi_old / mu are ``ratios``; 0 is rejected."""
    if level == "token":
        w = ratios[t]
    elif level == "sequence":
        w = math.prod(ratios)
    else:
        w = math.prod(ratios) ** (1 / len(ratios))
    if kind == "tis":
        return min(max(w, low), high)
    return w if low <= w <= high else 0.0


def formula(
    data: dict,
    kind: str,
    level: str,
    low: float,
    high: float,
    loss: str,
    tokens: Optional[float],
    completions: Optional[float] = None,
) -> torch.Tensor:
    """GRPO's loss with the correction, token by token: the rejected tokens are not terms and not counted."""
    theta, old, mu, mask, rewards = data["theta"], data["old"], data["mu"], data["mask"], data["rewards"]
    per_row, every_term = [], []
    for row, advantage in enumerate(written_advantages(rewards, GROUP, scaled=loss != "dr_grpo")):
        steps = [t for t in range(LENGTH) if mask[row, t]]
        ratios = [math.exp(float(old[row, t] - mu[row, t])) for t in steps]
        terms = []
        for i, t in enumerate(steps):
            weight = _weight(kind, level, low, high, ratios, i)
            if weight == 0.0 and kind != "tis":
                continue  # rejected: no term, and not counted
            ratio = torch.exp(theta[row, t] - old[row, t])
            clipped = ratio.clamp(1 - CLIP, 1 + CLIP)
            terms.append(-weight * torch.minimum(ratio * advantage, clipped * advantage))
        every_term += terms
        if terms:  # a completion rejected whole is not one of the mean's completions (verl's agg_loss, #3915)
            per_row.append(torch.stack(terms).sum() / len(terms))
    if loss == "grpo":
        return torch.stack(per_row).sum() / (completions if completions is not None else len(per_row))
    if loss == "dr_grpo":
        return torch.stack(every_term).sum() / (ROWS * MAX_NEW)
    return torch.stack(every_term).sum() / (tokens if tokens is not None else len(every_term))


def _ours(data: dict, correction: Correction, loss: str) -> torch.Tensor:
    weights = importance_weights(data["old"], data["mu"], data["mask"], correction)
    settings = LossSettings(loss, GROUP, CLIP, CLIP, MAX_NEW)
    return grpo_loss(data["theta"], data["old"], weights.kept, data["rewards"], settings, weights=weights.weights).loss


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(
    ("kind", "level"), [(kind, level) for kind in KINDS for level in LEVELS if kind != "icepop" or level == "token"]
)
def test_each_corrections_loss_and_gradient_equal_the_formula_token_by_token(kind: str, level: str, loss: str) -> None:
    bounds = {"token": (0.7, 1.4), "sequence": (0.3, 3.0), "geometric": (0.85, 1.15)}[level]
    correction = correction_of(kind, level, bounds)
    data = _rollout()
    ours = _ours(data, correction, loss)
    (got,) = torch.autograd.grad(ours, data["theta"])
    expected = formula(data, kind, level, *bounds, loss, None)
    (want,) = torch.autograd.grad(expected, data["theta"])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    weights = importance_weights(data["old"], data["mu"], data["mask"], correction)
    rejected = int((data["mask"] - weights.kept).sum())
    if kind == "tis":
        assert rejected == 0 and bool((weights.weights <= bounds[1]).all())
    else:  # the bounds reject some tokens, and keep some: the test sees both sides
        assert 0 < rejected < int(data["mask"].sum()), (kind, level, rejected)
    if kind == "mis" and level == "sequence":  # some completions are rejected whole, some kept
        kept_rows = int((weights.kept.sum(-1) > 0).sum())
        assert 0 < kept_rows < ROWS, kept_rows


def test_grpos_denominator_is_the_kept_completions_of_every_rank() -> None:
    data, correction = _rollout(), correction_of("mis", "sequence", (0.3, 3.0))
    weights = importance_weights(data["old"], data["mu"], data["mask"], correction)
    other_ranks_kept = 5.0
    all_completions = (weights.kept.sum(-1) > 0).sum().float() + other_ranks_kept
    settings = LossSettings("grpo", GROUP, CLIP, CLIP, MAX_NEW)
    got = grpo_loss(data["theta"], data["old"], weights.kept, data["rewards"], settings, None, None, 2,
                    weights.weights, all_completions).loss  # fmt: skip
    expected = formula(data, "mis", "sequence", 0.3, 3.0, "grpo", None, float(all_completions) / 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_a_long_completions_sequence_weight_is_clamped_not_infinite() -> None:
    """A log gap of 1 nat on each of 40 tokens: the sequence's log weight 40 is clamped to 20 (verl's bound)."""
    old, mu, mask = torch.zeros(1, 40), -torch.ones(1, 40), torch.ones(1, 40)
    for kind in ("tis", "mis"):
        weights = importance_weights(old, mu, mask, correction_of(kind, "sequence", None))
        assert torch.isfinite(weights.raw).all() and float(weights.raw.max()) == pytest.approx(math.exp(20), rel=1e-5)
        assert torch.isfinite(weights.weights).all()


def test_dapos_denominator_is_the_kept_tokens_of_every_rank() -> None:
    data, correction = _rollout(), correction_of("mis", "token", (0.7, 1.4))
    weights = importance_weights(data["old"], data["mu"], data["mask"], correction)
    other_ranks_kept = 11.0
    all_tokens = weights.kept.sum() + other_ranks_kept
    settings = LossSettings("dapo", GROUP, CLIP, CLIP, MAX_NEW)
    got = grpo_loss(data["theta"], data["old"], weights.kept, data["rewards"], settings, None, all_tokens, 2,
                    weights.weights).loss  # fmt: skip
    expected = formula(data, "mis", "token", 0.7, 1.4, "dapo", float(all_tokens) / 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_the_weight_multiplies_the_policy_gradient_term_not_the_kl() -> None:
    data = _rollout()
    reference = data["old"] - 0.3
    settings = LossSettings("grpo", GROUP, CLIP, CLIP, MAX_NEW, beta=0.1)
    weights = importance_weights(data["old"], data["mu"], data["mask"], correction_of("tis", "token", None))
    mask = data["mask"]
    corrected = grpo_loss(data["theta"], data["old"], mask, data["rewards"], settings, reference,
                          weights=weights.weights).loss  # fmt: skip
    plain_kl = grpo_loss(data["theta"], data["old"], mask, torch.zeros(ROWS), settings, reference).loss
    no_kl = LossSettings("grpo", GROUP, CLIP, CLIP, MAX_NEW)
    pg_only = grpo_loss(data["theta"], data["old"], mask, data["rewards"], no_kl, weights=weights.weights).loss
    torch.testing.assert_close(corrected, pg_only + plain_kl, rtol=1e-5, atol=1e-7)  # zero rewards: the KL alone


def test_no_correction_keeps_the_ratio_against_the_generator_and_every_token() -> None:
    data = _rollout()
    weights = importance_weights(data["old"], data["mu"], data["mask"], Correction())
    assert torch.equal(weights.kept, data["mask"]) and torch.equal(weights.weights, data["mask"])
    settings = LossSettings("grpo", GROUP, CLIP, CLIP, MAX_NEW)
    today = grpo_loss(data["theta"], data["mu"], data["mask"], data["rewards"], settings).loss
    torch.testing.assert_close(today, grpo_loss(data["theta"], data["mu"], weights.kept, data["rewards"], settings,
                                                weights=weights.weights).loss)  # fmt: skip


def test_the_logs_figures_are_the_tokens_mean_and_max() -> None:
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
    mu = torch.log(torch.tensor([[0.25, 0.2, 0.9, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding: never counted
    weights = importance_weights(old, mu, mask, correction_of("icepop", "token", None))
    logs = mismatch_logs(old, mu, mask, weights)
    assert weights.kept.tolist() == [[1.0, 1.0, 1.0, 0.0]]  # ratio 2 is inside [0.5, 5]
    torch.testing.assert_close(logs["is_weight_mean"], torch.tensor(4 / 3))
    torch.testing.assert_close(logs["token_mult_prob_error"], torch.tensor(4 / 3))  # exp(|log 2|) = 2, 1, 1
    torch.testing.assert_close(logs["max_prob_gap"], torch.tensor(0.25))
    assert float(logs["is_masked_fraction"]) == 0.0
    tight = importance_weights(old, mu, mask, correction_of("mis", "token", (0.0, 1.5)))
    assert float(mismatch_logs(old, mu, mask, tight)["is_masked_fraction"]) == pytest.approx(1 / 3)


def test_unset_bounds_are_each_kinds_defaults() -> None:
    assert correction_of("tis", "token", None) == Correction("tis", "token", 0.0, 2.0)
    assert correction_of("mis", "sequence", None) == Correction("mis", "sequence", 0.0, 2.0)
    assert correction_of("icepop", "token", None) == Correction("icepop", "token", 0.5, 5.0)  # Ring-1T, NeMo RL
    # verl's geometric rejection: a mean log gap of 0.3 nats a token (inside [0, 2]) is far outside
    assert correction_of("mis", "geometric", None) == Correction("mis", "geometric", 0.999, 1.001)
    # truncation into so narrow a band would turn TIS off: it keeps [0, 2] at every level
    assert correction_of("tis", "geometric", None) == Correction("tis", "geometric", 0.0, 2.0)


@pytest.mark.parametrize(
    ("kind", "level", "bounds", "message"),
    [
        ("is", "token", None, "rl.correction='is': use one of none, tis, mis, icepop"),
        ("tis", "row", None, "rl.correction_level='row': use one of token, sequence, geometric"),
        ("icepop", "sequence", None, "rl.correction=icepop with rl.correction_level='sequence': IcePop rejects"),
        ("tis", "token", [2.0, 0.5], r"rl.correction_bounds=\[2.0, 0.5\]: need 0 <= low <= 1 < high"),
        ("mis", "token", [-0.1, 2.0], r"rl.correction_bounds=\[-0.1, 2.0\]: need 0 <= low <= 1 < high"),
        ("mis", "token", [0.5, 1.0], r"rl.correction_bounds=\[0.5, 1.0\]: need 0 <= low <= 1 < high"),
        ("mis", "token", [1.0], r"rl.correction_bounds=\[1.0\] must be two numbers"),
        ("none", "token", [0.5, 2.0], r"rl.correction=none has none: set rl.correction"),
    ],
)
def test_each_bad_correction_is_refused_with_its_fix(kind: str, level: str, bounds: object, message: str) -> None:
    problems = correction_problems(kind, level, bounds)  # type: ignore[arg-type]
    assert len(problems) == 1 and __import__("re").search(message, problems[0]), problems


def test_a_recipes_bad_correction_is_refused_before_launch_with_the_other_problems() -> None:
    overrides = ["objective=grpo", "model.pretrained=/nowhere", "rl.correction=tis", "rl.correction_bounds=[3, 2]",
                 "rl.group_size=1"]  # fmt: skip
    with pytest.raises(RecipeError) as refused:
        load_recipe("conf/comparison_grpo.yaml", overrides, launching=False)
    assert "rl.correction_bounds=[3.0, 2.0]" in str(refused.value) and "rl.group_size=1" in str(refused.value)
