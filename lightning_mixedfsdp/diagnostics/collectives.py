"""Counting the collectives a step issues (tests and benchmarks): calls and bytes per c10d function."""

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from lightning_mixedfsdp.compat.torch import collective_process_group, group_backend_for

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
    "all_to_all_single",  # Muon's exchange (apply/muon_exchange.py)
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


@dataclass(frozen=True)
class CollectiveBackend:
    """One collective: its op, the device of its tensors, and its process group's backend for that device (None: the
    group has none, and the collective cannot run)."""

    op: str
    device: str
    backend: Optional[str]


@contextmanager
def checking_collective_backends(strict: bool = True) -> Iterator[List[CollectiveBackend]]:
    """Record every collective issued inside (``c10d`` and functional collectives, whoever calls them: FSDP, DTensor,
    the library) with its tensors' device and the backend its group has for that device. ``strict``: a collective
    whose group has no backend for its tensors' device raises an AssertionError naming it, before it runs."""
    records: List[CollectiveBackend] = []

    def check(func: Any, args: Any, group: Any) -> None:
        for device in sorted({t.device.type for t in _tensors(args)}):
            backend = group_backend_for(group, device) if group is not None else None
            records.append(CollectiveBackend(str(func), device, backend))
            if strict and group is not None and backend is None:
                raise AssertionError(
                    f"{func}: a collective on {device} tensors over a process group with no backend for"
                    f" {device} ({_backend_name(group)})"
                )

    with _seeing_collectives(check):
        yield records


@contextmanager
def _seeing_collectives(see: Callable[[Any, Any, Any], None]) -> Iterator[None]:
    """``see(op, args, process group)`` before every ``c10d`` and functional collective issued inside (whoever calls
    it: FSDP, DTensor, the library; the group None where the op carries none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seer(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            namespace = getattr(func, "namespace", "")
            if namespace in ("c10d", "_c10d_functional") and not func.__name__.startswith(("wait", "_wrap")):
                see(func, args, collective_process_group(list(args) + list((kwargs or {}).values())))
            return func(*args, **(kwargs or {}))

    with Seer():
        yield


@dataclass(frozen=True)
class GroupTraffic:
    """One collective or point-to-point op as one rank sees it: its process group, its op, and the bytes this rank
    sends for it over a ring (all-gather and reduce-scatter ``(n - 1) / n`` of the whole buffer, all-reduce twice
    that, all-to-all ``(n - 1) / n`` of its input, a send the tensor, a receive nothing: its sender counts it)."""

    group: Any
    op: str
    sent_bytes: float


@contextmanager
def recording_group_traffic() -> Iterator[List[GroupTraffic]]:
    """Record every c10d op issued inside (FSDP's, DTensor's, the pipeline runner's sends, the library's), with its
    group and the bytes this rank sends for it (:class:`GroupTraffic`)."""
    records: List[GroupTraffic] = []

    def record(func: Any, args: Any, group: Any) -> None:
        if group is not None:
            largest = max((t.numel() * t.element_size() for t in _tensors(args)), default=0)
            records.append(GroupTraffic(group, func.__name__, _ring_share(func.__name__, largest, group)))

    with _seeing_collectives(record):
        yield records


def _ring_share(op: str, largest: int, group: Any) -> float:
    size = group.size()
    if op.startswith("recv"):
        return 0.0
    if op.startswith("send") or op.startswith("broadcast"):
        return float(largest)
    share = (size - 1) / size * largest
    return 2 * share if op.startswith("allreduce") or op.startswith("all_reduce") else share


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _backend_name(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "unknown backend"
