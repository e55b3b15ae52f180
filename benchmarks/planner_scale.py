"""The dry-run planner on public 70B-120B shapes (built on the meta device from their config.json values):
per-rank training state at world sizes 8, 64 and 512, the planning time, and the setup time on meta on 2 ranks
(plan plus ``fully_shard`` of every group, nothing materialised).

    python -m benchmarks.planner_scale
    python -m benchmarks.planner_scale --shapes llama3_70b --world-sizes 8
"""

import argparse
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from benchmarks.common import device_type, init_process_group
from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.apply.applier import apply_plan
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.planning.memory import estimate_memory
from lightning_mixedfsdp.recipes.run.dry_run import build_on_meta, load_hf_config
from lightning_mixedfsdp.testing import run_distributed

CONFIGS = Path(__file__).resolve().parent / "configs"
SHAPES = ("llama3_70b", "qwen3_next_80b_a3b", "gpt_oss_120b")


def plan_at_scale(shape: str, world_sizes: List[int]) -> Dict[str, Any]:
    start = time.perf_counter()
    model = build_on_meta(load_hf_config(CONFIGS / f"{shape}.json"))
    built = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_sharding(model, MixedFSDPConfig(), "bf16-true")
    planned = time.perf_counter() - start
    rows = {}
    for world in world_sizes:
        estimate = estimate_memory(plan, shard_ranks=world, data_parallel_ranks=world)
        rows[world] = {**estimate.rows(), "replicated_overhead": estimate.replicated}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": built,
        "plan_s": planned,
        "groups": len(plan.groups),
        "collectives": plan.predicted_collectives(),
        "per_rank": rows,
    }


def setup_on_meta(rank: int, world_size: int, shapes: List[str], kind: str) -> Dict[str, float]:
    device = init_process_group(kind)
    meshes = build_parallel_meshes(kind, 1, world_size, 1, world_size)
    out = {}
    for shape in shapes:
        model = build_on_meta(load_hf_config(CONFIGS / f"{shape}.json"))
        start = time.perf_counter()
        plan = plan_sharding(model, MixedFSDPConfig(), "bf16-true")
        apply_plan(model, plan, meshes, device, lambda m, _: m)
        out[shape] = time.perf_counter() - start
        assert all(p.is_meta for p in model.parameters())
    return out


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    results = {shape: plan_at_scale(shape, args.world_sizes) for shape in args.shapes}
    setup = run_distributed(setup_on_meta, 2, args.shapes, device_type(args.device), timeout=1200)[0]
    print("bf16-true, default rules, AdamW; GiB per rank (params + grads + AdamW states; activations not included)")
    header = " | ".join(f"world {w}" for w in args.world_sizes)
    print(f"| shape | params | groups | plan s | setup on meta, 2 ranks, s | {header} |")
    print("|---|---|---|---|---|" + "---|" * len(args.world_sizes))
    for shape, row in results.items():
        cells = " | ".join(f"{row['per_rank'][w]['total'] / 2**30:.2f}" for w in args.world_sizes)
        print(
            f"| {shape} | {row['params'] / 1e9:.2f}B | {row['groups']} | {row['plan_s']:.2f} | {setup[shape]:.2f} |"
            f" {cells} |"
        )
    for shape, row in results.items():
        print(f"{shape}: collectives per step {row['collectives']}; built on meta in {row['build_s']:.2f} s")
    return {"plans": results, "setup_s": setup}


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
