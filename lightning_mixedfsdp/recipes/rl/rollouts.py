"""Rollouts: completions sampled from the current policy, token by token, with the sampling distribution's log-prob
of each token kept (the generator's log-probs, PPO's old policy), and the training forward's log-probs of the same
tokens.

Prompts are left-padded to one length, so every row's next token is at the same column. An HF model whose cache
holds attention keys and values decodes with it, positions from the attention mask (``cumsum - 1``, as ``generate``
does; without them a left-padded row's tokens would sit at other positions than in training). A stateful model
(Mamba, Mamba-2, hybrids such as Jamba and Falcon-H1: ``compat.transformers.decodes_with_cache``) and the reference
model run their whole sequence each step, the trainer's forward; the reference model's left padding is a document of
its own (positions restarting at 0), which its attention never crosses.
A row ends at its end marker (the end-of-turn bytes, or the tokenizer's EOS) or after ``max_new_tokens``; ended rows
get padding, masked out of the loss.

A model whose embedding is larger than its tokenizer (a vocabulary padded to a multiple, a byte-level tokenizer on
a wider model) never samples an id the tokenizer lacks: both distributions are over the tokenizer's ``vocab``.

The log-probs are of the distribution sampled, in every place (the generator's mu, the trainer's pi_old and
pi_theta, the reference's): ``softmax(logits / temperature)``, and with ``top_p < 1`` that distribution restricted
to its nucleus (the smallest set of probability ``top_p``; the scored token always in it) and renormalised, as NeMo
RL computes filtered log-probs for the importance ratio. So the policy trained is the one that samples, and
on-policy the ratio of training to generator probabilities is 1 up to the kernels' rounding (the mismatch
:func:`log_prob_mismatch` measures); an unfiltered mu would put every importance weight off by the nucleus's mass.
Every logit comes from the model's own head, so a head in ``dtypes.fp32_compute_modules`` computes both in fp32."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.compat.transformers import cached_step, decodes_with_cache
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama


@dataclass
class Rollout:
    """One rank's sampled completions, ``rows = prompts x group_size`` (each prompt's group contiguous)."""

    input_ids: Tensor
    """``[rows, prompt_len + new]``: the left-padded prompt, then the completion, then padding."""
    attention_mask: Tensor
    """``[rows, prompt_len + new]``: 1 on the prompt's and the completion's tokens."""
    completion_mask: Tensor
    """``[rows, prompt_len + new]``: 1 on the completion's tokens (its end marker included): the trained tokens."""
    generator_log_probs: Tensor
    """``[rows, prompt_len + new]`` fp32: each completion token's log-prob as sampled (0 elsewhere)."""
    prompt_len: int

    @property
    def completion_lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)


def positions_of(attention_mask: Tensor) -> Tensor:
    """Each token's position from the attention mask: ``cumsum - 1`` (left padding at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def reference_positions(attention_mask: Tensor) -> Tensor:
    """The reference model's positions: the left padding one document (0, 1, ...), the sequence another from 0."""
    padding = (attention_mask == 0).long()
    return torch.where(attention_mask.bool(), positions_of(attention_mask), padding.cumsum(-1) - 1)


def forward_logits(model: nn.Module, ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The logits at every position of left-padded (and right-padded) rows, without a cache."""
    if isinstance(model, TinyLlama):
        return model(ids, reference_positions(attention_mask))
    positions = positions_of(attention_mask)
    return model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits


def within(logits: Tensor, vocab: Optional[int]) -> Tensor:
    """The logits of the tokenizer's ``vocab`` ids (all of them when None or as wide)."""
    return logits if vocab is None or vocab >= logits.shape[-1] else logits[..., :vocab]


def token_log_probs(
    logits: Tensor, targets: Tensor, temperature: float, vocab: Optional[int] = None, top_p: float = 1.0
) -> Tensor:
    """``log softmax(logits / temperature)`` of ``targets`` over the ``vocab`` ids, in fp32; with ``top_p < 1`` over
    the nucleus (``targets`` always in it), renormalised: the log-prob of the distribution sampled."""
    scaled = within(logits, vocab).float() / temperature
    if top_p < 1.0:
        scaled = scaled.masked_fill(~nucleus(scaled.detach(), top_p, targets), float("-inf"))
    log_probs = torch.log_softmax(scaled, dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def nucleus(scaled: Tensor, top_p: float, keep: Optional[Tensor] = None) -> Tensor:
    """Where ``softmax(scaled)``'s smallest set of probability ``top_p`` is (the top token always in it), and the
    ids ``keep`` (one per row) too."""
    probs = torch.softmax(scaled, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    inside_sorted = ordered.cumsum(-1) - ordered <= top_p
    inside = torch.zeros_like(inside_sorted).scatter(-1, order, inside_sorted)
    if keep is not None:
        inside = inside.scatter(-1, keep.unsqueeze(-1), True)
    return inside


def completion_log_probs(
    model: nn.Module, rollout: Rollout, temperature: float, vocab: Optional[int] = None, top_p: float = 1.0
) -> Tensor:
    """The training forward's log-prob of each completion token, ``[rows, len]`` (0 where not a completion token;
    the first column, never a completion token, 0 too), of the distribution sampled (:func:`token_log_probs`)."""
    ids = rollout.input_ids
    logits = forward_logits(model, ids, rollout.attention_mask)
    if top_p < 1.0:  # the nucleus (a sort over the vocabulary) at the completion tokens only, not every position
        scored = rollout.completion_mask[:, 1:].bool()
        picked = torch.zeros(scored.shape, dtype=torch.float32, device=logits.device)
        picked = picked.masked_scatter(
            scored, token_log_probs(logits[:, :-1][scored], ids[:, 1:][scored], temperature, vocab, top_p)
        )
    else:
        picked = token_log_probs(logits[:, :-1], ids[:, 1:], temperature, vocab)
    picked = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    # where, not a product: a padded row's logits may be anything, and 0 * nan is nan
    return torch.where(rollout.completion_mask.bool(), picked, torch.zeros_like(picked))


def left_padded(prompts: Sequence[Sequence[int]], pad: int, device: torch.device) -> Dict[str, Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), length), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, length - len(prompt) :] = torch.tensor(list(prompt), device=device)
            mask[row, length - len(prompt) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: ``temperature`` 0 is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    end: Sequence[int],
    pad: int,
    generator: Optional[torch.Generator] = None,
    all_ended: Optional[Callable[[bool], bool]] = None,
    vocab: Optional[int] = None,
) -> Rollout:
    """One completion per prompt (repeat a prompt for a group), decoded until every row has its ``end`` marker or
    ``max_new_tokens``, over the tokenizer's ``vocab`` ids. ``all_ended`` (sharded generation: every decoding step
    all-gathers, so every rank must run as many): given whether this rank's rows all ended, whether every rank's
    did."""
    device = next(model.parameters()).device
    batch = left_padded(prompts, pad, device)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt_len, rows = ids.shape[1], ids.shape[0]
    end_ids = torch.tensor(list(end), device=device)
    ended = torch.zeros(rows, dtype=torch.bool, device=device)
    log_probs: List[Tensor] = []
    trained: List[Tensor] = []
    cache: Any = None
    cached = not isinstance(model, TinyLlama) and decodes_with_cache(model)
    for _ in range(sampling.max_new_tokens):
        if cached:
            fed = ids if cache is None else ids[:, -1:]
            positions = positions_of(mask)[:, -fed.shape[1] :]
            logits, cache = cached_step(model, fed, mask, positions, cache)
            logits = logits[:, -1]
        else:
            logits = forward_logits(model, ids, mask)[:, -1]
        scaled = within(logits, vocab).float() / max(sampling.temperature, 1e-6)
        if sampling.temperature == 0:
            token = scaled.argmax(-1)
        else:
            if sampling.top_p < 1.0:
                scaled = scaled.masked_fill(~nucleus(scaled, sampling.top_p), float("-inf"))
            token = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(-1)
        token = torch.where(ended, torch.full_like(token, pad), token)
        picked = torch.log_softmax(scaled, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
        log_probs.append(torch.where(ended, torch.zeros_like(picked), picked))
        trained.append((~ended).long())
        ids = torch.cat([ids, token.unsqueeze(-1)], dim=1)
        mask = torch.cat([mask, (~ended).long().unsqueeze(-1)], dim=1)
        if len(end_ids) and ids.shape[1] - prompt_len >= len(end_ids):
            ended |= (ids[:, -len(end_ids) :] == end_ids).all(-1)
        mine = bool(ended.all())
        done = all_ended(mine) if all_ended is not None else mine
        if done:
            break
    new = len(trained)
    zeros = torch.zeros((rows, prompt_len), device=device)
    return Rollout(
        input_ids=ids,
        attention_mask=mask,
        completion_mask=torch.cat([zeros.long(), torch.stack(trained, 1)], dim=1) if new else mask * 0,
        generator_log_probs=torch.cat([zeros, torch.stack(log_probs, 1)], dim=1) if new else zeros,
        prompt_len=prompt_len,
    )


def completions_text(rollout: Rollout, decode: Callable[[List[int]], str]) -> List[str]:
    """Each row's completion decoded (its end marker and padding left out by the caller's ``decode``)."""
    rows = rollout.input_ids[:, rollout.prompt_len :]
    lengths = rollout.completion_mask[:, rollout.prompt_len :].sum(-1)
    return [decode(row[: int(n)].tolist()) for row, n in zip(rows, lengths, strict=True)]


def log_prob_mismatch(train: Tensor, generator: Tensor, completion_mask: Tensor) -> Tensor:
    """Mean over completion tokens of ``|p_train / p_generator - 1|``."""
    mask = completion_mask.bool()
    ratio = torch.exp((train - generator).float())
    return (ratio - 1).abs()[mask].mean() if mask.any() else ratio.new_zeros(())
