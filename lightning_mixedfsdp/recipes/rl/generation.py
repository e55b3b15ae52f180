"""Decoding rollouts on the sharded policy, in the ``rl.generation`` mode: ``gathered`` holds every unit unsharded
for the rollout (``apply/gathered.py``: one all-gather per unit, none per token, so each rank stops at its own end);
``sharded`` keeps FSDP's all-gathers at every decoding step, so every rank runs as many steps as the slowest: an end
flag is all-reduced after each."""

from contextlib import nullcontext
from typing import ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_mixedfsdp.apply.gathered import gathered_params
from lightning_mixedfsdp.recipes.rl.rollouts import Rollout, Sampling, sample

GENERATIONS = ("gathered", "sharded", "ranks")
"""``ranks`` decodes in the generator processes (``generator_ranks.py``); the trainers' own decoding is gathered."""


def every_rank_ended(mine: bool, device: torch.device) -> bool:
    """Whether every rank's rows ended (``mine``: this rank's), all-reduced over the default group (on ``device``:
    NCCL reduces device tensors only)."""
    flag = torch.tensor([0 if mine else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def generate(
    model: nn.Module,
    root: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    end: Sequence[int],
    pad: int,
    mode: str,
    generator: Optional[torch.Generator] = None,
    vocab: Optional[int] = None,
) -> Rollout:
    """``prompts``' completions from ``model`` (``root``: the module FSDP's root is in) in generation ``mode``."""
    launched = dist.is_available() and dist.is_initialized()
    gathered = mode in ("gathered", "ranks")  # a trainer of generator ranks evaluates gathered
    holding: ContextManager[None] = gathered_params(root, model) if gathered else nullcontext()
    device = next(model.parameters()).device
    all_ended = (lambda mine: every_rank_ended(mine, device)) if mode == "sharded" and launched else None
    with holding:
        return sample(model, prompts, sampling, end, pad, generator, all_ended, vocab)
