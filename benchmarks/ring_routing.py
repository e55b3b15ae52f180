"""What context parallelism's routing costs a step: the torch-function mode that sends torch's attention to the ring
stays on the stack of a process that split a sequence, and every torch call then passes through it (a Python call).
One process, the byte-level reference Llama of ``benchmarks/context_parallel.py``, bf16-true storage as the plan gives
it (fp32 norms), one training step (forward, backward, AdamW) per setting, the settings interleaved; with the mode on
the stack and no context-parallel pass running (the mode passes every call through), and without it.

    python -m benchmarks.ring_routing [--lengths 256 1024 4096] [--repeats 7]

Prints the median step time of each setting per length and their ratio.
"""

import argparse
import statistics
import time
from contextlib import nullcontext
from typing import Any, Dict, List

import torch

DIMS = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, hidden_dim=384)


def _step(model: Any, optimizer: Any, tokens: torch.Tensor) -> float:
    from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss

    started = time.perf_counter()
    loss = causal_lm_loss(model(tokens), tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def main(argv: Any = None) -> Dict[int, Dict[str, float]]:
    from lightning_mixedfsdp.apply.context_parallel import _RingAttentionMode
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLlama(TinyLlamaConfig(**DIMS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    results: Dict[int, Dict[str, float]] = {}
    print("| tokens | without the mode: s/step | with the mode: s/step | with / without |")
    print("|---|---|---|---|")
    for length in args.lengths:
        tokens = torch.randint(0, DIMS["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
        times: Dict[str, List[float]] = {"without": [], "with": []}
        _step(model, optimizer, tokens)  # warm-up: optimizer state exists
        for repeat in range(args.repeats):
            order = ("without", "with") if repeat % 2 == 0 else ("with", "without")
            for setting in order:
                with _RingAttentionMode() if setting == "with" else nullcontext():
                    times[setting].append(_step(model, optimizer, tokens))
        medians = {setting: statistics.median(values) for setting, values in times.items()}
        results[length] = {**medians, "ratio": medians["with"] / medians["without"]}
        print(f"| {length} | {medians['without']:.4f} | {medians['with']:.4f} | {results[length]['ratio']:.3f} |")
    return results


if __name__ == "__main__":
    main()
