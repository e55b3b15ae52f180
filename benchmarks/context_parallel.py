"""Activation memory per rank against sequence length, without and with context parallelism, on 2 CPU ranks: the
byte-level reference Llama (small, so activations dominate), bf16-true with fp32 norms, full activation
checkpointing, one sequence per data-parallel rank, ring attention passing the key/value parts one neighbour at a
time (``--rotate alltoall``; ``allgather`` holds all of them at once). CP 1: each rank trains a whole sequence; CP 2:
the two ranks split one sequence. For each length, one training step (forward, backward, AdamW) per setting, the
settings interleaved; per rank the peak RSS during the step minus the RSS before it (``/proc/self/clear_refs``, after
``malloc_trim``), the larger of the two ranks reported.

    python -m benchmarks.context_parallel [--lengths 1024 2048 4096 8192 16384] [--budget-mib 256]

The last lines fit each setting's bytes per token (least squares through the measured points) and give the longest
sequence each fits in the budget.
"""

import argparse
import ctypes
import time
from typing import Any, Dict, List

import torch

from benchmarks.meta_memory import _reset_peak, _status
from lightning_mixedfsdp.testing import run_distributed

DIMS = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, hidden_dim=384)


def _step_growth(fabric: Any, model: Any, optimizer: Any, tokens: torch.Tensor) -> Dict[str, float]:
    """Peak RSS growth and seconds of one training step."""
    import torch.nn.functional as F

    from lightning_mixedfsdp.apply.context_parallel import shifted_labels

    context = fabric.strategy.context_parallel
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _reset_peak()
    started = time.perf_counter()
    labels = shifted_labels(tokens)
    positions = torch.arange(tokens.shape[1])
    local, where, local_labels = context.split(tokens, positions, labels, dims=(1, 0, 1))
    logits = model(local, where)
    summed = F.cross_entropy(logits.float().flatten(0, 1), local_labels.flatten(), reduction="sum")
    loss = context.loss(summed, (labels != -100).sum())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - started
    return {"growth": float(_status("VmHWM:") - before), "seconds": seconds}


def _measure(rank: int, world: int, lengths: List[int], rotate: str) -> Dict[Any, Dict[str, float]]:
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    torch.set_num_threads(1)
    setups = {}
    for cp in (1, 2):
        strategy = MixedFSDP2Strategy(
            context_parallel_size=cp, context_parallel_rotate=rotate, activation_checkpointing="full"
        )
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-true")
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup(TinyLlama(TinyLlamaConfig(**DIMS)))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        data_rank = fabric.strategy.meshes.data_parallel.get_local_rank()
        setups[cp] = (fabric, model, optimizer, data_rank)
    out: Dict[Any, Dict[str, float]] = {}
    for index, length in enumerate(lengths):
        order = (1, 2) if index % 2 == 0 else (2, 1)
        for cp in order:
            fabric, model, optimizer, data_rank = setups[cp]
            generator = torch.Generator().manual_seed(length + data_rank)
            tokens = torch.randint(0, DIMS["vocab_size"], (1, length), generator=generator)
            _step_growth(fabric, model, optimizer, tokens[:, : 4 * cp])  # warm-up: optimizer state exists
            out[cp, length] = _step_growth(fabric, model, optimizer, tokens)
    return out


def fit_per_token(points: Dict[int, float]) -> float:
    """Bytes per token through the origin (least squares)."""
    return sum(n * b for n, b in points.items()) / sum(n * n for n in points)


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--rotate", choices=["allgather", "alltoall"], default="alltoall")
    args = parser.parse_args(argv)
    results = run_distributed(_measure, 2, args.lengths, args.rotate, timeout=1800)
    worst = {key: max(r[key]["growth"] for r in results) for key in results[0]}
    seconds = {key: max(r[key]["seconds"] for r in results) for key in results[0]}
    print("| tokens per sequence | CP 1: MiB per rank | CP 2: MiB per rank | CP 2 / CP 1 | seconds CP 1 / CP 2 |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        one, two = worst[1, length], worst[2, length]
        print(
            f"| {length} | {one / 2**20:.1f} | {two / 2**20:.1f} | {two / one:.2f} |"
            f" {seconds[1, length]:.2f} / {seconds[2, length]:.2f} |"
        )
    budget = args.budget_mib * 2**20
    longest = {}
    for cp in (1, 2):
        per_token = fit_per_token({n: worst[cp, n] for n in args.lengths})
        longest[cp] = int(budget / per_token)
        print(
            f"CP {cp}: {per_token / 1024:.1f} KiB per token, longest sequence in {args.budget_mib:g} MiB: {longest[cp]}"
        )
    return {"growth": worst, "longest": longest}


if __name__ == "__main__":
    main()
