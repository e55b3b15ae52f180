"""Setup cost for a 100-layer model: planning (one process, no collectives) and sharding (2 ranks).

python -m benchmarks.setup_cost
python -m benchmarks.setup_cost --layers 10 --repeats 2
"""

import argparse
import statistics
import time
from typing import Any, Dict

import torch

from benchmarks.common import device_type, init_process_group, synchronize
from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.compat.torch import fsdp_param_groups
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss
from lightning_mixedfsdp.testing import run_distributed


def model_config(layers: int) -> TinyLlamaConfig:
    # every 4th layer a mixer, so the plan has inseparable A_log params too
    return TinyLlamaConfig(
        vocab_size=256, dim=64, n_layers=layers, n_heads=4, hidden_dim=128, mixer_layers=list(range(1, layers, 4))
    )


def plan_seconds(layers: int, repeats: int) -> Dict[str, float]:
    model = TinyLlama(model_config(layers))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_sharding(model, MixedFSDPConfig(), precision="bf16-true")
        times.append(time.perf_counter() - start)
    return {
        "plan_s": statistics.median(times),
        "params": len(plan.params),
        "groups": len(plan.groups),
        "planned_sharded_groups": len(plan.sharded_groups),
        "planned_replicated_params": len(plan.replicated_params),
    }


def shard_seconds(rank: int, world_size: int, layers: int, repeats: int, kind: str) -> Dict[str, float]:
    device = init_process_group(kind)
    meshes = build_parallel_meshes(kind, 1, world_size, 1, world_size)
    sync = synchronize(kind)
    shard_times, first_step_times = [], []
    for _ in range(repeats):
        model = TinyLlama(model_config(layers)).to(device)
        config = MixedFSDPConfig()
        sync()
        start = time.perf_counter()
        model = shard_model(model, config, config.bulk_dtypes("bf16-true"), meshes, device).module
        sync()
        shard_times.append(time.perf_counter() - start)
        tokens = torch.randint(0, 256, (1, 16), device=device)
        start = time.perf_counter()
        causal_lm_loss(model(tokens), tokens).backward()  # includes FSDP's lazy initialisation
        sync()
        first_step_times.append(time.perf_counter() - start)
    return {
        "shard_s": statistics.median(shard_times),
        "first_step_s": statistics.median(first_step_times),
        **applied_groups(model),
    }


def applied_groups(model: torch.nn.Module) -> Dict[str, int]:
    """What the timed set-up made: FSDP param groups (a list-form ``fully_shard`` makes one) and replicated params."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    groups = {id(g) for m in model.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)}
    replicated = [p for p in model.parameters() if isinstance(p, DTensor) and p.placements[0].is_replicate()]
    return {"fsdp_groups": len(groups), "replicated_params": len(replicated)}


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    planned = plan_seconds(args.layers, args.repeats)
    sharded = run_distributed(shard_seconds, 2, args.layers, args.repeats, kind, timeout=600)[0]
    print(f"device: {kind}, {args.layers} layers, {planned['params']} params, {planned['groups']} groups")
    print("| step | median |")
    print("|---|---|")
    print(f"| plan_sharding (one process) | {planned['plan_s'] * 1e3:.1f} ms |")
    print(f"| cast + plan + fully_shard + replicate + broadcast (2 ranks) | {sharded['shard_s'] * 1e3:.1f} ms |")
    print(f"| first forward+backward (FSDP lazy init included) | {sharded['first_step_s'] * 1e3:.1f} ms |")
    return {**planned, **sharded}


if __name__ == "__main__":
    main()
