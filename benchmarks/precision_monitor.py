"""What the precision monitor costs, on 2 CPU ranks: the main job's reference Llama (bf16-true, fp32 norms and
``A_log``), one training step after another in one launch, every other step measured by ``PrecisionMonitor`` (its
copy of the bf16 shards before the step, the comparison and one all-reduce after it), the others not; each step a
forward, backward and AdamW step on fresh tokens. The extra time of a measured step is the difference of the two
medians; spread over ``--every`` steps (the monitor measures one step in that many) it is the monitor's share of a
run's time.

    python -m benchmarks.precision_monitor [--steps 40] [--every 50] [--dim 128] [--seq 128] [--batch 8]
"""

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch

from lightning_mixedfsdp.testing import run_distributed


def _measure(rank: int, world: int, steps: int, dim: int, seq: int, batch: int) -> Dict[str, List[float]]:
    from lightning.fabric import Fabric

    from lightning_mixedfsdp import PrecisionMonitor
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss

    torch.set_num_threads(1)
    strategy = MixedFSDP2Strategy(keep_fp32_modules=["RMSNorm"], keep_fp32_params=[r"\.A_log$"])
    fabric = Fabric(accelerator="cpu", devices=world, precision="bf16-true", strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    config = TinyLlamaConfig(dim=dim, n_layers=4, hidden_dim=3 * dim, mixer_layers=[1])
    model = fabric.setup(TinyLlama(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    monitor = PrecisionMonitor(every_n_steps=2)  # the even steps are measured
    generator = torch.Generator().manual_seed(rank)
    times: Dict[str, List[float]] = {"measured": [], "plain": []}
    for step in range(steps + 2):  # the first two warm up (optimizer state, allocator)
        tokens = torch.randint(0, 256, (batch, seq), generator=generator)
        fabric.barrier()
        started = time.perf_counter()
        fabric.backward(causal_lm_loss(model(tokens), tokens))
        with monitor.around_step(model, optimizer, step):
            optimizer.step()
        optimizer.zero_grad()
        fabric.barrier()
        if step >= 2:
            times["measured" if monitor.sampled(step) else "plain"].append(time.perf_counter() - started)
    return times


def main(argv: Any = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=50, help="the monitor's every_n_steps the cost is spread over")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    results = run_distributed(_measure, 2, args.steps, args.dim, args.seq, args.batch, timeout=1800)
    # a step takes as long as its slower rank
    measured = [max(r["measured"][i] for r in results) for i in range(len(results[0]["measured"]))]
    plain = [max(r["plain"][i] for r in results) for i in range(len(results[0]["plain"]))]
    median_measured, median_plain = statistics.median(measured), statistics.median(plain)
    extra = median_measured - median_plain
    spread = extra / (args.every * median_plain)
    print("| step | median (s) | steps |")
    print("|---|---|---|")
    print(f"| measured by the monitor | {median_measured:.4f} | {len(measured)} |")
    print(f"| not measured | {median_plain:.4f} | {len(plain)} |")
    print(
        f"a measured step costs {extra * 1000:+.1f} ms ({extra / median_plain:+.1%} of a step); measuring one step in"
        f" {args.every} adds {spread:+.2%} to a run's time"
    )
    return {"measured_s": median_measured, "plain_s": median_plain, "extra_s": extra, "spread": spread}


if __name__ == "__main__":
    main()
