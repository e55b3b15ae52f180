"""mixed_fsdp2 against transformers' own FSDP2 on the same HF model (gpt-oss built from config and saved locally):
collectives per step, step time, and which params stay fp32.

    python -m benchmarks.hf_fsdp_peer               # 2 ranks, CPU/gloo or CUDA/NCCL
    python -m benchmarks.hf_fsdp_peer --layers 2 --hidden 64 --steps 3

transformers 5.23: ``from_pretrained(dir, dtype=..., distributed_config=DistributedConfig(fsdp_size=2))``, loaded
in bf16 (what a bf16 run loads; HF applies ``_keep_in_fp32_modules`` only to fp16) and in fp32 with
``fsdp_mixed_precision=True`` (fp32 storage, bf16 compute). mixed_fsdp2 sets up ``from_pretrained(dir,
dtype=float32)`` under ``bf16-true`` and ``bf16-mixed``. All four live in one launch and are timed round-robin.
"""

import argparse
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch
from torch import nn

from benchmarks.common import device_type, init_process_group, synchronize
from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.diagnostics.collectives import count_collectives
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.testing import run_distributed


def save_gpt_oss(directory: str, layers: int, hidden: int) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2),
    )
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(directory)


def build_all(directory: str, kind: str, device: torch.device, world_size: int) -> Dict[str, nn.Module]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    models = {}
    for name, dtype, mixed_precision in (
        ("transformers FSDP2, bf16 load", torch.bfloat16, False),
        ("transformers FSDP2, fp32 load + fsdp_mixed_precision", torch.float32, True),
    ):
        distributed = DistributedConfig(fsdp_size=world_size, fsdp_mixed_precision=mixed_precision)
        models[name] = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, distributed_config=distributed)
    meshes = build_parallel_meshes(kind, 1, world_size, 1, world_size)
    for flag in ("bf16-true", "bf16-mixed"):
        config = MixedFSDPConfig()
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
        models[f"mixed_fsdp2, {flag}"] = shard_model(model, config, config.bulk_dtypes(flag), meshes, device).module
    return models


def measure(rank: int, world_size: int, directory: str, steps: int, warmup: int, kind: str) -> Dict[str, Any]:
    device = init_process_group(kind)
    models = build_all(directory, kind, device, world_size)
    tokens = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(rank)).to(device)
    sync = synchronize(kind)
    times: Dict[str, List[float]] = {name: [] for name in models}
    counted: Dict[str, Dict[str, int]] = {}
    for step in range(warmup + steps):
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            with count_collectives() as counts:
                model(input_ids=tokens, labels=tokens).loss.backward()
            model.zero_grad()
            sync()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
            counted[name] = counts.by_kind()
    return {
        name: {
            "step_ms": statistics.median(times[name]) * 1e3,
            "collectives": counted[name],
            "fp32": sorted({_collapse(n) for n, p in model.named_parameters() if p.dtype == torch.float32}),
            "storage": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
        }
        for name, model in models.items()
    }


def _collapse(name: str) -> str:
    import re

    return re.sub(r"\.\d+\.", ".*.", name.replace("_forward_module.", ""))


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    with tempfile.TemporaryDirectory() as directory:
        save_gpt_oss(directory, args.layers, args.hidden)
        results = run_distributed(measure, 2, directory, args.steps, args.warmup, kind, timeout=1800)[0]
    print(f"device: {kind}, 2 ranks, gpt-oss L={args.layers} hidden={args.hidden}, seq 128 x batch 4 per rank")
    print("| set-up | all-gathers | reduce-scatters | all-reduces | step ms | storage dtypes | params kept fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name, row in results.items():
        counts = row["collectives"]
        fp32 = ", ".join(row["fp32"]) if len(row["fp32"]) <= 6 else f"all {len(row['fp32'])} param names"
        print(
            f"| {name} | {counts.get('all_gather', 0)} | {counts.get('reduce_scatter', 0)} |"
            f" {counts.get('all_reduce', 0)} | {row['step_ms']:.1f} | {', '.join(row['storage'])} | {fp32 or '-'} |"
        )
    return results


if __name__ == "__main__":
    main()
