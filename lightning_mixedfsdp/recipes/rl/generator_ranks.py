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
weights.

Faults: a generator that fails in a rollout sends its traceback in place of it. A generator process that exits (an
error before it joins: a bad device, no memory, an import; a kill mid-run) is found by trainer rank 0, which polls
the processes while it waits for them to join and checks them when a send or receive to them fails; it then ends its
part of the collective at hand without them, and every trainer rank raises at the next point where the trainers
meet rank 0 (the end of a start, a weight sync, a rollout), naming the generator, its exit code and the traceback it
left (each generator writes its own to the run's temporary folder before it exits). The processes themselves, their
clean environment and their stopping on every exit path (``close`` at a clean end, on a fault, on Lightning's
``on_exception``, at the trainer process's exit) are ``generator_processes.py``'s."""

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.weight_stream import stream_buckets, streamed_tensors
from lightning_mixedfsdp.recipes.rl import sync_wire
from lightning_mixedfsdp.recipes.rl.generator_processes import GeneratorDied, GeneratorProcesses
from lightning_mixedfsdp.recipes.rl.rollouts import Rollout

EXPLAIN_WAIT_S = 30
"""How long trainer rank 0 looks for a generator's exit after a failed exchange (a process tearing down a large
device context can take seconds to exit)."""


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
        self.processes = GeneratorProcesses(count, timeout_s)
        self.group: Optional[Any] = None
        self.synced_version = -1
        self.pending: Optional[int] = None
        self.layout_sent = False
        self.failure: Optional[str] = None  # rank 0: what went wrong with a generator, told to every rank next

    @property
    def bridge(self) -> bool:
        return dist.get_rank() == 0

    def start(self) -> None:
        """Trainer rank 0 starts the generators and waits for each to join their process group, looking at the
        processes meanwhile; every trainer rank calls, and every one raises if a generator exited first."""
        self.synced_version, self.pending, self.layout_sent, self.failure = -1, None, False, None  # a new fit
        if self.bridge:
            try:
                self.group = self.processes.start(self.recipe)
            except GeneratorDied as died:
                self.failure = str(died)
            except Exception as error:  # noqa: BLE001  # told to every rank, not raised on rank 0 alone
                self.failure = f"starting the generators failed: {error!r}"
        self._raise_on_every_rank("starting")

    def _guarded(self, when: str, talk: Callable[[], Any]) -> Any:
        """Rank 0's exchange with the generators; a failure that a dead generator explains is kept for every rank
        (the collective at hand goes on without the generators); one no generator explains is raised as it is."""
        if self.failure is not None:
            return None
        try:
            return talk()
        except RuntimeError as error:
            self.failure = self._explained(error, when)
            return None

    def _explained(self, error: RuntimeError, when: str) -> str:
        """What ``error`` (a send or receive to the generators that failed) means: a generator process that exited,
        named, or else the error itself; never raised on rank 0 alone (the other ranks wait in a collective)."""
        for _ in range(EXPLAIN_WAIT_S * 10):  # a process whose connection closed may take a moment to be reaped
            try:
                self.processes.check(when)
            except GeneratorDied as died:
                return str(died)
            time.sleep(0.1)
        return (
            f"talking to {self.processes.who()} {when} failed, and none had exited after {EXPLAIN_WAIT_S} s: {error!r}"
        )

    def _raise_on_every_rank(self, when: str) -> None:
        """Rank 0's failure, if any, on every trainer rank (one broadcast): each raises, rank 0 stops the
        generators first."""
        verdict: List[Any] = [self.failure]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            if self.bridge:
                self.terminate()
            raise GeneratorDied(f"GroupRelativePolicyOptimization: {when}: {verdict[0]}")

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
        when = f"in the weight sync of version {version}"
        if self.bridge and not self.layout_sent:
            tensors, _ = streamed_tensors(model, adapters_only=False)
            layout = [(p.name, tuple(p.shape), str(p.dtype)) for p in tensors]

            def send_layout() -> None:
                sync_wire.send_command(group, sync_wire.LAYOUT)
                sync_wire.broadcast_object(group, layout)

            self._guarded(when, send_layout)
            self.layout_sent = True
        if self.bridge:
            self._guarded(when, lambda: sync_wire.send_command(group, sync_wire.WEIGHTS, version, count=int(verify)))
        digest = hashlib.sha256()
        # the model's own names: a generator holds the trainers' model class and receives into its params
        for bucket in stream_buckets(model, keep_fp32, self.bucket_bytes, None, 0, checkpoint_names=False):
            for _, tensor in bucket:  # rank 0's bucket: whole tensors; the others' are empty
                self._guarded(when, lambda: sync_wire.send_tensor(group, tensor))  # noqa: B023  # called at once
                if verify:
                    digest.update(sync_wire.tensor_bytes(tensor))
            bucket.clear()  # sent: one bucket held at a time
        self.synced_version = version
        mismatched: List[int] = []
        if verify and self.bridge:
            held = self._guarded(when, lambda: [sync_wire.receive_object(group, rank) for rank in self._ranks()])
            mismatched = [rank for rank, value in enumerate(held or [], start=1) if value != digest.hexdigest()]
        if mismatched:
            self.failure = (
                f"after the weight sync of version {version}, generator rank(s) {mismatched} hold other params than"
                " the trainers sent (SHA-256 differs); report this with the recipe and the model class"
            )
        self._raise_on_every_rank(when)

    def _ranks(self) -> range:
        return range(1, 1 + self.count)

    def request(self, index: int, version: int, prompt_indices: List[int], seed: int) -> None:
        """Ask for rollout ``index``: every trainer rank's prompts (their indices in the training set)."""
        every_rank: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, prompt_indices)
        if self.bridge:
            asked = {"index": index, "version": version, "seed": seed, "prompts": every_rank}

            def ask() -> None:
                sync_wire.send_command(self.group, sync_wire.REQUEST, version, index, len(every_rank))
                sync_wire.broadcast_object(self.group, asked)

            self._guarded(f"asking for rollout {index}", ask)
        self.pending = index

    def receive(self, device: torch.device) -> Produced:
        """This trainer rank's part of the pending rollout."""
        every_rank: List[Any] = [None]
        when = f"in rollout {self.pending}"
        if self.bridge:
            ranks = dist.get_world_size()
            replies = self._guarded(when, lambda: [sync_wire.receive_object(self.group, 1 + r % self.count)
                                                   for r in range(ranks)])  # fmt: skip
            every_rank = [replies if replies is not None else [{"died": self.failure}] * ranks]
        dist.broadcast_object_list(every_rank, src=0)
        mine = every_rank[0][dist.get_rank()]
        self.pending = None
        if "died" in mine:
            if self.bridge:
                self.terminate()
            raise GeneratorDied(f"GroupRelativePolicyOptimization: {when}: {mine['died']}")
        failed = [(rank, reply["error"]) for rank, reply in enumerate(every_rank[0]) if "error" in reply]
        if failed:  # every trainer rank raises, not only the one whose rollout failed
            rank, error = failed[0]
            raise RuntimeError(
                f"GroupRelativePolicyOptimization: a generator rank failed on trainer rank {rank}'s rollout:\n{error}"
            )
        tensors = [
            mine[k].to(device) for k in ("input_ids", "attention_mask", "completion_mask", "generator_log_probs")
        ]
        rollout = Rollout(tensors[0], tensors[1], tensors[2], tensors[3], mine["prompt_len"])
        return Produced(rollout, mine["rewards"].to(device), mine["means"], mine["version"])

    def close(self) -> None:
        """Stop the generators: told to stop where they are listening (no fault, no rollout outstanding, which
        they would be sending), terminated otherwise; the temporary folder removed."""
        if self.group is not None and self.failure is None and self.pending is None:
            try:
                sync_wire.send_command(self.group, sync_wire.STOP)
            except RuntimeError:  # a generator already gone: nothing to stop
                pass
            self.processes.wait(60)
        self.terminate()

    def terminate(self) -> None:
        """Stop every generator process still running and remove the folder (rank 0; nothing elsewhere)."""
        self.processes.terminate()
        self.group = None
