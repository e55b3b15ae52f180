"""What ``buffer_sync`` costs and what it buys, on a DeepSeek-V3 built from config with auxiliary-loss-free load
balancing (each rank moves every router's ``e_score_correction_bias`` towards the experts its own tokens used least,
as a user adds it to the HF model).

    python -m benchmarks.buffer_sync                 # 2 ranks, CPU/gloo or CUDA/NCCL
    python -m benchmarks.buffer_sync --layers 2 --hidden 64 --steps 3

For each mode (``none``, ``broadcast``, ``average``): the largest difference between the ranks' correction biases
that the forward after the last step routes with, the collectives one step adds over ``none``, and the median step
time (forward, backward, balancing update, AdamW step), the three models timed round-robin in one launch.
"""

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch
from torch import nn

from benchmarks.common import device_type, synchronize
from lightning_mixedfsdp.diagnostics.collectives import count_collectives
from lightning_mixedfsdp.testing import run_distributed

MODES = ("none", "broadcast", "average")
VOCAB, SEQ, BATCH = 1024, 128, 4


def deepseek_v3(layers: int, hidden: int, experts: int) -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 2,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config)


class Balancing:
    """After each backward, every correction bias moves by ``rate`` towards this rank's least used experts."""

    def __init__(self, model: nn.Module, rate: float = 1e-3) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads: Dict[nn.Module, torch.Tensor] = {}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: nn.Module, _inputs: Any, outputs: Any) -> None:
        experts = router.e_score_correction_bias.numel()
        self.loads[router] = torch.bincount(outputs[-1].reshape(-1), minlength=experts).float()

    @torch.no_grad()
    def update(self) -> None:
        for router in self.routers:
            load = self.loads[router]
            router.e_score_correction_bias.add_(self.rate * torch.sign(load.mean() - load))

    def biases(self) -> torch.Tensor:
        return torch.cat([r.e_score_correction_bias.detach().float().reshape(-1) for r in self.routers])


def measure(rank: int, world_size: int, args: argparse.Namespace, kind: str) -> Dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    runs = {}
    for mode in MODES:
        strategy = MixedFSDP2Strategy(buffer_sync=mode)
        fabric = Fabric(accelerator=kind, devices=world_size, strategy=strategy, precision="bf16-true")
        fabric.launch()
        model = fabric.setup(deepseek_v3(args.layers, args.hidden, args.experts))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
        runs[mode] = (fabric, model, optimizer, Balancing(model))
    sync = synchronize(kind)
    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    calls: Dict[str, Dict[str, int]] = {}
    for step in range(args.warmup + args.steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        for mode, (fabric, model, optimizer, balancing) in runs.items():
            tokens = tokens.to(fabric.device)
            sync()
            start = time.perf_counter()
            with count_collectives() as counts:
                fabric.backward(model(input_ids=tokens, labels=tokens).loss)
                balancing.update()
                optimizer.step()
                optimizer.zero_grad()
            sync()
            if step >= args.warmup:
                times[mode].append(time.perf_counter() - start)
            calls[mode] = counts.by_kind()
    import torch.distributed as dist

    spread = {}
    for mode, (_fabric, model, _optimizer, balancing) in runs.items():
        with torch.no_grad():  # the biases the next forward routes with (``broadcast`` syncs before a forward)
            model(input_ids=tokens)
        mine = balancing.biases()
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        spread[mode] = max((g - gathered[0]).abs().max().item() for g in gathered)
    return {
        mode: {
            "step_ms": statistics.median(times[mode]) * 1e3,
            "collectives": calls[mode],
            "bias_spread": spread[mode],
            "routers": len(runs[mode][3].routers),
        }
        for mode in MODES
    }


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    results = run_distributed(measure, 2, args, kind, timeout=1800)[0]
    none = results["none"]
    print(
        f"device: {kind}, 2 ranks, DeepSeek-V3 L={args.layers} hidden={args.hidden} experts={args.experts}"
        f" ({none['routers']} routers), bf16-true, seq {SEQ} x batch {BATCH} per rank,"
        f" {args.steps} timed steps after {args.warmup}"
    )
    print("| buffer_sync | max bias difference between ranks | collectives added per step | step ms | vs none |")
    print("|---|---|---|---|---|")
    for mode, row in results.items():
        added = {k: v - none["collectives"].get(k, 0) for k, v in row["collectives"].items()}
        added_text = ", ".join(f"{v} {k}" for k, v in sorted(added.items()) if v) or "-"
        print(
            f"| {mode} | {row['bias_spread']:.3g} | {added_text} | {row['step_ms']:.1f} |"
            f" {row['step_ms'] / none['step_ms']:.3f} |"
        )
    return results


if __name__ == "__main__":
    main()
