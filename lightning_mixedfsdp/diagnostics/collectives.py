"""Counting the collectives a step issues (tests and benchmarks): calls and bytes per c10d function."""

from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator

import torch

# FSDP2 on torch 2.13 issues all_gather_single / reduce_scatter_single; the rest cover other versions and our code
COUNTED_COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
)


class CollectiveCounts:
    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def by_kind(self) -> Dict[str, int]:
        """Calls folded into ``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``broadcast``."""
        kinds: Counter = Counter()
        for name, count in self.calls.items():
            kinds[_kind(name)] += count
        return dict(kinds)

    def bytes_by_kind(self) -> Dict[str, int]:
        kinds: Counter = Counter()
        for name, count in self.bytes.items():
            kinds[_kind(name)] += count
        return dict(kinds)


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Patch ``torch.distributed``'s collectives for the duration; callers look them up at call time."""
    import torch.distributed as dist

    counts = CollectiveCounts()
    originals = {name: getattr(dist, name) for name in COUNTED_COLLECTIVES if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, _counting(name, original, counts))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _counting(name: str, original: Callable, counts: CollectiveCounts) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts.calls[name] += 1
        # the largest buffer: the gathered output of an all-gather, the unreduced input of a reduce-scatter
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        counts.bytes[name] += max((t.numel() * t.element_size() for t in tensors), default=0)
        return original(*args, **kwargs)

    return wrapper


def _kind(name: str) -> str:
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        if name.startswith(kind):
            return kind
    return name
