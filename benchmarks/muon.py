"""Muon beside AdamW (``lightning_mixedfsdp.muon_with_adamw``) against AdamW alone, on the main job's model
(``conf/stdlib_llama.yaml``: the reference Llama with fp32 norms and a Mamba-style mixer, bf16-true) and schedule
(20 warm-up steps, cosine decay to 10 %, clipping at 1.0), on the Python standard library's source bytes, one launch
of 2 ranks (gloo):

- ``AdamW``: the main job's optimizer (lr 3e-3, betas 0.9/0.95, weight decay 0.01) over every param;
- ``Muon + AdamW``: Muon (lr 0.02, momentum 0.95, Nesterov) for the blocks' matrices, the same AdamW for the rest.

Both start from the same weights and see the same rows in the same order, steps in turn. Reported: the held-out
perplexity every 25 steps and the first evaluation at which Muon reaches AdamW's last; then the optimizer step of the
Muon model timed two ways on the same grads, steps in turn: owner-based (each matrix to one owner rank, one all-to-all
pair per dtype) and naive (every rank all-gathers every matrix and orthogonalises all of them), with the bytes each
rank sends in the step's collectives and the Newton-Schulz FLOPs each rank computes.

    python -m benchmarks.muon                 # 250 steps, the main job's length: about 10 minutes on 2 cores
    python -m benchmarks.muon --steps 50 --dim 64

Figures, never asserted: ``tests/test_benchmarks.py`` runs it at tiny sizes for its structure.
"""

import math
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from benchmarks.bf16_updates import held_out_loss, main_job_parser, stdlib_bytes, train_step
from lightning_mixedfsdp.apply.muon_exchange import owners, row_counts
from lightning_mixedfsdp.testing import run_distributed

EVERY = 25
"""Steps between held-out evaluations."""
NS_STEPS = 5


def newton_schulz_flops(shapes: Sequence[Tuple[int, int]]) -> int:
    """FLOPs of torch's 5 quintic Newton-Schulz iterations on matrices of ``shapes`` (the short side m, the long n: per
    iteration X X^T is 2 m^2 n, its square 2 m^3, the update times X 2 m^2 n)."""
    total = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += NS_STEPS * (4 * m * m * n + 2 * m**3)
    return total


def orthogonalise_everywhere(updates: Sequence[Any]) -> List[Tensor]:
    """The naive way: every rank all-gathers every matrix (one all-gather per param) and orthogonalises all of them."""
    from torch.distributed.tensor import DTensor

    from lightning_mixedfsdp.compat.torch import muon_orthogonalise

    out = []
    for update in updates:
        param = update.param
        if not isinstance(param, DTensor):
            out.append(muon_orthogonalise(update.rows, *update.newton_schulz))
            continue
        whole = DTensor.from_local(
            update.rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        ).full_tensor()
        orthogonal = muon_orthogonalise(whole, *update.newton_schulz)
        first = sum(row_counts(int(param.shape[0]), param.device_mesh.size())[: param.device_mesh.get_local_rank()])
        out.append(orthogonal[first : first + update.rows.shape[0]])
    return out


def received_bytes(shapes: Sequence[Tuple[int, int]], ranks: int, rank: int, itemsize: int, owner_based: bool) -> int:
    """Bytes ``rank`` receives in one step's exchange: owner-based, the other ranks' rows of the matrices it owns
    (in the update's dtype) and its own rows of the others' results (bf16); naive, the other ranks' rows of every
    matrix."""
    owner = owners(shapes, ranks)
    total = 0
    for (rows, cols), owned_by in zip(shapes, owner, strict=True):
        counts = row_counts(rows, ranks)
        others = (rows - counts[rank]) * cols
        if not owner_based:
            total += others * itemsize
        elif owned_by == rank:
            total += others * itemsize
        else:
            total += counts[rank] * cols * 2
    return total


def _launch(rank: int, world: int, steps: int, dim: int, seq: int, batch: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_mixedfsdp import muon_with_adamw
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig
    from lightning_mixedfsdp.recipes.objectives.objective import warmup_cosine

    config = TinyLlamaConfig(vocab_size=256, dim=dim, n_layers=4, n_heads=4, hidden_dim=3 * dim, mixer_layers=[1])
    strategy = MixedFSDP2Strategy(keep_fp32_modules=["RMSNorm"], keep_fp32_params=[r"\.A_log$", r"\.dt_bias$"])
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-true")
    fabric.launch()
    fabric.seed_everything(1234)
    setups: Dict[str, Any] = {}
    for name in ("AdamW", "Muon + AdamW"):
        torch.manual_seed(1234)
        with fabric.init_module():
            model = fabric.setup_module(TinyLlama(config))
        optimizer: Any
        if name == "AdamW":
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
        else:
            optimizer = muon_with_adamw(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
        optimizer = fabric.setup_optimizers(optimizer)
        peaks = [group["lr"] for group in optimizer.param_groups]
        setups[name] = {"model": model, "optimizer": optimizer, "peaks": peaks, "curve": {}}
    data = stdlib_bytes()
    held_out, train = data[-64 * seq :], data[: -64 * seq]
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([train[s : s + seq + 1] for s in starts])
        for setup in setups.values():
            for group, peak in zip(setup["optimizer"].param_groups, setup["peaks"], strict=True):
                group["lr"] = peak * warmup_cosine(step, 20, steps)
            train_step(fabric, setup["model"], setup["optimizer"], rows)
            if (step + 1) % EVERY == 0 or step + 1 == steps:
                setup["curve"][step + 1] = held_out_loss(setup["model"], held_out, seq)

    # the Muon model's optimizer step, owner-based and naive, on the same kind of grads, in turn
    muon = setups["Muon + AdamW"]
    model, optimizer = muon["model"], muon["optimizer"]
    inner = optimizer.optimizer  # Fabric's wrapper copies the optimizer's attributes; set them on the optimizer
    owner_based = inner.orthogonalise
    times: Dict[str, List[float]] = {"owner-based": [], "naive": []}
    for _ in range(10):
        for way, function in (("owner-based", owner_based), ("naive", orthogonalise_everywhere)):
            starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=generator)
            rows = torch.stack([train[s : s + seq + 1] for s in starts])
            logits = model(rows[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
            fabric.backward(loss)
            for group in optimizer.param_groups:
                group["lr"] = 0.0  # the weights stay: the same step timed again
            inner.orthogonalise = function
            dist.barrier()
            started = time.perf_counter()
            optimizer.step()
            seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
            optimizer.zero_grad()
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            times[way].append(seconds.item())
    inner.orthogonalise = owner_based
    shapes = [(int(p.shape[0]), int(p.shape[1])) for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    owner = owners(shapes, world)
    flops = {
        "owner-based": newton_schulz_flops([s for s, o in zip(shapes, owner, strict=True) if o == rank]),
        "naive": newton_schulz_flops(shapes),
    }
    received = {way: received_bytes(shapes, world, rank, 2, way == "owner-based") for way in flops}
    return {
        "curves": {name: setup["curve"] for name, setup in setups.items()},
        "step_s": {way: statistics.median(values) for way, values in times.items()},
        "bytes": received,
        "flops": flops,
        "matrices": len(shapes),
    }


def steps_to_reach(curve: Dict[int, float], target: float) -> Any:
    """The first evaluated step whose held-out loss is at or below ``target`` (None: never)."""
    return next((step for step, loss in sorted(curve.items()) if loss <= target), None)


def main(argv: Any = None) -> Dict[str, Any]:
    args = main_job_parser(__doc__ or "", 250).parse_args(argv)
    ranks = run_distributed(_launch, 2, args.steps, args.dim, args.seq, args.batch, timeout=7200)
    results = ranks[0]
    curves = results["curves"]
    print(
        f"The main job's model (dim {args.dim}, 4 layers, a mixer, bf16-true), {args.steps} steps, 2 ranks x"
        f" {args.batch} rows of {args.seq} bytes, the same rows for both\n"
    )
    print("| step | " + " | ".join(f"{name} held-out perplexity" for name in curves) + " |")
    print("|---|" + "---|" * len(curves))
    for step in sorted(curves["AdamW"]):
        print(f"| {step} | " + " | ".join(f"{math.exp(curve[step]):.3f}" for curve in curves.values()) + " |")
    final = curves["AdamW"][max(curves["AdamW"])]
    reached = steps_to_reach(curves["Muon + AdamW"], final)
    results["muon_reaches_adamw_at"] = reached
    last = max(curves["AdamW"])
    print(f"\nMuon + AdamW reaches AdamW's {last}-step perplexity ({math.exp(final):.3f}) at step {reached}")
    print(f"\nThe optimizer step of the Muon model ({results['matrices']} matrices), median of 10, slower rank:\n")
    print("| Muon's exchange | step s | vs naive | KiB received per rank | Newton-Schulz GFLOP per rank |")
    print("|---|---|---|---|---|")
    naive = results["step_s"]["naive"]
    for way in ("owner-based", "naive"):
        flops = " / ".join(f"{r['flops'][way] / 1e9:.3f}" for r in ranks)
        received = " / ".join(f"{r['bytes'][way] / 1024:.0f}" for r in ranks)
        step = results["step_s"][way]
        print(f"| {way} | {step:.4f} | {step / naive:.2f}x | {received} | {flops} |")
    return results


if __name__ == "__main__":
    main()
