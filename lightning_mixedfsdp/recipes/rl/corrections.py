"""Off-policy corrections (``rl.correction``): the weight that makes a rollout sampled by the generator (``mu``: its
log-probs, kept as it samples) count as the trainer's own (``pi_old``: the trainer's log-probs of the same tokens,
with the weights the rollout was generated from).

Three log-probs meet in the loss (verl keeps the same three; equating ``pi_old`` with ``mu`` is the mistake it warns
of): ``mu``, ``pi_old`` and ``pi_theta`` (the forward being trained). PPO's ratio is ``pi_theta / pi_old``; the
importance weight ``w = pi_old / mu`` multiplies the policy-gradient term (never the KL). Even at equal weights the
two differ: the generator decodes one token at a time, the trainer runs one forward over the sequence.

- ``tis`` (truncated importance sampling, Yao et al. 2025): ``w`` clamped into ``[low, high]``;
- ``mis`` (masked importance sampling): tokens whose ``w`` is outside ``[low, high]`` are rejected, the others keep
  ``w``;
- ``icepop`` (Ring-1T): ``mis`` per token.

The default bounds depend on the level (:func:`default_bounds`), from the anchors: [0, 2] for truncation and for
rejection per token and per sequence (TIS's cap of 2, Yao et al.; verl's ``rollout_is_threshold`` 2.0); [0.999, 1.001]
for rejection by the geometric mean (verl's geometric rejection; NeMo RL uses 0.999-1.002), whose per-token mean log
gap must stay tiny to mean anything (0.3 nats a token would pass [0, 2]; truncating into so narrow a band would turn
TIS off, so ``tis`` keeps [0, 2]); [0.5, 5] for IcePop (Ring-1T's alpha and beta, NeMo RL's comment). The log of a
weight is clamped to [-20, 20] before ``exp`` (verl's bound): a sequence's summed log gap grows with its length and
would reach inf.

``rl.correction_level`` says whose ratio ``w`` is: each token's (``token``), the completion's product over its
tokens (``sequence``), or that product's geometric mean (``geometric``); a sequence-level rejection rejects the whole
completion. Rejected tokens leave the loss entirely, its denominators included (grpo's per-completion token count,
dapo's count over every rank; dr_grpo's constant stays): slime #657 and verl #3915 fixed the same."""

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

CORRECTIONS = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence", "geometric")
LOG_WEIGHT_BOUND = 20.0
"""A weight's log is clamped to ``[-20, 20]`` before ``exp`` (verl's bound)."""


def default_bounds(kind: str, level: str) -> Tuple[float, float]:
    """The bounds of ``kind`` at ``level`` when ``rl.correction_bounds`` is unset (see the module's docstring)."""
    if kind == "icepop":
        return (0.5, 5.0)
    if level == "geometric" and kind == "mis":
        return (0.999, 1.001)
    return (0.0, 2.0)


@dataclass(frozen=True)
class Correction:
    """``rl.correction``, ``rl.correction_level`` and the bounds resolved (:func:`correction_of`)."""

    kind: str = "none"
    level: str = "token"
    low: float = 0.0
    high: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def correction_of(kind: str, level: str, bounds: Optional[Sequence[float]]) -> Correction:
    """The correction with ``bounds``, or the kind's defaults when unset."""
    low, high = bounds if bounds is not None else default_bounds(kind, level)
    return Correction(kind, level, float(low), float(high))


class Weights(NamedTuple):
    weights: Tensor
    """Per token, detached: what multiplies the policy-gradient term (0 where rejected, 1 without a correction)."""
    kept: Tensor
    """Per token: 1 where the token counts in the loss (a completion token not rejected), else 0."""
    raw: Tensor
    """Per token: ``pi_old / mu`` at the correction's level, before truncation or rejection (1 without one)."""


def importance_weights(
    old_log_probs: Tensor, generator_log_probs: Tensor, mask: Tensor, correction: Correction
) -> Weights:
    """The importance weights of a rollout's tokens (``[rows, len]``; ``mask``: its completion tokens)."""
    mask = mask.float()
    if not correction.enabled:
        return Weights(mask.clone(), mask, torch.ones_like(mask))
    gap = ((old_log_probs - generator_log_probs) * mask).detach().float()
    if correction.level == "token":
        log_weight = gap
    else:
        total = gap.sum(-1, keepdim=True)
        if correction.level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp_min(1)
        log_weight = total.expand_as(gap)
    raw = torch.exp(log_weight.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
    if correction.kind == "tis":
        return Weights(raw.clamp(correction.low, correction.high) * mask, mask, raw)
    inside = ((raw >= correction.low) & (raw <= correction.high)).float() * mask
    return Weights(torch.where(inside.bool(), raw, torch.zeros_like(raw)), inside, raw)


def mismatch_logs(
    old_log_probs: Tensor, generator_log_probs: Tensor, mask: Tensor, weights: Weights
) -> Dict[str, Tensor]:
    """What the logs say of the generator against the trainer, over the completion tokens: ``is_weight_mean`` (the
    applied weight, rejected tokens 0), ``is_masked_fraction``, ``token_mult_prob_error`` (NeMo RL's mean of
    ``exp(|pi_old - mu|)`` in log space: 1 is exact, above 1.05 alarms) and ``max_prob_gap`` (the largest
    ``|p_train - p_gen|``)."""
    mask = mask.float()
    count = mask.sum().clamp_min(1)
    gap = (old_log_probs - generator_log_probs).detach().float()
    probability_gap = (old_log_probs.detach().float().exp() - generator_log_probs.float().exp()).abs() * mask
    return {
        "is_weight_mean": (weights.weights * mask).sum() / count,
        "is_masked_fraction": ((mask - weights.kept) * mask).sum() / count,
        "token_mult_prob_error": (gap.abs().exp() * mask).sum() / count,
        "max_prob_gap": probability_gap.max() if probability_gap.numel() else probability_gap.sum(),
    }


def correction_problems(kind: str, level: str, bounds: Optional[Sequence[float]]) -> List[str]:
    """``rl.correction``, ``rl.correction_level`` and ``rl.correction_bounds``, each problem with its fix."""
    problems = []
    if kind not in CORRECTIONS:
        problems.append(f"rl.correction={kind!r}: use one of {', '.join(CORRECTIONS)}")
    if level not in LEVELS:
        problems.append(f"rl.correction_level={level!r}: use one of {', '.join(LEVELS)}")
    elif kind == "icepop" and level != "token":
        problems.append(
            f"rl.correction=icepop with rl.correction_level={level!r}: IcePop rejects tokens one by one; for whole"
            " completions use rl.correction=mis with that level"
        )
    if bounds is None:
        return problems
    if len(bounds) != 2:
        return [*problems, f"rl.correction_bounds={list(bounds)} must be two numbers [low, high], e.g. [0.5, 2.0]"]
    low, high = float(bounds[0]), float(bounds[1])
    if low < 0 or not low < high or not low <= 1 < high:
        problems.append(
            f"rl.correction_bounds={list(bounds)}: need 0 <= low <= 1 < high (a weight of 1, the"
            " generator agreeing with the trainer, must be kept), e.g. [0.5, 2.0]"
        )
    if kind == "none":
        problems.append(f"rl.correction_bounds={list(bounds)} bound a correction, and rl.correction=none has none: "
                        "set rl.correction (tis, mis or icepop), or leave the bounds unset")  # fmt: skip
    return problems
