"""Gradient clipping time for a model with about 1,000 params: torch's ``clip_grad_norm_`` on uniform bf16 FSDP2
against ours on the same model and on mixed_fsdp2's mixed placements (Shard and Replicate, bf16 and fp32).

    python -m benchmarks.clip                     # 2 ranks, 110 layers (992 params), CPU/gloo or CUDA/NCCL
    python -m benchmarks.clip --layers 10 --repeats 5

The three are timed in turn, round-robin, on grads from one backward each; medians over ``repeats``.
"""

import argparse
import statistics
import time
from typing import Any, Dict

import torch

from benchmarks.baselines import shard_uniform
from benchmarks.common import device_type, init_process_group, synchronize
from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.apply.clip import clip_grad_norm_
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss
from lightning_mixedfsdp.testing import run_distributed


def measure(rank: int, world_size: int, layers: int, repeats: int, kind: str) -> Dict[str, Any]:
    device = init_process_group(kind)
    meshes = build_parallel_meshes(kind, 1, world_size, 1, world_size)
    config = TinyLlamaConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, hidden_dim=128, mixer_layers=[1])
    torch.manual_seed(0)
    bf16_model = TinyLlama(config).to(device).to(torch.bfloat16)
    uniform = shard_uniform(bf16_model, meshes.fsdp, torch.bfloat16, torch.bfloat16)
    mixed_config = MixedFSDPConfig(keep_fp32_params=[r"A_log$"])
    bulk = mixed_config.bulk_dtypes("bf16-true")
    torch.manual_seed(0)
    mixed = shard_model(TinyLlama(config).to(device), mixed_config, bulk, meshes, device).module
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank)).to(device)
    for model in (uniform, mixed):
        causal_lm_loss(model(tokens), tokens).backward()
    runs = {
        "torch clip_grad_norm_, uniform bf16 FSDP2": lambda: torch.nn.utils.clip_grad_norm_(uniform.parameters(), 1e9),
        "ours, uniform bf16 FSDP2": lambda: clip_grad_norm_(uniform.parameters(), 1e9),
        "ours, mixed_fsdp2 (Shard+Replicate, bf16+fp32)": lambda: clip_grad_norm_(mixed.parameters(), 1e9),
    }
    sync = synchronize(kind)
    times: Dict[str, list] = {name: [] for name in runs}
    norms: Dict[str, float] = {}
    for _ in range(repeats + 2):
        for name, clip in runs.items():
            sync()
            start = time.perf_counter()
            norm = clip()
            sync()
            times[name].append(time.perf_counter() - start)
            norms[name] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return {
        "params": {"uniform": sum(1 for _ in uniform.parameters()), "mixed": sum(1 for _ in mixed.parameters())},
        "ms": {name: statistics.median(values[2:]) * 1e3 for name, values in times.items()},
        "norms": norms,
    }


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    result = run_distributed(measure, 2, args.layers, args.repeats, kind, timeout=1200)[0]
    reference = result["ms"]["torch clip_grad_norm_, uniform bf16 FSDP2"]
    params = result["params"]
    print(f"device: {kind}, 2 ranks, {params['uniform']} params (uniform), {params['mixed']} (mixed)")
    print("| clipping | median ms | vs torch | total grad norm |")
    print("|---|---|---|---|")
    for name, ms in result["ms"].items():
        print(f"| {name} | {ms:.2f} | {ms / reference:.2f}x | {result['norms'][name]:.6g} |")
    return result


if __name__ == "__main__":
    main()
