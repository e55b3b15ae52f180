"""Semi-synchronous replicas (``parallelism.replicate_sync``) against every-step sync on the main job's model
(``conf/stdlib_llama.yaml``: the reference Llama with fp32 norms and a Mamba-style mixer, bf16-true) and its
optimizer (AdamW, lr 3e-3 with 20 warm-up steps and cosine decay, betas 0.9/0.95, weight decay 0.01, clipping at
1.0) on 2 replicas x 1 shard (2 ranks, gloo), each replica on its own rows of the Python standard library's bytes:

- ``every step``: HSDP, every gradient all-reduced across the replicas every step;
- ``local SGD, H``: each replica alone for H steps, then the params averaged;
- ``DiLoCo, H``: then the pseudo-gradients averaged and applied by Nesterov SGD (lr 0.7, momentum 0.9) to the fp32
  global copy; ``diloco_20_outer_0.3``: the same at outer lr 0.3.

``--warm-start EXPORT`` starts every set-up from a trained model's weights (the main job's export:
``runs/stdlib_llama/export`` after ``python -m lightning_mixedfsdp.train --config conf/stdlib_llama.yaml``), as
DiLoCo's paper starts from a pretrained model; ``--lr`` sets the inner AdamW's peak lr (a warm start takes the main
job's last, 3e-4).

Every set-up starts from the same weights and sees the same rows. Reported per set-up, as each finishes: the payload
each rank all-reduces across the replicate dim per optimizer step (gradients in their reduce dtype every step, or fp32
params / pseudo-gradients every H steps), the held-out perplexity after the steps (every H divides them: the replicas
are equal then), and the median step time.

    python -m benchmarks.semi_sync                       # 500 steps, 7 set-ups: 15-25 min each on 2 busy cores
    python -m benchmarks.semi_sync --steps 100 --setups every_step diloco_20
    python -m benchmarks.semi_sync --warm-start runs/stdlib_llama/export --lr 3e-4 --steps 200 \
        --setups every_step local_sgd_20 diloco_20 diloco_20_outer_0.3

Figures, never asserted: ``tests/test_benchmarks.py`` runs it at tiny sizes for its structure.
"""

import math
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

import torch

from benchmarks.bf16_updates import held_out_loss, main_job_parser, stdlib_bytes, train_step
from lightning_mixedfsdp.testing import run_distributed

SETUPS: Dict[str, Tuple[str, int, float]] = {
    "every_step": ("every_step", 1, 0.0),
    "local_sgd_5": ("local_sgd", 5, 0.0),
    "local_sgd_20": ("local_sgd", 20, 0.0),
    "local_sgd_50": ("local_sgd", 50, 0.0),
    "diloco_5": ("diloco", 5, 0.7),
    "diloco_20": ("diloco", 20, 0.7),
    "diloco_50": ("diloco", 50, 0.7),
    "diloco_20_outer_0.3": ("diloco", 20, 0.3),
}
"""Each set-up's replicate sync, its H and DiLoCo's outer lr (Nesterov momentum 0.9 throughout)."""


def replicate_bytes(model: Any, method: str, every: int) -> float:
    """The payload one rank all-reduces across the replicate dim per optimizer step."""
    from lightning_mixedfsdp.model.tensors import local_tensor

    trainable = [local_tensor(p) for p in model.parameters() if p.requires_grad]
    if method == "every_step":  # each gradient in its param's dtype (bf16-true reduces in bf16; fp32 norms in fp32)
        return float(sum(t.numel() * t.element_size() for t in trainable))
    return sum(t.numel() for t in trainable) * 4 / every


def _train(
    rank: int, world: int, name: str, steps: int, dim: int, seq: int, batch: int, lr: float, warm_start: str
) -> Dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig
    from lightning_mixedfsdp.recipes.objectives.objective import warmup_cosine

    method, every, outer_lr = SETUPS[name]
    config = TinyLlamaConfig(vocab_size=256, dim=dim, n_layers=4, n_heads=4, hidden_dim=3 * dim, mixer_layers=[1])
    sync = {} if method == "every_step" else {"replicate_sync": method, "sync_every": every}
    if method == "diloco":
        sync["outer_lr"] = outer_lr
    strategy = MixedFSDP2Strategy(
        data_parallel_replicate_size=2,
        keep_fp32_modules=["RMSNorm"],
        keep_fp32_params=[r"\.A_log$", r"\.dt_bias$"],
        **sync,
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-true")
    fabric.launch()
    fabric.seed_everything(1234)
    with fabric.init_module():
        model = fabric.setup_module(TinyLlama(config))
    if warm_start:
        from lightning_mixedfsdp import load_full_weights

        load_full_weights(model, warm_start)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    )
    data = stdlib_bytes()
    held_out, train = data[-64 * seq :], data[: -64 * seq]
    generator = torch.Generator().manual_seed(rank)
    times: List[float] = []
    for step in range(steps):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([train[s : s + seq + 1] for s in starts])
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup_cosine(step, 20, steps)
        started = time.perf_counter()
        train_step(fabric, model, optimizer, rows)
        seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(seconds.item())
    payload = replicate_bytes(model, method, every)  # before the held-out forward gathers the root unit
    held = held_out_loss(model, held_out, seq)
    return {"bytes": payload, "held_out_loss": held, "step_s": statistics.median(times[1:] or times)}


def main(argv: Any = None) -> Dict[str, Any]:
    parser = main_job_parser(__doc__ or "", 500, batch_per="replica")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's peak lr (the main job's: 3e-3)")
    parser.add_argument("--warm-start", default="", help="an export folder every set-up starts from (default: random)")
    args = parser.parse_args(argv)
    start = f"from {args.warm_start}" if args.warm_start else "from a random init"
    print(
        f"The main job's model (dim {args.dim}, 4 layers, a mixer, bf16-true) {start}, {args.steps} AdamW steps"
        f" (peak lr {args.lr:g}), 2 replicas x 1 shard, {args.batch} rows of {args.seq} bytes per replica a step\n"
    )
    print("| replicate sync | bytes across the replicate dim per step and rank | vs every step | held-out perplexity |"
          " vs every step | step median s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    results: Dict[str, Any] = {}
    for name in args.setups:
        launch = (name, args.steps, args.dim, args.seq, args.batch, args.lr, args.warm_start)
        row = run_distributed(_train, 2, *launch, timeout=7200)[0]
        results[name] = row
        base = results.get("every_step", row)
        ppl, base_ppl = math.exp(row["held_out_loss"]), math.exp(base["held_out_loss"])
        print(
            f"| {name} | {row['bytes'] / 1024:.1f} KiB | {row['bytes'] / base['bytes']:.3f}x | {ppl:.3f} |"
            f" {100 * (ppl / base_ppl - 1):+.2f} % | {row['step_s']:.3f} |"
        )
        sys.stdout.flush()
    return results


if __name__ == "__main__":
    main()
