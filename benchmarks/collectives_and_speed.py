"""Collectives, step time and memory per optimizer step for five ways to shard a Llama-style model.

    python -m benchmarks.collectives_and_speed                 # L in {4, 16}, dim 64, 2 ranks, CPU/gloo or CUDA/NCCL
    python -m benchmarks.collectives_and_speed --layers 4 --steps 10 --json out.json

One launch per depth holds all five configurations and times one step of each in turn (round-robin), so drift
cannot favour one; step times are medians after warm-up, ratios against (a). Training state is counted exactly per
configuration (local shards of params, grads and AdamW states) against the ideal: the full sizes / world size.
"""

import argparse
import json
import statistics
import time
from typing import Any, Dict, List

import torch

from benchmarks.common import (
    CONFIGS,
    build_sharded,
    device_type,
    init_process_group,
    peak_memory_mib,
    synchronize,
    training_state_bytes,
)
from lightning_mixedfsdp.diagnostics.collectives import count_collectives
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlamaConfig, causal_lm_loss
from lightning_mixedfsdp.testing import run_distributed


def measure(
    rank: int, world_size: int, configs: List[str], layers: int, dim: int, steps: int, warmup: int, kind: str
) -> Dict[str, Any]:
    """All configurations in one launch, timed round-robin (one step of each in turn), so machine drift between
    launches cannot favour one of them."""
    device = init_process_group(kind)
    model_config = TinyLlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, hidden_dim=4 * dim)
    models = {c: build_sharded(c, model_config, kind, device) for c in configs}
    optimizers = {c: torch.optim.AdamW(models[c].parameters(), lr=1e-3) for c in configs}
    tokens = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(rank)).to(device)
    sync = synchronize(kind)
    times: Dict[str, List[float]] = {c: [] for c in configs}
    results: Dict[str, Any] = {c: {} for c in configs}
    for step in range(warmup + steps):
        for config in configs:
            model, optimizer = models[config], optimizers[config]
            sync()
            start = time.perf_counter()
            with count_collectives() as counts:
                causal_lm_loss(model(tokens), tokens).backward()
                optimizer.step()
            sync()
            elapsed = time.perf_counter() - start
            if step == warmup:
                memory = training_state_bytes(model, optimizer)
                results[config].update(
                    calls=counts.by_kind(),
                    bytes=counts.bytes_by_kind(),
                    state_bytes=memory["actual"],
                    ideal_bytes=memory["ideal"],
                )
            if step >= warmup:
                times[config].append(elapsed)
            optimizer.zero_grad()
    for config in configs:
        results[config]["step_s"] = statistics.median(times[config])
    return {"configs": results, "peak_mib": peak_memory_mib(kind)}


def run(layers: List[int], configs: List[str], dim: int, steps: int, warmup: int, kind: str) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for depth in layers:
        per_rank = run_distributed(measure, 2, configs, depth, dim, steps, warmup, kind, timeout=1200)
        for config, result in per_rank[0]["configs"].items():
            results[f"L{depth}/{config}"] = result
        results[f"L{depth}/peak_mib"] = max(r["peak_mib"] for r in per_rank)
    return results


def table(results: Dict[str, Any], layers: List[int], configs: List[str]) -> str:
    header = (
        "| L | config | all-gather (calls / MiB) | reduce-scatter (calls / MiB) | all-reduce (calls / KiB) |"
        " step ms (median) | vs (a) | state MiB/rank | ideal MiB | state/ideal |"
    )
    lines = [header, "|" + "---|" * 10]
    for depth in layers:
        base = results.get(f"L{depth}/a")
        for config in configs:
            r = results[f"L{depth}/{config}"]
            calls, nbytes = r["calls"], r["bytes"]
            ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
            lines.append(
                f"| {depth} | ({config}) {CONFIGS[config]} |"
                f" {calls.get('all_gather', 0)} / {nbytes.get('all_gather', 0) / 2**20:.2f} |"
                f" {calls.get('reduce_scatter', 0)} / {nbytes.get('reduce_scatter', 0) / 2**20:.2f} |"
                f" {calls.get('all_reduce', 0)} / {nbytes.get('all_reduce', 0) / 2**10:.1f} |"
                f" {r['step_s'] * 1e3:.1f} | {ratio} |"
                f" {r['state_bytes'] / 2**20:.2f} | {r['ideal_bytes'] / 2**20:.2f} |"
                f" {r['state_bytes'] / r['ideal_bytes']:.3f} |"
            )
    peaks = ", ".join(f"L={d}: {results[f'L{d}/peak_mib']:.0f} MiB" for d in layers)
    lines.append(f"\npeak memory per rank with all five models resident ({peaks})")
    return "\n".join(lines)


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--configs", default="abcde")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    configs = list(args.configs)
    results = run(args.layers, configs, args.dim, args.steps, args.warmup, kind)
    print(f"device: {kind}, 2 ranks, dim {args.dim}, seq 128 x batch 4 per rank, {args.steps} timed steps")
    print(table(results, args.layers, configs))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
