"""One rank of one replica group, as a user's Fabric script runs under fault tolerance: an HF Llama from a small
config, bf16-true with fp32 norms (sharded in the blocks, replicated at the root), two micro-batches per step with
gradient accumulation, activation checkpointing, clipping and AdamW.

The test launches each group as its own set of processes (MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them) and
steers it through files in ``--folder``: ``go`` lets the groups take their first step (the test writes it once every
group has started, so they meet in the first quorum whatever their start-up times), ``stop`` holds the torchft step to
stop at, ``save`` the step to save a checkpoint at. Each rank appends one JSON line per step to
``g{replica}_r{rank}.jsonl``: torchft's step and participants, the vote, and a digest of this rank's params and
optimizer state (equal digests: equal to the bit). ``--die-in-reduce-at K``: at step K this rank posts its first
cross-group all-reduce and SIGKILLs itself, a peer dying inside the reduction."""

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from lightning_mixedfsdp.testing.replica_groups import build_fabric, read_step

GROUP_WORLD = 2
WORKER = "tests.fault_tolerance.worker"
"""The module each rank of a test's replica group runs."""


def digest(model: torch.nn.Module, optimizer: Any) -> str:
    from torch.distributed.tensor import DTensor

    hasher = hashlib.sha256()

    def add(name: str, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        hasher.update(name.encode())
        hasher.update(local.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())

    for name, param in model.named_parameters():
        add(name, param)
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                add(f"{index}/{key}", value)
    return hasher.hexdigest()[:16]


def build(
    replica_id: Optional[int],
    lighthouse: Optional[str],
    world: int = GROUP_WORLD,
    replicate: int = 1,
    model_type: str = "llama",
    fields: Optional[Dict[str, Any]] = None,
    **sizes: Any,
) -> Any:
    """Fabric, the set-up tiny HF model of ``model_type`` and its optimizer; ``fields`` go to the strategy, ``sizes``
    override the tiny model's config."""
    from tests.hf_models import tiny_model

    return build_fabric(replica_id, lighthouse, lambda: tiny_model(model_type, **sizes), world, replicate, fields)


def tokens_for(sampler: Dict[str, int], iteration: int, micro: int) -> torch.Tensor:
    """This rank's part of the job's batch: the sampler's rank among every group's ranks picks the rows."""
    from tests.scenarios import global_batch, rank_slice

    batch = global_batch(sampler["num_replicas"], 2 * iteration + micro)
    return rank_slice(batch, sampler["rank"], sampler["num_replicas"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--die-in-reduce-at", type=int, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--model", default="llama", help="a model type of tests/hf_models.py")
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--context-parallel", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fields = {
        "expert_parallel_size": args.expert_parallel,
        "compile": args.compile,
        "context_parallel_size": args.context_parallel,
    }
    fabric, model, optimizer = build(args.replica_id, args.lighthouse, model_type=args.model, fields=fields)
    strategy = fabric.strategy
    manager = strategy.torchft_manager
    rank = fabric.global_rank
    log = (args.folder / f"g{args.replica_id}_r{rank}.jsonl").open("a")
    if args.resume is not None:
        fabric.load(args.resume, {"model": model, "optimizer": optimizer})

    if args.die_in_reduce_at is not None:
        allreduce = manager.allreduce

        def dying_allreduce(tensor: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
            work = allreduce(tensor, *rest, **kwargs)
            if manager.current_step() == args.die_in_reduce_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return work

        manager.allreduce = dying_allreduce

    def write(record: Dict[str, Any]) -> None:
        log.write(json.dumps({**record, "pid": os.getpid(), "time": time.time()}) + "\n")
        log.flush()

    write({"event": "start", "step": manager.current_step(), "digest": digest(model, optimizer)})
    while not (args.folder / "go").exists():  # the test says go once every group has started
        time.sleep(0.01)
    iteration = 0
    saved_at = None
    while True:
        step = manager.current_step()
        stop, save = read_step(args.folder / "stop"), read_step(args.folder / "save")
        if save is not None and step == save and saved_at != step:
            fabric.save(args.folder / "checkpoint", {"model": model, "optimizer": optimizer})
            saved_at = step
            write({"event": "save", "step": step, "wrote": strategy.writes_checkpoints()})
        if stop is not None and step >= stop:
            break
        sampler = strategy.distributed_sampler_kwargs
        losses = []
        for micro in range(2):
            tokens = tokens_for(sampler, iteration, micro)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(input_ids=tokens, labels=tokens).loss / 2
                fabric.backward(loss)
            losses.append(loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        session = strategy.fault_tolerance.session
        heal = session.last_heal
        write(
            {
                "event": "step",
                "step": manager.current_step(),
                "committed": session.last_decision,
                "participants": manager.num_participants(),
                "digest": digest(model, optimizer),
                "loss": sum(losses),
                "sampler": sampler,
                "heal": None if heal is None else {"step": heal.step, "bytes": heal.bytes, "seconds": heal.seconds},
            }
        )
        iteration += 1
        if args.pace:
            time.sleep(args.pace)
    write({"event": "end", "step": manager.current_step()})
    log.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
