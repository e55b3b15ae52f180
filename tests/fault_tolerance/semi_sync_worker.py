"""One rank of one replica group training with DiLoCo across the groups (``replicate_sync="diloco"``,
``sync_every=3``) under fault tolerance, as a user's Fabric script: an HF Llama from a small config, bf16-true with
fp32 norms, AdamW. The groups meet only at their syncs (steps 3, 6, ...); each draws its own data in between.

Each rank appends one JSON line per optimizer step to ``g{replica}_r{rank}.jsonl``: the outer sync's step count, its
last sync, the sync's participants, a digest of this rank's params (equal digests: equal to the bit) and the last
heal. ``--die-after K``: after its K-th step (mid-cycle) this rank SIGKILLs itself. ``--save-at K``: after its K-th step
it saves a checkpoint to ``checkpoint`` (mid-cycle: an early sync first). It stops after ``--steps``."""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict

import torch

from tests.fault_tolerance.worker import build, tokens_for

SYNC_EVERY = 3
SEMI_SYNC_WORKER = "tests.fault_tolerance.semi_sync_worker"


def params_digest(model: torch.nn.Module) -> str:
    import hashlib

    from lightning_mixedfsdp.model.tensors import local_tensor

    hasher = hashlib.sha256()
    for name, param in model.named_parameters():
        hasher.update(name.encode())
        hasher.update(local_tensor(param).detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--save-at", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fields = {"replicate_sync": "diloco", "sync_every": SYNC_EVERY}
    fabric, model, optimizer = build(args.replica_id, args.lighthouse, fields=fields)
    strategy = fabric.strategy
    outer = strategy._sharded.outer_syncs()[0]
    session = strategy.fault_tolerance.session
    log = (args.folder / f"g{args.replica_id}_r{fabric.global_rank}.jsonl").open("a")

    def write(record: Dict[str, Any]) -> None:
        log.write(json.dumps({**record, "pid": os.getpid(), "time": time.time()}) + "\n")
        log.flush()

    write({"event": "start", "step": outer.steps})
    iteration = 0
    while outer.steps < args.steps:
        tokens = tokens_for(strategy.distributed_sampler_kwargs, iteration, 0)
        fabric.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()  # the sync after every SYNC_EVERY-th (a restarted group heals in its quorum)
        optimizer.zero_grad()
        heal = session.last_heal
        write(
            {
                "event": "step",
                "step": outer.steps,
                "synced": outer.synced_at == outer.steps,
                "participants": strategy.torchft_manager.num_participants(),
                "digest": params_digest(model),
                "heal": None if heal is None else {"step": heal.step, "bytes": heal.bytes},
            }
        )
        iteration += 1
        if outer.steps == args.save_at:
            fabric.save(args.folder / "checkpoint", {"model": model, "optimizer": optimizer})
            write({"event": "save", "step": outer.steps, "digest": params_digest(model), "synced": not outer.mid_cycle})
        if args.die_after is not None and outer.steps == args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
    write({"event": "end", "step": outer.steps})
    log.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
