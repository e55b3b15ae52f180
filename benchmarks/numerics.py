"""The numerics study: the same model, seed and data order under four dtype set-ups, on the embedded stdlib corpus.

    python -m benchmarks.numerics                      # 300 steps each, 2 ranks; writes results/numerics_loss.png
    python -m benchmarks.numerics --steps 20 --dim 32 --no-plot

Reports held-out perplexity, the fraction of norm weights (and A_log values) that moved at all, and loss curves.
"""

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List

import torch
from torchmetrics.text import Perplexity

from benchmarks.common import device_type, init_process_group
from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.apply.clip import clip_grad_norm_
from lightning_mixedfsdp.compat.extras import missing_message
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.recipes.data.text import ConsecutiveWindows, RandomWindows, split_corpus, stdlib_files
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss
from lightning_mixedfsdp.recipes.objectives.objective import warmup_cosine
from lightning_mixedfsdp.testing import run_distributed

RUNS = {
    "fp32": ("32-true", {}, "full fp32"),
    "naive_bf16": ("bf16-true", {"keep_fp32_modules": [], "honor_hf_keep_in_fp32": False}, "naive all-bf16"),
    "mixed_bf16_true": ("bf16-true", {}, "mixed_fsdp2: bf16 storage, fp32 keep"),
    "mixed_bf16_mixed": ("bf16-mixed", {}, "mixed_fsdp2: fp32 storage, bf16 compute"),
}
WATCHED = ("norm", "A_log")  # params whose movement is reported


def train(
    rank: int, world: int, run: str, steps: int, dim: int, layers: int, seq: int, batch: int, kind: str, seed: int
) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    device = init_process_group(kind)
    precision, fields, _ = RUNS[run]
    config = MixedFSDPConfig(**fields)
    torch.manual_seed(seed)
    model = TinyLlama(
        TinyLlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, hidden_dim=3 * dim, mixer_layers=[1])
    )
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if any(w in n for w in WATCHED)}
    meshes = build_parallel_meshes(kind, 1, world, 1, world)
    model = shard_model(model.to(device), config, config.bulk_dtypes(precision), meshes, device).module

    train_bytes, held_out = split_corpus(stdlib_files(), held_out_every=10, max_bytes=4_000_000)
    windows = RandomWindows(train_bytes, seq, steps * batch * world, seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 20, steps))
    losses: List[float] = []
    for step in range(steps):
        first = (step * world + rank) * batch
        tokens = torch.stack([windows[i] for i in range(first, first + batch)]).to(device)
        loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        average = loss.detach().clone()
        dist.all_reduce(average, op=dist.ReduceOp.AVG)
        losses.append(average.item())

    perplexity = Perplexity().to(device)
    evaluation = ConsecutiveWindows(held_out, seq, 64)
    with torch.no_grad():
        for start in range(0, len(evaluation), batch):
            tokens = torch.stack([evaluation[i] for i in range(start, min(start + batch, len(evaluation)))]).to(device)
            perplexity.update(model(tokens)[:, :-1].float(), tokens[:, 1:])
    final = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in model.named_parameters()
        if n in initial
    }
    moved = {w: _moved_fraction({n: final[n] for n in final if w in n}, initial) for w in WATCHED}
    return {
        "losses": losses,
        "perplexity": perplexity.compute().item(),
        "moved": moved,
        "dtypes": {n: str(t.dtype) for n, t in final.items()},
    }


def _moved_fraction(final: Dict[str, torch.Tensor], initial: Dict[str, torch.Tensor]) -> float:
    """Share of elements whose stored value differs from their initial value (cast to the stored dtype)."""
    changed = sum(int((t != initial[n].to(t.dtype)).sum()) for n, t in final.items())
    return changed / max(1, sum(t.numel() for t in final.values()))


def plot(results: Dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{missing_message('matplotlib', 'the plot')}; no plot written")
        return False
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for run, result in results.items():
        losses = result["losses"]
        smooth = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
        axis.plot(smooth, label=f"{RUNS[run][2]} (held-out ppl {result['perplexity']:.2f})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss (10-step mean)")
    axis.set_title("Byte-level Llama on the Python stdlib, 2 ranks, same seed and data order")
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return True


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0, help="init seed (the data order stays fixed)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    results = {
        run: run_distributed(
            train, 2, run, args.steps, args.dim, args.layers, args.seq, args.batch, kind, args.seed, timeout=3000
        )[0]
        for run in args.runs
    }
    reference = results.get("fp32", {}).get("perplexity")
    shape = f"dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}/rank"
    print(f"device: {kind}, 2 ranks, {args.steps} steps, {shape}")
    print("| run | held-out perplexity | vs fp32 | norm weights moved | A_log moved | final loss (10-step mean) |")
    print("|---|---|---|---|---|---|")
    for run, r in results.items():
        versus = f"{(r['perplexity'] / reference - 1) * 100:+.2f}%" if reference else "-"
        tail = r["losses"][-10:]
        print(
            f"| {RUNS[run][2]} | {r['perplexity']:.3f} | {versus} | {r['moved']['norm'] * 100:.1f}% |"
            f" {r['moved']['A_log'] * 100:.1f}% | {sum(tail) / len(tail):.4f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "numerics.json").write_text(json.dumps(results, indent=1))
    if not args.no_plot and plot(results, out / "numerics_loss.png"):
        print(f"plot: {out / 'numerics_loss.png'}")
    return results


if __name__ == "__main__":
    main()
