"""GRPO's generator ranks (``rl.generation: ranks``), from the trainers' side: ``rl.generator_ranks`` processes
started beside trainer rank 0 (``python -m lightning_mixedfsdp.recipes.run.generator_process``), each holding the
policy whole in the plan's dtypes, fed the trainers' weights after every optimizer step and asked for rollouts.

Trainer rank 0 is the one bridge: every trainer rank takes part in streaming the weights
(``checkpoint/weight_stream.py``: the FSDP collectives that assemble each tensor), rank 0 sends each bucket whole
over the generators' own process group once it is assembled (so no FSDP collective of rank 0's runs while it
sends), and hands each trainer rank its rollout (one broadcast over the trainers). A rollout carries the weight
version it was sampled with: version v is the weights after v optimizer steps.

``rl.max_staleness: 1`` asks for the next rollout right after receiving the current one, with the current weights:
the generators sample it while the trainers train, and the rollout trained at step k was sampled with step k-1's
weights. A generator that fails sends its traceback in place of the rollout, and every trainer rank raises it."""

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.weight_stream import stream_buckets, streamed_tensors
from lightning_mixedfsdp.compat.torch import rendezvous_store, standalone_gloo_group
from lightning_mixedfsdp.recipes.rl import sync_wire
from lightning_mixedfsdp.recipes.rl.rollouts import Rollout

GENERATOR_MODULE = "lightning_mixedfsdp.recipes.run.generator_process"
LAUNCH_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip
"""The trainers' launch variables, left out of a generator's environment: it is a world of its own."""


@dataclass
class Produced:
    """A trainer rank's rollout from a generator, scored there."""

    rollout: Rollout
    rewards: Tensor
    means: Dict[str, float]
    version: int


def seed_of(seed: int, index: int, rank: int) -> int:
    """The sampling seed of trainer ``rank``'s part of rollout ``index`` (the colocated sampler's: the same tokens)."""
    return seed * 1_000_003 + index * 7919 + rank


class GeneratorRanks:
    """The trainers' handle on the generator processes (every trainer rank holds one; rank 0 talks to them)."""

    def __init__(self, count: int, recipe: Any, bucket_bytes: int, verify: bool = False, timeout_s: float = 1800.0):
        self.count, self.recipe, self.bucket_bytes, self.timeout_s = count, recipe, bucket_bytes, timeout_s
        self.verify = verify
        self.processes: List[subprocess.Popen] = []
        self.group: Optional[Any] = None
        self.synced_version = -1
        self.pending: Optional[int] = None
        self.layout_sent = False
        self.folder: Optional[Path] = None

    @property
    def bridge(self) -> bool:
        return dist.get_rank() == 0

    def start(self) -> None:
        """Trainer rank 0 starts the generators and joins their process group (every trainer rank calls)."""
        if not self.bridge:
            return
        store = rendezvous_store("127.0.0.1", 0, 1 + self.count, True, self.timeout_s)
        self.folder = Path(tempfile.mkdtemp(prefix="generator_ranks_"))  # removed at close
        recipe_file = self.folder / "recipe.pkl"
        recipe_file.write_bytes(pickle.dumps(self.recipe))
        environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENVIRONMENT}
        for rank in range(1, 1 + self.count):
            command = [sys.executable, "-m", GENERATOR_MODULE, str(recipe_file), f"127.0.0.1:{store.port}",
                       str(rank), str(1 + self.count)]  # fmt: skip
            self.processes.append(subprocess.Popen(command, env=environment))
        self.group = standalone_gloo_group(store, 0, 1 + self.count, self.timeout_s)
        self._store = store

    def rollout(
        self, model: nn.Module, keep_fp32: Collection[str], index: int, step: int, prompts: List[int],
        upcoming: Optional[List[int]], seed: int, device: torch.device,
    ) -> Produced:  # fmt: skip
        """This trainer rank's part of rollout ``index`` (``prompts``: its prompts' indices), asked for now with the
        weights of ``step`` unless it was asked for a step early; ``upcoming`` (one step stale): the next rollout's
        prompts, asked for before returning, with the same weights."""
        if self.pending != index:
            self.sync(model, keep_fp32, step)
            self.request(index, step, prompts, seed)
        produced = self.receive(device)
        if upcoming is not None:
            self.sync(model, keep_fp32, step)
            self.request(index + 1, step, upcoming, seed)
        return produced

    def sync(self, model: nn.Module, keep_fp32: Collection[str], version: int) -> None:
        """Stream ``model``'s weights (version ``version``) to the generators, unless they hold that version; with
        ``verify``, compare the generators' hashes of their params with the hash of what was sent."""
        verify = self.verify
        if version == self.synced_version:
            return
        group = self.group
        if self.bridge and not self.layout_sent:
            tensors, _ = streamed_tensors(model, adapters_only=False)
            sync_wire.send_command(group, sync_wire.LAYOUT)
            sync_wire.broadcast_object(group, [(p.name, tuple(p.shape), str(p.dtype)) for p in tensors])
            self.layout_sent = True
        if self.bridge:
            sync_wire.send_command(group, sync_wire.WEIGHTS, version, count=int(verify))
        digest = hashlib.sha256()
        # the model's own names: a generator holds the trainers' model class and receives into its params
        for bucket in stream_buckets(model, keep_fp32, self.bucket_bytes, None, 0, checkpoint_names=False):
            for _, tensor in bucket:  # rank 0's bucket: whole tensors; the others' are empty
                sync_wire.send_tensor(group, tensor)
                if verify:
                    digest.update(sync_wire.tensor_bytes(tensor))
            bucket.clear()  # sent: one bucket held at a time
        self.synced_version = version
        if verify:
            self._check_digests(digest.hexdigest(), version)

    def _check_digests(self, sent: str, version: int) -> None:
        """Every generator's hash of its params against ``sent``, decided on rank 0, raised on every trainer rank."""
        verdict: List[Any] = [None]
        if self.bridge:
            held = [sync_wire.receive_object(self.group, rank) for rank in range(1, 1 + self.count)]
            verdict = [[rank for rank, digest in enumerate(held, start=1) if digest != sent]]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise RuntimeError(
                f"GroupRelativePolicyOptimization: after the weight sync of version {version}, generator rank(s)"
                f" {verdict[0]} hold other params than the trainers sent (SHA-256 differs); report this with the"
                " recipe and the model class"
            )

    def request(self, index: int, version: int, prompt_indices: List[int], seed: int) -> None:
        """Ask for rollout ``index``: every trainer rank's prompts (their indices in the training set)."""
        every_rank: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, prompt_indices)
        if self.bridge:
            sync_wire.send_command(self.group, sync_wire.REQUEST, version, index, len(every_rank))
            sync_wire.broadcast_object(self.group, {"index": index, "version": version, "seed": seed,
                                                    "prompts": every_rank})  # fmt: skip
        self.pending = index

    def receive(self, device: torch.device) -> Produced:
        """This trainer rank's part of the pending rollout."""
        every_rank: List[Any] = [None]
        if self.bridge:
            ranks = dist.get_world_size()
            every_rank = [[sync_wire.receive_object(self.group, 1 + r % self.count) for r in range(ranks)]]
        dist.broadcast_object_list(every_rank, src=0)
        mine = every_rank[0][dist.get_rank()]
        self.pending = None
        if "error" in mine:
            raise RuntimeError(f"GroupRelativePolicyOptimization: a generator rank failed:\n{mine['error']}")
        tensors = [
            mine[k].to(device) for k in ("input_ids", "attention_mask", "completion_mask", "generator_log_probs")
        ]
        rollout = Rollout(tensors[0], tensors[1], tensors[2], tensors[3], mine["prompt_len"])
        return Produced(rollout, mine["rewards"].to(device), mine["means"], mine["version"])

    def close(self) -> None:
        """Stop the generators and wait for them (killed after a minute)."""
        if self.group is not None:
            try:
                sync_wire.send_command(self.group, sync_wire.STOP)
            except RuntimeError:  # a generator already gone: nothing to stop
                pass
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes, self.group = [], None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
