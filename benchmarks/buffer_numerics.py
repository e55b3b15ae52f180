"""The damage a bf16 buffer does where fp32 was meant: RoPE ``inv_freq`` and an MoE router's correction bias.

    python -m benchmarks.buffer_numerics                      # 8192 positions, 2 ranks, CPU/gloo or CUDA/NCCL
    python -m benchmarks.buffer_numerics --positions 1024 --init-ranges 0.1 --tokens 1024

(a) RoPE: an HF Llama (from config, random init) runs positions 0..N-1 on 2 ranks under
``Fabric(strategy="mixed_fsdp2", precision="bf16-true")``, once as shipped (``inv_freq`` fp32) and once with the
old behaviour, every buffer cast to bf16 (``cast_buffers=True`` without the RotaryEmbedding rule, what Lightning's
own ``bf16-true`` does). Each is compared with a single-process fp32 run of the same model: KL(fp32 || run) per
position bucket. A third row isolates RoPE: fp32 everywhere except ``inv_freq`` rounded to bf16.

(b) Router: HF's own ``Dots1TopkRouter`` (DeepSeek-V3 shape: 256 experts, 8 groups, top-4 groups, top-8) routes the
same tokens with its ``e_score_correction_bias`` in fp32 and in bf16; the fraction of tokens whose top-8 expert set
changes, for biases at the scales published for trained checkpoints and for zero-mean ones. Then 100 aux-free
balancing updates of +-1e-3 (DeepSeek-V3's rate) are applied to the bf16 bias: the fraction of entries that never
moved.
"""

import argparse
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from benchmarks.common import device_type
from lightning_mixedfsdp.testing import run_distributed

BUCKETS = ((0, 512), (512, 2048), (2048, 4096), (4096, 8192))
VARIANTS = {
    "mixed_fsdp2 bf16-true (inv_freq fp32)": {},
    "bf16-true with every buffer cast (inv_freq bf16)": {"cast_buffers": True, "keep_fp32_modules": ["RMSNorm"]},
}


def llama_config(positions: int, init_range: float) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=positions,
        initializer_range=init_range,
    )


def build_llama(positions: int, init_range: float) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(positions, init_range)).eval()


def token_ids(positions: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, positions), generator=torch.Generator().manual_seed(1))


def sharded_log_probs(rank: int, world_size: int, positions: int, init_range: float, kind: str) -> Any:
    """Rank 0 returns each variant's next-token log-probs at every position (bf16 compute, fp32 softmax)."""
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    out = {}
    for name, fields in VARIANTS.items():
        accelerator = "cuda" if kind == "cuda" else "cpu"
        fabric = Fabric(
            accelerator=accelerator, devices=world_size, strategy=MixedFSDP2Strategy(**fields), precision="bf16-true"
        )
        fabric.launch()
        model = fabric.setup(build_llama(positions, init_range))
        with torch.no_grad():
            logits = model(input_ids=token_ids(positions).to(fabric.device)).logits
        inv_freq = model.module.model.rotary_emb.inv_freq
        out[name] = {"log_probs": logits.float().log_softmax(-1)[0].cpu(), "inv_freq_dtype": str(inv_freq.dtype)}
    return out if rank == 0 else None


def kl_by_bucket(reference: torch.Tensor, other: torch.Tensor, positions: int) -> List[float]:
    kl = (reference.exp() * (reference - other)).sum(-1)
    return [kl[start:end].mean().item() for start, end in BUCKETS if start < positions]


def rope_study(positions: int, init_ranges: Sequence[float], kind: str) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for init_range in init_ranges:
        model = build_llama(positions, init_range)
        with torch.no_grad():
            reference = model(input_ids=token_ids(positions)).logits.float().log_softmax(-1)[0]
            inv_freq = model.model.rotary_emb.inv_freq
            rounded_error = ((inv_freq.bfloat16().float() - inv_freq) / inv_freq).abs().max().item()
            inv_freq.copy_(inv_freq.bfloat16().float())
            isolated = model(input_ids=token_ids(positions)).logits.float().log_softmax(-1)[0]
        entropy = -(reference.exp() * reference).sum(-1).mean().item()
        runs = run_distributed(sharded_log_probs, 2, positions, init_range, kind, timeout=1800)[0]
        rows = {name: kl_by_bucket(reference, run["log_probs"], positions) for name, run in runs.items()}
        rows["fp32 everywhere, inv_freq rounded to bf16"] = kl_by_bucket(reference, isolated, positions)
        results[str(init_range)] = {
            "entropy": entropy,
            "uniform_entropy": math.log(256),
            "inv_freq_max_relative_error_bf16": rounded_error,
            "inv_freq_dtypes": {name: run["inv_freq_dtype"] for name, run in runs.items()},
            "kl": rows,
        }
    return results


def bias_cases(zero_mean_stds: Sequence[float], experts: int) -> Dict[str, torch.Tensor]:
    """Correction biases to route with. Trained checkpoints carry a large common offset with a narrow spread:
    GLM-5.2 measured [6.817, 7.063] (sglang#37133), another GLM layer 10.16 +- 0.04 (tt-metal#47914); top-k is
    invariant to the offset, bf16's rounding is not. Zero-mean biases of several widths for contrast."""
    generator = torch.Generator().manual_seed(3)
    cases = {
        "uniform in [6.817, 7.063] (GLM-5.2)": 6.817 + 0.246 * torch.rand(experts, generator=generator),
        "10.16 + N(0, 0.04) (GLM layer)": 10.16 + 0.04 * torch.randn(experts, generator=generator),
    }
    for std in zero_mean_stds:
        cases[f"N(0, {std})"] = std * torch.randn(experts, generator=generator)
    return cases


def router_study(tokens: int, zero_mean_stds: Sequence[float]) -> Dict[str, Any]:
    from transformers import Dots1Config
    from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter

    config = Dots1Config(
        hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True
    )
    torch.manual_seed(0)
    router = Dots1TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.006)  # DeepSeek-V3's initializer_range
    hidden = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(2))
    signs = torch.randint(0, 2, (100, config.n_routed_experts), generator=torch.Generator().manual_seed(4)) * 2 - 1
    rows = {}
    for label, bias in bias_cases(zero_mean_stds, config.n_routed_experts).items():
        chosen = {}
        for dtype in (torch.float32, torch.bfloat16):
            router.e_score_correction_bias = bias.to(dtype)
            with torch.no_grad():
                chosen[dtype] = router(hidden)[2].sort(-1).values
        # aux-free balancing: +-1e-3 per step (DeepSeek-V3's update speed), in the bias's own dtype
        balanced = bias.to(torch.bfloat16)
        for step_signs in signs:
            balanced = balanced + (1e-3 * step_signs).to(torch.bfloat16)
        rows[label] = {
            "distinct_values_fp32": int(bias.unique().numel()),
            "distinct_values_bf16": int(bias.to(torch.bfloat16).unique().numel()),
            "top8_set_changed": (chosen[torch.float32] != chosen[torch.bfloat16]).any(-1).float().mean().item(),
            "bf16_unmoved_after_100_updates": (balanced == bias.to(torch.bfloat16)).float().mean().item(),
        }
    return {"tokens": tokens, "cases": rows}


def print_tables(rope: Dict[str, Any], router: Dict[str, Any], positions: int) -> None:
    buckets = [f"{start}-{end - 1}" for start, end in BUCKETS if start < positions]
    for init_range, study in rope.items():
        print(
            f"\n(a) RoPE, initializer_range {init_range}: fp32 reference entropy {study['entropy']:.2f} nats (uniform"
            f" {study['uniform_entropy']:.2f}); bf16 rounds inv_freq by up to"
            f" {study['inv_freq_max_relative_error_bf16']:.2e} relative"
        )
        print("| run | " + " | ".join(f"KL, positions {b}" for b in buckets) + " |")
        print("|---|" + "---|" * len(buckets))
        for name, values in study["kl"].items():
            print(f"| {name} | " + " | ".join(f"{v:.2e}" for v in values) + " |")
    print(f"\n(b) Router ({router['tokens']} tokens, 256 experts, top-8 of 4 of 8 groups)")
    print("| correction bias | distinct values fp32 -> bf16 | top-8 set changed | bf16 unmoved by 100 x 1e-3 updates |")
    print("|---|---|---|---|")
    for label, row in router["cases"].items():
        print(
            f"| {label} | {row['distinct_values_fp32']} -> {row['distinct_values_bf16']} |"
            f" {100 * row['top8_set_changed']:.1f} % | {100 * row['bf16_unmoved_after_100_updates']:.1f} % |"
        )


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--init-ranges", type=float, nargs="+", default=[0.02, 0.1])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--zero-mean-stds", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    rope = rope_study(args.positions, args.init_ranges, device_type(args.device))
    router = router_study(args.tokens, args.zero_mean_stds)
    print_tables(rope, router, args.positions)
    results = {"rope": rope, "router": router}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
