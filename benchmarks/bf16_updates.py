"""bf16 params' updates written back three ways (``dtypes.bf16_updates``) beside fp32 masters, on the main job's model
(``conf/stdlib_llama.yaml``: the reference Llama with fp32 norms and a Mamba-style mixer) and its optimizer
(AdamW, lr 3e-3 with 20 warm-up steps and cosine decay, betas 0.9/0.95, weight decay 0.01, clipping at 1.0), on
the Python standard library's source bytes, one launch of 2 ranks (gloo):

- ``bf16-mixed``: fp32 params (masters) computing in bf16;
- ``bf16-true`` with ``nearest`` (rounded to nearest), ``stochastic`` and ``kahan``.

The four set-ups start from the same weights, see the same rows in the same order and take their steps in turn (the
order reversed every other step). Reported: bytes per trainable param (param, AdamW states, Kahan buffer; all
trainable params, fp32 norms included, and the bf16 bulk alone), the median step time of the slower rank, and the
held-out loss after the steps.

    python -m benchmarks.bf16_updates                  # 250 steps, the main job's length: about 15 minutes here
    python -m benchmarks.bf16_updates --steps 50 --dim 64

Figures, never asserted: ``tests/test_benchmarks.py`` runs it at tiny sizes for its structure.
"""

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from lightning_mixedfsdp.testing import run_distributed

SETUPS: Dict[str, Tuple[str, str]] = {
    "fp32 masters (bf16-mixed)": ("bf16-mixed", "nearest"),
    "bf16, nearest": ("bf16-true", "nearest"),
    "bf16, stochastic": ("bf16-true", "stochastic"),
    "bf16, kahan": ("bf16-true", "kahan"),
}
MODULES = ("json", "inspect", "argparse", "textwrap", "string", "typing", "dataclasses", "pathlib", "logging")


def stdlib_bytes() -> Tensor:
    import importlib

    text = b"".join(Path(importlib.import_module(name).__file__ or "").read_bytes() for name in MODULES)
    return torch.tensor(list(text), dtype=torch.long)


def _bytes_per_param(model: Any, optimizer: Any) -> Dict[str, float]:
    """Stored bytes per trainable element: param + optimizer state, over all and over the bf16 bulk."""
    from lightning_mixedfsdp.model.tensors import local_tensor

    totals = {"all": [0, 0], "bf16 bulk": [0, 0]}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        local = local_tensor(param)
        state = [local_tensor(t) for t in optimizer.state[param].values() if isinstance(t, Tensor) and t.dim()]
        stored = local.numel() * local.element_size() + sum(t.numel() * t.element_size() for t in state)
        kinds = ["all", "bf16 bulk"] if local.dtype == torch.bfloat16 else ["all"]
        for kind in kinds:
            totals[kind][0] += stored
            totals[kind][1] += local.numel()
    return {kind: stored / max(count, 1) for kind, (stored, count) in totals.items() if count}


def _launch(rank: int, world: int, steps: int, dim: int, seq: int, batch: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig
    from lightning_mixedfsdp.recipes.objectives.objective import warmup_cosine

    config = TinyLlamaConfig(vocab_size=256, dim=dim, n_layers=4, n_heads=4, hidden_dim=3 * dim, mixer_layers=[1])
    runs: Dict[str, Any] = {}
    for name, (precision, method) in SETUPS.items():
        strategy = MixedFSDP2Strategy(
            bf16_updates=method, keep_fp32_modules=["RMSNorm"], keep_fp32_params=[r"\.A_log$", r"\.dt_bias$"]
        )
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
        fabric.launch()
        fabric.seed_everything(1234)
        with fabric.init_module():
            model = fabric.setup_module(TinyLlama(config))
        optimizer = fabric.setup_optimizers(
            torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
        )
        runs[name] = (fabric, model, optimizer)
    data = stdlib_bytes()
    held_out, train = data[-64 * seq :], data[: -64 * seq]
    generator = torch.Generator().manual_seed(rank)
    names = list(SETUPS)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for step in range(steps):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([train[s : s + seq + 1] for s in starts])
        for name in names if step % 2 == 0 else names[::-1]:
            fabric, model, optimizer = runs[name]
            for group in optimizer.param_groups:
                group["lr"] = 3e-3 * warmup_cosine(step, 20, steps)
            dist.barrier()
            started = time.perf_counter()
            train_step(fabric, model, optimizer, rows)
            seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            times[name].append(seconds.item())
    # counted before the held-out forward: FSDP's root unit then holds gathered params in place of the shards
    out: Dict[str, Any] = {name: {"bytes": _bytes_per_param(model, opt)} for name, (_, model, opt) in runs.items()}
    for name, (_, model, _) in runs.items():
        held = held_out_loss(model, held_out, seq)
        out[name].update(held_out_loss=held, step_s=statistics.median(times[name][1:] or times[name]))
    return out


def train_step(fabric: Any, model: Any, optimizer: Any, rows: Tensor) -> None:
    """One of the main job's steps on ``rows`` (inputs and their next bytes): the byte loss, clipping at 1.0, the
    optimizer's step."""
    logits = model(rows[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()


def held_out_loss(model: Any, held_out: Tensor, seq: int) -> float:
    """The model's next-byte loss over ``held_out`` in windows of ``seq`` bytes."""
    windows = held_out[: (len(held_out) - 1) // seq * seq + 1]
    with torch.no_grad():
        logits = model(windows[:-1].reshape(-1, seq)).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[1:].reshape(-1, seq).flatten()).item()


def main_job_parser(description: str, steps: int, batch_per: str = "rank") -> argparse.ArgumentParser:
    """The flags of a benchmark on the main job's model: steps, width, sequence length, rows a step."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--dim", type=int, default=128, help="the model's width (the main job's: 128)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help=f"rows per {batch_per} a step")
    return parser


def main(argv: Any = None) -> Dict[str, Any]:
    args = main_job_parser(__doc__ or "", 250).parse_args(argv)
    launch = run_distributed(_launch, 2, args.steps, args.dim, args.seq, args.batch, timeout=7200)
    results = launch[0]
    print(
        f"The main job's model (dim {args.dim}, 4 layers, a mixer), {args.steps} AdamW steps, 2 ranks x {args.batch}"
        f" rows of {args.seq} bytes, the same rows for every set-up\n"
    )
    print("| set-up | bytes per trainable param (all / bf16 bulk) | step median s | held-out loss | vs fp32 masters |")
    print("|---|---|---|---|---|")
    reference = results["fp32 masters (bf16-mixed)"]["held_out_loss"]
    for name, row in results.items():
        per = row["bytes"]
        bulk = f"{per['bf16 bulk']:.1f}" if "bf16 bulk" in per else "-"
        print(
            f"| {name} | {per['all']:.1f} / {bulk} | {row['step_s']:.3f} | {row['held_out_loss']:.4f} |"
            f" {row['held_out_loss'] - reference:+.4f} |"
        )
    return results


if __name__ == "__main__":
    main()
