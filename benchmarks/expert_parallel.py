"""Expert parallelism: per-rank training state, all-gathered bytes, all-to-alls and step time of an HF Qwen3-MoE at
``expert_parallel_size`` 1, 2 and 4, on the same ranks, the same data, under ``bf16-true`` with fp32 routers.

    python -m benchmarks.expert_parallel                          # 4 ranks, E = 1 2 4, CPU/gloo or CUDA/NCCL
    python -m benchmarks.expert_parallel --world-size 2 --sizes 1 2 --hidden 64 --steps 3

All set-ups live in one launch and one step of each is timed in turn (round-robin), so drift cannot favour one.
What EP changes on the same ranks: each rank all-gathers and computes only its ``num_experts / E`` experts (FSDP
over the ranks holding the same experts), and tokens travel by all-to-all instead. What it does not change: the
sharded params+grads+AdamW per rank (FSDP at E=1 shards the experts over all ranks already).
"""

import argparse
import json
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List

import torch

from benchmarks.common import device_type, init_process_group, local_bytes, synchronize, training_state_bytes
from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
ROUTERS = [r"mlp\.gate\.weight$"]


def build_model(hidden: int, experts: int, layers: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


@contextmanager
def counting(counts: Counter) -> Iterator[None]:
    """All-to-alls through transformers' EP (forward calls; backward runs the token ones again) and the bytes FSDP
    all-gathers."""
    from lightning_mixedfsdp.compat.transformers import all_to_all_module
    from lightning_mixedfsdp.diagnostics.collectives import count_collectives

    module = all_to_all_module()
    originals = module.all_to_all_single, module.all_to_all_single_autograd

    def split_sizes(*args: Any, **kwargs: Any) -> Any:
        counts["all_to_all"] += 1
        return originals[0](*args, **kwargs)

    def tokens(*args: Any, **kwargs: Any) -> Any:
        counts["all_to_all"] += 2  # dispatch or combine, and its reverse in backward
        return originals[1](*args, **kwargs)

    module.all_to_all_single, module.all_to_all_single_autograd = split_sizes, tokens
    try:
        with count_collectives() as collectives:
            yield
        counts["all_gather_bytes"] += collectives.bytes_by_kind().get("all_gather", 0)
    finally:
        module.all_to_all_single, module.all_to_all_single_autograd = originals


def measure(
    rank: int, world: int, sizes: List[int], hidden: int, experts: int, layers: int, steps: int, warmup: int, kind: str
) -> Dict[str, Any]:
    device = init_process_group(kind)
    tokens = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(rank)).to(device)
    sync = synchronize(kind)
    models, optimizers, plans = {}, {}, {}
    for size in sizes:
        meshes = build_parallel_meshes(kind, 1, world, 1, world, expert_parallel=size)
        config = MixedFSDPConfig(expert_parallel_size=size, keep_fp32_params=ROUTERS)
        sharded = shard_model(
            build_model(hidden, experts, layers).to(device), config, config.bulk_dtypes("bf16-true"), meshes, device
        )
        models[size], plans[size] = sharded.module, sharded.applied.plan if sharded.applied else None
        optimizers[size] = torch.optim.AdamW(sharded.module.parameters(), lr=1e-3)
    times: Dict[int, List[float]] = {size: [] for size in sizes}
    counts: Dict[int, Counter] = {size: Counter() for size in sizes}
    for step in range(warmup + steps):
        for size, model in models.items():
            sync()
            start = time.perf_counter()
            if step == 0:
                with counting(counts[size]):
                    model(input_ids=tokens, labels=tokens).loss.backward()
            else:
                model(input_ids=tokens, labels=tokens).loss.backward()
            optimizers[size].step()
            optimizers[size].zero_grad(set_to_none=False)
            sync()
            if step >= warmup:
                times[size].append(time.perf_counter() - start)
    out = {}
    for size, model in models.items():
        state = training_state_bytes(model, optimizers[size])["actual"]
        expert_params = [p for n, p in model.named_parameters() if ".experts." in n]
        expert_state = sum(local_bytes(p) * 4 for p in expert_params)  # param, grad, exp_avg, exp_avg_sq
        plan = plans[size]
        per_layer = max(len(plan.experts.modules), 1) if plan and plan.experts else layers
        total_expert = sum(p.numel() * p.element_size() for p in expert_params)
        out[str(size)] = {
            "experts_per_rank": experts // size,
            "state_mib": state / 2**20,
            "expert_state_mib": expert_state / 2**20,
            "unsharded_experts_per_layer_mib": total_expert / per_layer / size / 2**20,
            "all_gather_mib_per_step": counts[size]["all_gather_bytes"] / 2**20,
            "all_to_alls_per_step": counts[size]["all_to_all"],
            "step_ms": statistics.median(times[size]) * 1e3,
            "step_ms_all": [t * 1e3 for t in times[size]],
        }
    return out


def print_table(results: Dict[str, Any], header: str) -> None:
    print(header)
    base = results[min(results, key=int)]
    print(
        "| E | experts/rank | params+grads+AdamW MiB/rank | of which experts | unsharded experts MiB/layer"
        " | all-gathered MiB/step | all-to-alls/step | step ms (median) | step vs E=1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, row in results.items():
        print(
            f"| {size} | {row['experts_per_rank']} | {row['state_mib']:.2f} | {row['expert_state_mib']:.2f}"
            f" | {row['unsharded_experts_per_layer_mib']:.2f} | {row['all_gather_mib_per_step']:.2f}"
            f" | {row['all_to_alls_per_step']} | {row['step_ms']:.1f} | {row['step_ms'] / base['step_ms']:.2f} |"
        )


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="expert_parallel_size values")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default=str(RESULTS / "expert_parallel.json"), help="JSON path ('' for none)")
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    results = run_distributed(
        measure,
        args.world_size,
        args.sizes,
        args.hidden,
        args.experts,
        args.layers,
        args.steps,
        args.warmup,
        kind,
        timeout=3000,
    )[0]
    header = (
        f"device: {kind}, {args.world_size} ranks, HF Qwen3-MoE hidden {args.hidden}, {args.experts} experts (top-2),"
        f" {args.layers} layers, bf16-true, batch 4 x seq 128 per rank, {args.steps} timed steps"
    )
    print_table(results, header)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "device": kind, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
