"""The local expert kernels of one rank under expert parallelism, at world size 1: what ``expert_parallel_size=E``
leaves each rank to compute. With E ranks per EP group a rank holds ``num_experts / E`` experts and, with balanced
routing, receives as many (token, expert) pairs as it sends: ``tokens x top_k``. So the same pairs meet fewer, larger
expert groups. HF's own ``Qwen3MoeExperts`` (transformers' ``grouped_mm`` implementation by default) is timed forward
and backward for E = 1, 2, 4, 8 with uniformly routed pairs.

    python -m benchmarks.expert_kernels                  # Qwen3-30B-A3B's expert shapes, bf16, on the GPU
    python -m benchmarks.expert_kernels --device cpu --hidden 64 --intermediate 32 --experts 8 --top-k 2 --tokens 64

No communication is measured here (see ``benchmarks/expert_parallel.py`` for the all-to-alls on several ranks).
"""

import argparse
import statistics
import time
from typing import Any, Dict

import torch

from benchmarks.common import device_type, synchronize


def experts_module(hidden: int, intermediate: int, experts: int, implementation: str, device: str) -> Any:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts)
    config._experts_implementation = implementation
    module = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.02)
    return module


def measure(args: argparse.Namespace, device: str, size: int) -> Dict[str, float]:
    local = args.experts // size
    module = experts_module(args.hidden, args.intermediate, local, args.implementation, device)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(device, torch.bfloat16).requires_grad_()
    index = torch.randint(0, local, (args.tokens, args.top_k), generator=generator).to(device)
    weights = torch.rand(args.tokens, args.top_k, generator=generator).softmax(-1).to(device, torch.bfloat16)
    sync = synchronize(device)
    times = []
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        module(hidden, index, weights).float().pow(2).mean().backward()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
        hidden.grad = None
    ms = statistics.median(times) * 1e3
    flops = 18 * args.tokens * args.top_k * args.hidden * args.intermediate  # 6HI per pair forward, x3 with backward
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"experts": local, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "params_mib": params / 2**20}


def main(argv: Any = None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank (batch x seq)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--implementation", default="grouped_mm", help="transformers' experts implementation")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    device = device_type(args.device)
    results = {str(size): measure(args, device, size) for size in args.sizes}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"device: {name}, torch {torch.__version__}, HF Qwen3MoeExperts ({args.implementation}), bf16, hidden"
        f" {args.hidden}, moe_intermediate {args.intermediate}, {args.experts} experts, top-{args.top_k},"
        f" {args.tokens} tokens per rank, forward+backward, median of {args.steps}"
    )
    print("| E | local experts | expert params MiB/rank | ms | vs E=1 | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    base = results[str(args.sizes[0])]["ms"]
    for size, row in results.items():
        print(
            f"| {size} | {row['experts']:.0f} | {row['params_mib']:.1f} | {row['ms']:.2f} | {row['ms'] / base:.3f} |"
            f" {row['tflops']:.1f} |"
        )
    return results


if __name__ == "__main__":
    main()
