"""The reference's log-probabilities computed once (``preference.reference=precomputed``): before training, the policy
at its starting weights scores every training and held-out pair in one pass, and no reference model takes part in
training. The scores are stored in the run folder (:data:`FILE`), keyed by a digest of the pairs' rows and the
starting weights' folder, so a resumed launch reads them instead of scoring again.

The pass shares the pairs over the data-parallel ranks and every rank runs as many forwards (FSDP's all-gathers pair
up across ranks; a rank short of pairs repeats one and drops its score); an all-reduce then gives every rank all the
scores (``[pairs, 2]`` summed log-probabilities, chosen then rejected: a few bytes a pair)."""

import hashlib
import math
from pathlib import Path
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import default_collate

from lightning_mixedfsdp.recipes.data.preference import PairSet, pair_batch

FILE = "reference_log_probs.pt"
"""The stored scores' file name in the run folder."""

Scorer = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(ids, labels, positions) -> each row's summed log-probability of its trained tokens``."""


def pairs_digest(pair_sets: Dict[str, PairSet], starting_weights: str) -> str:
    """What the stored scores depend on: every pair's tokens and masks, and the folder the policy starts from."""
    digest = hashlib.sha256(str(Path(starting_weights).resolve()).encode())
    for name, pairs in sorted(pair_sets.items()):
        digest.update(name.encode())
        for field in ("input_ids", "labels"):
            digest.update(pairs.rows[field][: len(pairs)].contiguous().numpy().tobytes())
    return digest.hexdigest()


def score_pairs(score: Scorer, pairs: PairSet, batch_size: int, device: torch.device) -> Tensor:
    """``[len(pairs), 2]`` fp32: each pair's chosen and rejected answers' summed log-probabilities under ``score``
    (run under ``no_grad``), this rank scoring its share, every rank returned all."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = list(range(rank, len(pairs), world))
    forwards = math.ceil(math.ceil(len(pairs) / world) / batch_size)  # the same on every rank
    scores = torch.zeros(len(pairs), 2, dtype=torch.float32, device=device)
    for index in range(forwards):
        kept = mine[index * batch_size : (index + 1) * batch_size]
        filler = kept[:1] or mine[:1] or [0]
        indices = kept + filler * (batch_size - len(kept))
        batch = {name: tensor.to(device) for name, tensor in default_collate([pairs[i] for i in indices]).items()}
        with torch.no_grad():
            sums = score(*pair_batch(batch)).float()
        rows = torch.tensor(kept, dtype=torch.long, device=device)
        scores[rows, 0], scores[rows, 1] = sums[: len(kept)], sums[batch_size : batch_size + len(kept)]
    if distributed:
        dist.all_reduce(scores)  # each pair scored by one rank, zeros elsewhere: the sum is exact
    return scores.cpu()


class StoredScores(NamedTuple):
    folder: Optional[str]
    """The run folder the scores are stored in (None: nowhere)."""
    starting_weights: str
    """The folder the policy starts from: part of what the scores are keyed by."""

    def read(self, digest: str) -> Optional[Dict[str, Tensor]]:
        """The scores stored for these pairs and starting weights, or None."""
        path = Path(self.folder) / FILE if self.folder is not None else None
        if path is None or not path.is_file():
            return None
        stored = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(stored, dict) or stored.get("digest") != digest:
            return None
        return {name: tensor for name, tensor in stored["scores"].items()}

    def write(self, digest: str, scores: Dict[str, Tensor]) -> Optional[Path]:
        """Writes the scores (rank 0 calls it); the path, or None without a folder."""
        if self.folder is None:
            return None
        path = Path(self.folder) / FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save({"digest": digest, "scores": scores}, partial)
        partial.replace(path)  # a launch killed while writing leaves no half-written file under the name read back
        return path


def stored_or_scored(
    score: Scorer,
    pair_sets: Dict[str, PairSet],
    batch_size: int,
    device: torch.device,
    stored: StoredScores,
    strategy: Any,
    load_starting_weights: Optional[Callable[[], None]],
) -> Dict[str, Tensor]:
    """Every split's scores: read from the run folder (rank 0 reads, the Lightning ``strategy`` broadcasts), or
    scored (after ``load_starting_weights``, for a resumed run whose own weights come later) and stored."""
    digest = pairs_digest(pair_sets, stored.starting_weights)
    found = strategy.broadcast(stored.read(digest) if strategy.is_global_zero else None)
    if found is not None:
        rank_zero_info(f"preference: the reference's scores read from {Path(stored.folder or '') / FILE}")
        return found
    if load_starting_weights is not None:
        load_starting_weights()
    scores = {name: score_pairs(score, pairs, batch_size, device) for name, pairs in pair_sets.items()}
    path = stored.write(digest, scores) if strategy.is_global_zero else None
    counts = ", ".join(f"{len(tensor)} {name.replace('_', '-')}" for name, tensor in scores.items())
    where = f", stored in {path}" if path is not None else ""
    rank_zero_info(f"preference: the reference's scores of {counts} pairs computed before training{where}")
    strategy.barrier()
    return scores


def looked_up(scores: Tensor, pair_index: Tensor) -> Tensor:
    """The stored scores of a micro-batch's pairs in :func:`pair_batch`'s row order: every chosen, then every
    rejected."""
    picked = scores.to(pair_index.device)[pair_index]
    return torch.cat([picked[:, 0], picked[:, 1]])
