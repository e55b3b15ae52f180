"""Supervised fine-tuning throughput with packing against one conversation per row (padding), same data, 2 CPU ranks:
the main job's reference Llama (bf16-true, fp32 norms and ``A_log``) on the generated standard-library chat data
rendered with the byte template, rows of ``--seq-len`` tokens, ``--batch`` rows per rank per step. Both settings live
in one launch and take steps in turn (packed, padded, padded, packed, ...), so drift on a shared machine favours
neither; each step is a forward, backward and AdamW step with the loss on the assistant tokens. Trained tokens per
second count only the tokens that carry a loss (the assistant turns), the figure that matters for a fine-tuning run.

    python -m benchmarks.sft_packing [--steps 20] [--seq-len 512] [--batch 2]
"""

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch

from lightning_mixedfsdp.testing import run_distributed

DIMS = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, hidden_dim=384, mixer_layers=[1])


def _rows(seq_len: int, packed: bool) -> Any:
    from lightning_mixedfsdp.recipes.data.sft import ExampleMaker, fine_tuning_examples, packed_rows, padded_rows
    from lightning_mixedfsdp.recipes.data.text import ByteTokenizer
    from lightning_mixedfsdp.recipes.settings.schema import DataSection

    data = DataSection(format="chat", seq_len=seq_len)
    splits = fine_tuning_examples(data, ExampleMaker(data, "chat", ByteTokenizer()))
    return (packed_rows if packed else padded_rows)(splits.train, seq_len, 0)


def _measure(rank: int, world: int, steps: int, seq_len: int, batch: int) -> Dict[str, Any]:
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    torch.set_num_threads(1)
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        precision="bf16-true",
        strategy=MixedFSDP2Strategy(keep_fp32_modules=["RMSNorm"], keep_fp32_params=[r"\.A_log$"]),
    )
    fabric.launch()
    settings: Dict[str, Dict[str, Any]] = {}
    for name, packed in (("packed", True), ("padded", False)):
        torch.manual_seed(0)
        model = fabric.setup(TinyLlama(TinyLlamaConfig(**DIMS)))  # type: ignore[arg-type]
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        rows = _rows(seq_len, packed)
        settings[name] = {"model": model, "optimizer": optimizer, "rows": rows, "seconds": [], "tokens": []}
    for step in range(steps + 1):  # step 0 warms both up (optimizer state, allocator)
        order = ("packed", "padded") if step % 2 == 0 else ("padded", "packed")
        for name in order:
            setting = settings[name]
            rows = setting["rows"]
            index = torch.arange(batch) + (step * world + rank) * batch
            index = index % len(rows)
            ids, labels, positions = rows.input_ids[index], rows.labels[index], rows.position_ids[index]
            fabric.barrier()
            started = time.perf_counter()
            logits = setting["model"](ids, positions if name == "packed" else None)
            targets = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets, ignore_index=-100)
            fabric.backward(loss)
            setting["optimizer"].step()
            setting["optimizer"].zero_grad()
            fabric.barrier()
            if step > 0:
                setting["seconds"].append(time.perf_counter() - started)
                setting["tokens"].append(int((targets != -100).sum()))
    return {
        name: {
            "seconds": s["seconds"],
            "tokens": s["tokens"],
            "rows": len(s["rows"]),
            "padding": s["rows"].padding,
            "trained_per_row": float(s["rows"].trained.float().mean()),
        }
        for name, s in settings.items()
    }


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    results: List[Dict[str, Any]] = run_distributed(_measure, 2, args.steps, args.seq_len, args.batch, timeout=1800)
    summary: Dict[str, Any] = {}
    for name in ("packed", "padded"):
        step_seconds = [max(r[name]["seconds"][i] for r in results) for i in range(args.steps)]
        tokens = [sum(r[name]["tokens"][i] for r in results) for i in range(args.steps)]
        median = statistics.median(step_seconds)
        summary[name] = {
            "rows": results[0][name]["rows"],
            "padding": results[0][name]["padding"],
            "median_step_s": median,
            "trained_tokens_per_s": sum(tokens) / sum(step_seconds),
            "trained_per_row": results[0][name]["trained_per_row"],
        }
    packed, padded = summary["packed"], summary["padded"]
    print(f"| rows of {args.seq_len} tokens, {args.batch} per rank x 2 ranks | rows for the data | padding |"
          " median step (s) | trained tokens per row | trained tokens / s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(
            f"| {name} | {s['rows']} | {s['padding']:.1%} | {s['median_step_s']:.3f} | {s['trained_per_row']:.1f} |"
            f" {s['trained_tokens_per_s']:.0f} |"
        )
    speedup = packed["trained_tokens_per_s"] / padded["trained_tokens_per_s"]
    print(
        f"packing: {speedup:.2f}x the trained tokens per second; padding {padded['padding']:.1%} -> "
        f"{packed['padding']:.1%} of the tokens computed ({padded['rows']} -> {packed['rows']} rows for one epoch)"
    )
    summary["speedup"] = speedup
    return summary


if __name__ == "__main__":
    main()
