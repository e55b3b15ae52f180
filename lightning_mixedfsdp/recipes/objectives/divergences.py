"""Distillation losses over chunks of tokens: each chunk's logits are made from the two models' final hidden states
and output weights, compared, and dropped; backward makes them again (activation checkpointing of the chunk), so no
step holds either model's ``[tokens, vocab]`` logits, only one chunk's.

Per token, at temperature ``T`` (``p = softmax(logits / T)``, the teacher's ``p_t``, the student's ``p_s``), over the
tokenizer's ``vocab`` real tokens (rows a model pads its vocabulary with are left out):

- ``forward_kl``: ``KL(p_t || p_s) = sum p_t (log p_t - log p_s)`` (the student covers what the teacher says)
- ``reverse_kl``: ``KL(p_s || p_t) = sum p_s (log p_s - log p_t)`` (the student stays where the teacher is sure)
- ``jsd``: ``(KL(p_t || m) + KL(p_s || m)) / 2`` with ``m = (p_t + p_s) / 2``

each times ``T**2`` (Hinton's scaling: the gradients keep their size as ``T`` grows). The labels' cross-entropy is the
student's, over its whole vocabulary, at temperature 1."""

import math
from typing import Literal, NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCES: Tuple[Divergence, ...] = ("forward_kl", "reverse_kl", "jsd")


def token_divergences(student_logits: Tensor, teacher_logits: Tensor, kind: Divergence, temperature: float) -> Tensor:
    """The divergence of each token (rows of ``[tokens, vocab]`` logits, in fp32), times ``temperature**2``."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if kind == "forward_kl":
        per_token = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    elif kind == "reverse_kl":
        per_token = F.kl_div(log_t, log_s, log_target=True, reduction="none").sum(-1)
    elif kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_s, log_t]), dim=0) - math.log(2.0)
        to_t = F.kl_div(log_m, log_t, log_target=True, reduction="none").sum(-1)
        to_s = F.kl_div(log_m, log_s, log_target=True, reduction="none").sum(-1)
        per_token = (to_t + to_s) / 2
    else:
        raise ValueError(f"divergence {kind!r} is not one of {list(DIVERGENCES)}")
    return per_token * temperature**2


class DistillationSums(NamedTuple):
    divergence: Tensor
    """The sum of the trained tokens' divergences."""
    cross_entropy: Tensor
    """The sum of the trained tokens' cross-entropies against their labels."""
    tokens: int
    """How many tokens were trained."""


def distillation_sums(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    vocab: int,
    kind: Divergence = "forward_kl",
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    ignore_index: int = -100,
) -> DistillationSums:
    """The divergence and cross-entropy sums over the tokens whose ``targets`` are not ``ignore_index``.

    ``student_hidden`` ``[..., D_s]`` and ``teacher_hidden`` ``[..., D_t]`` are the hidden states each model's output
    projection reads at the positions of ``targets`` ``[...]`` (the next tokens); ``student_weight`` ``[V_s, D_s]``
    and ``teacher_weight`` ``[V_t, D_t]`` are the projections (``V >= vocab``: padded vocabularies are fine). Tokens
    are taken ``chunk_tokens`` at a time."""
    trained = targets.reshape(-1) != ignore_index
    student_rows = student_hidden.reshape(-1, student_hidden.shape[-1])[trained]
    teacher_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[trained]
    labels = targets.reshape(-1)[trained]
    divergence = student_rows.new_zeros((), dtype=torch.float32)
    cross_entropy = student_rows.new_zeros((), dtype=torch.float32)
    teacher_weight = teacher_weight[:vocab]
    for start in range(0, labels.numel(), chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        chunk = checkpoint(
            _chunk_sums,
            student_rows[rows],
            student_weight,
            teacher_rows[rows],
            teacher_weight,
            labels[rows],
            vocab,
            kind,
            temperature,
            use_reentrant=False,
        )
        divergence = divergence + chunk[0]
        cross_entropy = cross_entropy + chunk[1]
    return DistillationSums(divergence, cross_entropy, int(labels.numel()))


def _chunk_sums(
    student_rows: Tensor,
    student_weight: Tensor,
    teacher_rows: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    vocab: int,
    kind: Divergence,
    temperature: float,
) -> Tuple[Tensor, Tensor]:
    student_logits = (student_rows @ student_weight.t()).float()
    with torch.no_grad():
        teacher_logits = (teacher_rows @ teacher_weight.t()).float()
    divergence = token_divergences(student_logits[:, :vocab], teacher_logits, kind, temperature).sum()
    cross_entropy = F.cross_entropy(student_logits, labels, reduction="sum")
    return divergence, cross_entropy
