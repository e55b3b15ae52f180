"""GRPO's loss and its variants, on one rank's rollout, as plain functions of tensors.

Per group (a prompt's ``group_size`` completions) the rewards ``r`` give each completion an advantage: ``grpo`` and
``dapo`` ``(r - mean) / (std + 1e-4)`` (std unbiased, as trl), ``dr_grpo`` ``r - mean``. Per completion token, with
``ratio = exp(log p - log p_old)`` against the old policy (the generator's log-probs without a correction, the
trainer's ``pi_old`` with one: ``rl/corrections.py``), PPO's clipped surrogate weighted by the correction's ``w``

    l = -w min(ratio A, clip(ratio, 1 - clip, 1 + clip_high) A) + beta k3,  k3 = exp(ref - log p) - (ref - log p) - 1

and the tokens' losses become the loss by ``rl.loss`` (over the tokens ``completion_mask`` keeps: a correction's
rejected tokens are out of it):

- ``grpo``: each completion's mean over its tokens, then the mean over the completions that keep a token (a
  completion a correction rejected whole leaves the denominator too, as verl's ``agg_loss`` after its #3915);
- ``dr_grpo``: the sum over every token over ``completions x max_new_tokens`` (a constant: no length bias);
- ``dapo``: the sum over every token over the step's completion tokens, on all ranks (token-level mean).

FSDP averages gradients over the data-parallel ranks, so each rank's loss is scaled to make the step's gradient the
formula's over the union of the ranks' rollouts: ``dr_grpo`` needs nothing (every rank holds as many completions),
``grpo`` divides by the kept completions of all ranks (``all_completions``) and ``dapo`` by their tokens
(``all_tokens``), each times the ranks."""

from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch
from torch import Tensor

RlLoss = Literal["grpo", "dr_grpo", "dapo"]
LOSSES = ("grpo", "dr_grpo", "dapo")
STD_EPSILON = 1e-4


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool) -> Tensor:
    """Each completion's reward minus its group's mean (over its std too, with ``scale_by_std``)."""
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(-1, keepdim=True) + STD_EPSILON)
    return centred.reshape(-1)


@dataclass(frozen=True)
class LossSettings:
    """``rl.loss`` and what it reads: the group size, PPO's clips, the constant of ``dr_grpo``, the KL's weight."""

    kind: str
    group_size: int
    clip: float
    clip_high: float
    max_new_tokens: int
    beta: float = 0.0


class LossParts(NamedTuple):
    loss: Tensor
    """What backward runs on (see the module's docstring for the scaling)."""
    clip_fraction: Tensor
    """The share of completion tokens whose ratio was clipped where it mattered (below ``1 - clip`` with a negative
    advantage, above ``1 + clip_high`` with a positive one)."""
    kl: Tensor
    """The mean k3 over completion tokens (0 without a reference)."""


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    completion_mask: Tensor,
    rewards: Tensor,
    settings: LossSettings,
    reference_log_probs: Optional[Tensor] = None,
    all_tokens: Optional[Tensor] = None,
    ranks: int = 1,
    weights: Optional[Tensor] = None,
    all_completions: Optional[Tensor] = None,
) -> LossParts:
    """The loss of one rank's rollout (``[rows, len]`` per-token tensors; ``rewards`` per row); ``all_tokens`` and
    ``ranks``: ``dapo``'s denominator, the kept completion tokens of every rank; ``all_completions``: ``grpo``'s, the
    completions of every rank that keep a token (None: this rank's alone); ``weights``: the correction's importance
    weight of each token (detached; none: 1)."""
    kind, group_size, beta = settings.kind, settings.group_size, settings.beta
    clip, clip_high, max_new_tokens = settings.clip, settings.clip_high, settings.max_new_tokens
    mask = completion_mask.float()
    advantages = group_advantages(rewards, group_size, scale_by_std=kind != "dr_grpo").unsqueeze(-1)
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = ratio.clamp(1 - clip, 1 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if weights is not None:
        per_token = per_token * weights.detach()
    kl = torch.zeros_like(per_token)
    if beta and reference_log_probs is not None:
        gap = reference_log_probs - log_probs
        kl = torch.exp(gap) - gap - 1
        per_token = per_token + beta * kl
    per_token = per_token * mask
    if kind == "grpo":
        completions = all_completions if all_completions is not None else (mask.sum(-1) > 0).sum() * ranks
        loss = (per_token.sum(-1) / mask.sum(-1).clamp_min(1)).sum() * ranks / completions.clamp_min(1)
    elif kind == "dr_grpo":
        loss = per_token.sum() / (per_token.shape[0] * max_new_tokens)
    else:
        tokens = all_tokens if all_tokens is not None else mask.sum()
        loss = per_token.sum() * ranks / tokens.clamp_min(1)
    with torch.no_grad():
        low = (ratio < 1 - clip) & (advantages < 0)
        high = (ratio > 1 + clip_high) & (advantages > 0)
        count = mask.sum().clamp_min(1)
        clip_fraction = ((low | high).float() * mask).sum() / count
        kl_mean = (kl.detach() * mask).sum() / count
    return LossParts(loss, clip_fraction, kl_mean)
