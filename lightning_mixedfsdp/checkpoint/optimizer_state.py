"""Resuming optimizers whose params do not all have state yet: an expert no token reached, an indexer or an unused
module got no grad, so AdamW made no state for it and the checkpoint holds none.

Lightning's load asks torch for the optimizer's state dict to fill, and torch first gives *every* param state (a
zero-grad step at lr 0) when the optimizer has none, so DCP looks for state the checkpoint does not hold and fails
(``Missing key in checkpoint state_dict: optimizer.state.<param>.step``), and torch's own setter refuses missing
state too. Around that load, each optimizer gets state for exactly the params whose state the checkpoint holds for
this rank's shard: the loaded optimizer is the saved one, "no state yet" included, so the next steps equal the
uninterrupted run's (AdamW's bias correction counts the steps a param really took).

Ranks may differ, though DCP writes a param's state only when every rank has its part: around a save where they do,
the ranks without state make a stand-in (zeros, and the holders' step counts, which DCP writes once for all ranks),
the shards it covers are recorded in the checkpoint's metadata (``ABSENT_STATE_KEY``), and the stand-in is dropped
again. The load reads that record: a rank whose shard lies within it gets no state.
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mixedfsdp.apply.semi_sync_checkpoint import STEPS_KEY
from lightning_mixedfsdp.checkpoint.atomic import DCP_METADATA, LIGHTNING_METADATA_FILENAME
from lightning_mixedfsdp.compat.torch import local_chunk
from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.model.tensors import local_tensor

ABSENT_STATE_KEY = "mixed_fsdp2_params_without_optimizer_state"
"""The checkpoint metadata key of the shards saved with a stand-in state: optimizer key -> param name -> regions."""

Region = Tuple[Tuple[int, ...], Tuple[int, ...]]
AbsentState = Dict[str, Dict[str, List[Region]]]


class AbsentStateRecord:
    """Where stand-in states were made for the checkpoint being saved, carried from the hook that makes them to the
    one that writes the file. The Trainer calls ``Strategy.optimizer_state`` once per optimizer while it assembles a
    checkpoint (``_CheckpointConnector.dump_checkpoint``), then ``Strategy.save_checkpoint`` with the result: the
    first hook :meth:`add`\ s, the second :meth:`take`\ s what to save under ``ABSENT_STATE_KEY``."""

    def __init__(self) -> None:
        self._pending: AbsentState = {}

    def add(self, absent: AbsentState) -> None:
        self._pending.update(absent)

    def take(self) -> AbsentState:
        """What was added since the last take (empty: no stand-in), forgotten here."""
        pending, self._pending = self._pending, {}
        return pending


@contextmanager
def standing_in_for_state_ranks_lack(
    module: nn.Module, optimizers: Mapping[str, Optimizer], group: Any = None
) -> Iterator[AbsentState]:
    """Around a save of ``optimizers`` (by key) on every rank: where some ranks hold state for a param and others do
    not, the others hold a stand-in for the save; yields what to record under ``ABSENT_STATE_KEY`` (empty when the
    ranks agree, the usual case: one small all-reduce). ``group``: the ranks that hold the same params (a pipeline
    stage's; None: every rank)."""
    import torch.distributed as dist

    if not optimizers or not dist.is_available() or not dist.is_initialized():
        yield {}
        return
    names = {id(p): canonical_name(n) for n, p in module.named_parameters()}
    params = [p for optimizer in optimizers.values() for p in _params(optimizer)]
    holders = torch.tensor(
        [p in optimizer.state for optimizer in optimizers.values() for p in _params(optimizer)],
        dtype=torch.int32,
        device=local_tensor(params[0]).device if params else None,
    )
    dist.all_reduce(holders, group=group)
    counts = holders.tolist()
    world = dist.get_world_size(group)
    if all(count in (0, world) for count in counts):
        yield {}
        return
    stand_ins: Dict[str, List[Tensor]] = {}
    index = 0
    for key, optimizer in optimizers.items():
        for param in _params(optimizer):
            if 0 < counts[index] < world and param not in optimizer.state:
                stand_ins.setdefault(key, []).append(param)
            index += 1
    for key, lacking in stand_ins.items():
        init_state(optimizers[key], lacking)
    mine = {
        key: {names[id(p)]: local_chunk(p) for p in lacking if id(p) in names} for key, lacking in stand_ins.items()
    }
    every_rank: List[Any] = [None] * world
    dist.all_gather_object(every_rank, (mine, _scalar_states(optimizers, names, counts, world)), group=group)
    absent: AbsentState = {}
    scalars: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for regions, holder_scalars in every_rank:
        for key, by_name in regions.items():
            for name, region in by_name.items():
                absent.setdefault(key, {}).setdefault(name, []).append(region)
        for where, values in holder_scalars.items():
            scalars.setdefault(where, values)
    for key, lacking in stand_ins.items():
        for param in lacking:
            for state_name, value in scalars.get((key, names.get(id(param), "")), {}).items():
                optimizers[key].state[param][state_name].fill_(value)
    try:
        yield absent
    finally:
        for key, lacking in stand_ins.items():
            for param in lacking:
                optimizers[key].state.pop(param, None)


def _scalar_states(
    optimizers: Mapping[str, Optimizer], names: Dict[int, str], counts: List[int], world: int
) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """This rank's one-element state values (AdamW's ``step``) of the params only some ranks hold state for."""
    values: Dict[Tuple[str, str], Dict[str, Any]] = {}
    index = 0
    for key, optimizer in optimizers.items():
        for param in _params(optimizer):
            if 0 < counts[index] < world and param in optimizer.state:
                values[(key, names.get(id(param), ""))] = {
                    state_name: value.item()
                    for state_name, value in optimizer.state[param].items()
                    if isinstance(value, Tensor) and value.numel() == 1 and not _is_dtensor(value)
                }
            index += 1
    return values


def _params(optimizer: Optimizer) -> List[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_dtensor(tensor: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


@contextmanager
def restoring_missing_state(
    path: Path, module: nn.Module, optimizers: Mapping[str, Optimizer], weights_only: Optional[bool] = None
) -> Iterator[None]:
    """Lightning's load of ``optimizers`` (by their keys in the checkpoint at ``path``) inside this restores "no state
    yet" for the params the checkpoint holds no state for on this rank.

    torch gives state (its zero-grad step at lr 0) and demands saved state only for params that require grad, so
    such params are frozen for the load and thawed after it; where some are, the optimizer's current state is
    dropped first, since the load replaces it and torch only makes fresh state for an optimizer that has none.
    """
    missing = params_without_saved_state(path, module, optimizers, weights_only)
    frozen = [p for p in missing if p.requires_grad]
    if frozen:
        for optimizer in optimizers.values():
            optimizer.state.clear()
    for param in frozen:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(True)


def params_without_saved_state(
    path: Path, module: nn.Module, optimizers: Mapping[str, Optimizer], weights_only: Optional[bool] = None
) -> List[Tensor]:
    """The params of ``optimizers`` whose state the checkpoint at ``path`` does not hold for this rank's shard
    (``weights_only`` as for Lightning's load of a single file)."""
    names = {id(p): canonical_name(n) for n, p in module.named_parameters()}
    if path.is_dir() and (path / DCP_METADATA).is_file():
        held = _held_in_sharded(path, optimizers, names)
        metadata = path / LIGHTNING_METADATA_FILENAME
        absent = torch.load(metadata, weights_only=weights_only).get(ABSENT_STATE_KEY, {}) if metadata.is_file() else {}
    elif path.is_file():
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        states = (
            list(checkpoint["optimizer_states"])  # the Trainer's list
            if "optimizer_states" in checkpoint
            else [checkpoint.get(key, {}) for key in optimizers]
        )
        pairs = zip(optimizers.items(), states, strict=False)  # a missing optimizer: Lightning's load says so
        held = {key: _held_in_full(state, optimizer) for (key, optimizer), state in pairs}
        absent = {}  # a full state dict gathers the shards: a stand-in is indistinguishable there
    else:
        return []  # Lightning's load says what is wrong with the path
    return [
        p
        for key, optimizer in optimizers.items()
        for p in _params(optimizer)
        if id(p) not in held[key] or _covers(absent.get(key, {}).get(names.get(id(p), ""), []), local_chunk(p))
    ]


def _held_in_sharded(path: Path, optimizers: Mapping[str, Optimizer], names: Dict[int, str]) -> Dict[str, Set[int]]:
    """Per optimizer key, the params (by ``id``) whose every state tensor covers this rank's shard in the DCP folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    held: Dict[str, Set[int]] = {}
    for key, optimizer in optimizers.items():
        held[key] = set()
        for group in optimizer.param_groups:
            for param in group["params"]:
                prefix = f"{key}.state.{names.get(id(param), '')}."
                entries = [meta for name, meta in saved.items() if name.startswith(prefix)]
                region = local_chunk(param)
                if entries and all(
                    not isinstance(meta, TensorStorageMetadata)
                    or meta.size == torch.Size([])
                    or _covers([(c.offsets, c.sizes) for c in meta.chunks], region)
                    for meta in entries
                ):
                    held[key].add(id(param))
    return held


def _covers(chunks: List[Any], region: Region) -> bool:
    """Whether the chunks ``(offsets, sizes)`` (which do not overlap) cover ``region`` of this rank; an empty
    region is covered only by some chunk."""
    if not chunks:
        return False
    offsets, sizes = region
    volume = 1
    for size in sizes:
        volume *= size
    covered = 0
    for chunk_offsets, chunk_sizes in chunks:
        overlap = 1
        for start, size, chunk_start, chunk_size in zip(offsets, sizes, chunk_offsets, chunk_sizes, strict=True):
            overlap *= max(0, min(start + size, chunk_start + chunk_size) - max(start, chunk_start))
        covered += overlap
    return covered >= volume


def _held_in_full(state: Mapping[str, Any], optimizer: Optimizer) -> Set[int]:
    """The params (by ``id``) with state in a full optimizer state dict, keyed by name or by index in ``params``."""
    saved = state.get("state", {})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_order = [k for group in state.get("param_groups", []) for k in group["params"]]
    if len(saved_order) != len(params):  # torch will refuse this load with its own message
        return {id(p) for p in params}
    return {id(p) for p, k in zip(params, saved_order, strict=True) if k in saved}


def holds_outer_state(path: Path, weights_only: Optional[bool] = None) -> bool:
    """Whether the checkpoint at ``path`` holds semi-synchronous replicas' outer state (``apply/semi_sync.py``) in
    its optimizers' states."""
    if path.is_dir() and (path / DCP_METADATA).is_file():
        from torch.distributed.checkpoint import FileSystemReader

        names = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return any(name.endswith(f".{STEPS_KEY}") for name in names)
    if not path.is_file():
        return False  # Lightning's load says what is wrong with the path
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    states = list(checkpoint.get("optimizer_states", [])) + [v for v in checkpoint.values() if isinstance(v, dict)]
    return any(
        isinstance(entry, dict) and STEPS_KEY in entry
        for state in states
        if isinstance(state, dict) and isinstance(state.get("state"), dict)
        for entry in state["state"].values()
    )


def optimizer_state_by_name(path: Path) -> bool:
    """Whether the DCP checkpoint at ``path`` keys its optimizers' param groups by param name (torch's
    ``flatten_optimizer_state_dict``: ``optimizer.param_groups.<name>.lr``, as pipeline-parallel saves do) rather
    than by index (``optimizer.param_groups.0.lr``)."""
    if not (path.is_dir() and (path / DCP_METADATA).is_file()):
        return False
    from torch.distributed.checkpoint import FileSystemReader

    names = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    groups = [name.split(".param_groups.", 1)[1] for name in names if ".param_groups." in name]
    return any(not entry.split(".", 1)[0].isdigit() for entry in groups)


@torch.no_grad()
def init_state(optimizer: Optimizer, params: List[Tensor]) -> None:
    """State for ``params`` only, made as torch's ``get_optimizer_state_dict`` makes it for all: one step with zero
    grads at learning rate 0, every other param without a grad, so nothing moves."""
    chosen = {id(p) for p in params}
    grads = {id(p): p.grad for p in _params(optimizer)}
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], Tensor) else 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p) if id(p) in chosen else None
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
            group["lr"] = lr
            for p in group["params"]:
                p.grad = grads[id(p)]
