"""GRPO's group advantages written out in Python, row by row, for the tests' token-by-token loss formulas."""

import math
from typing import List

import torch


def written_advantages(rewards: torch.Tensor, group_size: int, scaled: bool) -> List[float]:
    """Each row's reward minus its group's mean, over the group's unbiased std + 1e-4 when ``scaled`` (grpo and
    dapo; dr_grpo is not scaled)."""
    advantages: List[float] = []
    for first in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[first : first + group_size]]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (group_size - 1))
        advantages += [(r - mean) / (std + 1e-4) if scaled else r - mean for r in group]
    return advantages
