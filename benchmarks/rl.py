"""Reinforcement learning's step on the sharded policy (``objective: grpo``), one launch of 2 ranks (gloo), bf16-true,
an HF Llama built from config (byte-level vocabulary) sharded by ``mixed_fsdp2`` with its head in fp32
(``dtypes.fp32_compute_modules``):

- a GRPO step's time split into generate (``rl/rollouts.py``'s sampler), score (``exact_match``) and train (the
  training forward's log-probs, the loss, backward and AdamW), median over steps, for both ``rl.generation`` modes:
  ``gathered`` (each unit all-gathered once per rollout and held) and ``sharded`` (FSDP's all-gathers at every
  decoding step, an end flag all-reduced per step);
- rollout tokens/s of each mode (completion tokens of both ranks over the generate time), and the param bytes each
  holds per rank while decoding (gathered: every unit unsharded; sharded: the shards plus one unit at a time);
- the weight sync (``lightning_mixedfsdp.stream_weights`` to rank 0) at each ``--bucket-mb``: its time, MB/s, and each
  rank's peak host allocation during it (an allocator ledger) beside the largest FSDP unit;
- the generator-trainer log-prob mismatch (mean over completion tokens of ``|p_train / p_generator - 1|``) with the
  head in bf16 and in fp32, on a policy first trained until its distributions are peaked (a random init's logits
  round alike in bf16 whichever head computes them).

    python -m benchmarks.rl                      # 64-wide, 4 layers: about 2 minutes on 2 cores
    python -m benchmarks.rl --dim 128 --layers 4 --steps 8
    python -m benchmarks.rl --learning           # the recipe against a plain loop: benchmarks/rl_learning.py
    python -m benchmarks.rl --modes              # a recipe step colocated, on a generator rank, one step stale

Figures, never asserted: ``tests/test_benchmarks.py`` runs it at tiny sizes for its structure.
"""

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from benchmarks.rl_learning import learning, learning_parser
from benchmarks.rl_modes import generation_modes
from lightning_mixedfsdp.testing import run_distributed

WORLD = 2
VOCAB = 256
PHASES = ("generate", "score", "train")
MODES = ("gathered", "sharded")


def llama(dim: int, layers: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def peaked(dim: int, layers: int, steps: int) -> Dict[str, torch.Tensor]:
    """Weights trained on sequences ``x -> 7x + 13 + noise`` until the next token is nearly certain, as a policy's
    distributions are after fine-tuning."""
    model = llama(dim, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = [torch.randint(0, VOCAB, (16, 1), generator=generator)]
        for _ in range(31):
            tokens.append((tokens[-1] * 7 + 13 + torch.randint(0, 3, (16, 1), generator=generator)) % VOCAB)
        ids = torch.cat(tokens, 1)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return model.state_dict()


def prompts_of(rank: int, count: int) -> List[Any]:
    """This rank's prompts of the comparison task, as the recipe renders them (byte chat template)."""
    from lightning_mixedfsdp.recipes.data.chat import BYTE_CHAT_TEMPLATE, byte_chat_format
    from lightning_mixedfsdp.recipes.data.comparison import comparison_prompts

    chat = byte_chat_format(lambda text: list(text.encode("utf-8")), BYTE_CHAT_TEMPLATE)
    records = list(comparison_prompts())[rank::WORLD][:count]
    return [(list(chat.render(r["prompt"], True).encode("utf-8")), r) for r in records]


def held_bytes(model: nn.Module) -> int:
    """The bytes of the params as the model holds them now (a sharded param: its local shard)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def unit_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The bytes of the largest FSDP unit's own params, whole, in ``dtype`` (a unit gathered for its forward)."""
    from lightning_mixedfsdp.apply.gathered import fsdp_modules

    largest = 0
    for unit in fsdp_modules(model):
        inside = {id(p) for other in fsdp_modules(unit) if other is not unit for p in other.parameters()}
        own = sum(p.numel() for p in unit.parameters() if id(p) not in inside)
        largest = max(largest, own * dtype.itemsize)
    return largest


def rl_step(
    fabric: Any, model: Any, optimizer: Any, prompts: List[Any], mode: str, group: int, new: int, step: int
) -> Dict[str, float]:
    import torch.distributed as dist

    from lightning_mixedfsdp.apply.gathered import gathered_params
    from lightning_mixedfsdp.recipes.data.chat import BYTE_END_OF_TURN, cut_at_end_of_turn
    from lightning_mixedfsdp.recipes.rl.losses import LossSettings, grpo_loss
    from lightning_mixedfsdp.recipes.rl.rewards import exact_match
    from lightning_mixedfsdp.recipes.rl.rollouts import Sampling, completion_log_probs, completions_text, sample

    def all_ended(mine: bool) -> bool:
        flag = torch.tensor([0 if mine else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) == 0

    rows = [p for p in prompts for _ in range(group)]
    end = list(BYTE_END_OF_TURN.encode("utf-8"))
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    dist.barrier()
    start = time.perf_counter()
    if mode == "gathered":
        with gathered_params(model, model):
            rollout = sample(model, [ids for ids, _ in rows], Sampling(new), end, 0, generator, None, VOCAB)
    else:
        rollout = sample(model, [ids for ids, _ in rows], Sampling(new), end, 0, generator, all_ended, VOCAB)
    generated = time.perf_counter()
    texts = completions_text(rollout, lambda ids: cut_at_end_of_turn(bytes(ids).decode("utf-8", "replace")))
    rewards = torch.tensor(exact_match([], texts, [record for _, record in rows]))
    scored = time.perf_counter()
    log_probs = completion_log_probs(model, rollout, 1.0, VOCAB)
    settings = LossSettings("grpo", group, 0.2, 0.2, new)
    loss = grpo_loss(log_probs, rollout.generator_log_probs, rollout.completion_mask, rewards, settings).loss
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    trained = time.perf_counter()
    tokens = rollout.completion_mask.sum().reshape(1).float()
    dist.all_reduce(tokens)
    return {
        "generate": generated - start, "score": scored - generated, "train": trained - scored,
        "tokens": float(tokens), "rows": len(rows),
    }  # fmt: skip


def fabric_with_head(head: Sequence[str]) -> Any:
    """A launched Fabric of 2 CPU ranks, bf16-true, with ``fp32_compute_modules=head``."""
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(fp32_compute_modules=list(head))
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision="bf16-true")
    fabric.launch()
    return fabric


def mismatch(trained: Dict[str, torch.Tensor], dim: int, layers: int, rank: int, new: int) -> Dict[str, float]:
    from lightning_mixedfsdp.recipes.rl.rollouts import Sampling, completion_log_probs, log_prob_mismatch, sample

    out = {}
    prompts = [[(7 * p + 3 * rank + i) % VOCAB for i in range(6)] for p in range(8) for _ in range(4)]
    for name, head in (("bf16", []), ("fp32", ["^lm_head$"])):
        fabric = fabric_with_head(head)
        policy = llama(dim, layers)
        policy.load_state_dict(trained)
        model = fabric.setup_module(policy)
        rollout = sample(model, prompts, Sampling(new), [], 0, torch.Generator().manual_seed(11 + rank))
        with torch.no_grad():
            train = completion_log_probs(model, rollout, 1.0)
        out[name] = log_prob_mismatch(train, rollout.generator_log_probs, rollout.completion_mask).item()
    return out


def weight_sync(dim: int, layers: int, bucket_mb: Sequence[float]) -> Dict[float, Dict[str, float]]:
    """``stream_weights`` of the bf16-true policy to rank 0 at each bucket size: seconds (median of 3), bytes sent,
    and this rank's peak host allocation during the stream (an allocator ledger) beside its largest FSDP unit."""
    import torch.distributed as dist

    from lightning_mixedfsdp import stream_weights
    from lightning_mixedfsdp.diagnostics.allocations import AllocationLedger

    fabric = fabric_with_head(["^lm_head$"])
    model = fabric.setup_module(llama(dim, layers))
    out = {}
    for mb in bucket_mb:
        times, sent, peak = [], 0, 0
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            with AllocationLedger() as ledger:
                sent = sum(t.numel() * t.element_size() for b in stream_weights(model, int(mb * 2**20)) for _, t in b)
            times.append(time.perf_counter() - start)
            peak = max(peak, ledger.peak_bytes)
        out[mb] = {"seconds": statistics.median(times), "bytes": float(sent), "peak": float(peak)}
    out_unit = float(unit_bytes(model, torch.bfloat16))
    return {mb: {**figures, "unit": out_unit} for mb, figures in out.items()}


def _rank(rank: int, world: int, settings: Dict[str, Any]) -> Dict[str, Any]:
    from lightning_mixedfsdp.apply.gathered import gathered_params

    dim, layers, steps = settings["dim"], settings["layers"], settings["steps"]
    prompts = prompts_of(rank, settings["prompts"])
    out: Dict[str, Any] = {"times": {}, "bytes": {}}
    for mode in MODES:
        fabric = fabric_with_head(["^lm_head$"])
        model = fabric.setup_module(llama(dim, layers))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        runs = [
            rl_step(fabric, model, optimizer, prompts, mode, settings["group"], settings["new"], step)
            for step in range(steps + 1)
        ][1:]  # the first step warms up
        out["times"][mode] = runs
        sharded = held_bytes(model)
        with gathered_params(model, model):
            gathered = held_bytes(model)
        out["bytes"][mode] = gathered if mode == "gathered" else sharded + unit_bytes(model, torch.bfloat16)
    out["sync"] = weight_sync(dim, layers, settings["bucket_mb"])
    trained = peaked(dim, layers, settings["peaked_steps"])
    out["mismatch"] = mismatch(trained, dim, layers, rank, settings["new"])
    return out


def parser() -> argparse.ArgumentParser:
    arguments = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_argument("--dim", type=int, default=64)
    arguments.add_argument("--layers", type=int, default=4)
    arguments.add_argument("--steps", type=int, default=5, help="timed GRPO steps per mode (after one warm-up)")
    arguments.add_argument("--prompts", type=int, default=8, help="prompts per rank per step")
    arguments.add_argument("--group", type=int, default=8, help="completions per prompt")
    arguments.add_argument("--new", type=int, default=16, help="max new tokens")
    arguments.add_argument("--peaked-steps", type=int, default=100, help="training steps of the mismatch's policy")
    arguments.add_argument("--bucket-mb", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="weight-sync buckets")
    arguments.add_argument("--learning", action="store_true", help="steps to 0.6: the recipe against a plain loop")
    arguments.add_argument("--modes", action="store_true", help="a recipe step's time in each generation mode")
    arguments.add_argument("--mode-steps", type=int, default=8, help="steps of each --modes run")
    learning_parser(arguments)
    return arguments


def report(ranks: Sequence[Dict[str, Any]], settings: Dict[str, Any]) -> Dict[str, Any]:
    medians: Dict[str, Dict[str, float]] = {}
    tokens_per_s: Dict[str, float] = {}
    for mode in MODES:
        steps = range(settings["steps"])
        medians[mode] = {
            phase: statistics.median(max(rank["times"][mode][i][phase] for rank in ranks) for i in steps)
            for phase in PHASES
        }
        generate = [max(rank["times"][mode][i]["generate"] for rank in ranks) for i in range(settings["steps"])]
        tokens = [ranks[0]["times"][mode][i]["tokens"] for i in range(settings["steps"])]
        tokens_per_s[mode] = statistics.median(t / g for t, g in zip(tokens, generate, strict=True))
    bytes_held = {mode: max(rank["bytes"][mode] for rank in ranks) for mode in MODES}
    mismatches = {name: statistics.mean(rank["mismatch"][name] for rank in ranks) for name in ("bf16", "fp32")}
    print(
        f"GRPO step, 2 ranks (gloo), bf16-true, Llama {settings['dim']} wide x {settings['layers']} layers, head in"
        f" fp32; {settings['prompts']} prompts x {settings['group']} completions per rank, up to {settings['new']}"
        f" new tokens; medians of {settings['steps']} steps (the slower rank's)"
    )
    print("| generation | generate s | score s | train s | step s | rollout tokens/s | params held while decoding |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        m = medians[mode]
        print(
            f"| {mode} | {m['generate']:.3f} | {m['score']:.4f} | {m['train']:.3f} | {sum(m.values()):.3f} |"
            f" {tokens_per_s[mode]:.0f} | {bytes_held[mode] / 1024:.0f} KiB |"
        )
    ratio = tokens_per_s["gathered"] / tokens_per_s["sharded"]
    held = bytes_held["gathered"] / bytes_held["sharded"]
    print(f"gathered decodes {ratio:.2f}x the tokens/s of sharded, holding {held:.2f}x the params")
    print(
        f"log-prob mismatch (peaked policy, {settings['peaked_steps']} training steps): head bf16"
        f" {mismatches['bf16']:.2e}, head fp32 {mismatches['fp32']:.2e}"
        + (f" ({mismatches['fp32'] / mismatches['bf16']:.2f}x)" if mismatches["bf16"] else "")
    )
    print_sync(ranks, settings["bucket_mb"])
    sync = {mb: [rank["sync"][mb] for rank in ranks] for mb in settings["bucket_mb"]}
    return {"phases": medians, "tokens_per_s": tokens_per_s, "bytes": bytes_held, "mismatch": mismatches, "sync": sync}


def print_sync(ranks: Sequence[Dict[str, Any]], bucket_mb: Sequence[float]) -> None:
    print("weight sync to rank 0 (stream_weights, bf16 as stored; median of 3; the slower rank's time)")
    print("| bucket | seconds | MB/s | peak allocated, rank 0 (receives) | rank 1 | largest unit (bf16) |")
    print("|---|---|---|---|---|---|")
    for mb in bucket_mb:
        figures = [rank["sync"][mb] for rank in ranks]
        seconds, sent = max(f["seconds"] for f in figures), figures[0]["bytes"]
        print(
            f"| {mb:g} MiB | {seconds:.4f} | {sent / seconds / 1e6:.0f} | {figures[0]['peak'] / 1024:.0f} KiB |"
            f" {figures[1]['peak'] / 1024:.0f} KiB | {figures[0]['unit'] / 1024:.0f} KiB |"
        )


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parser().parse_args(argv)
    if args.learning:
        return learning(args)
    if args.modes:
        return generation_modes(args.warm_start, args.mode_steps, Path(args.out), args.overrides)
    settings = {
        "dim": args.dim, "layers": args.layers, "steps": args.steps, "prompts": args.prompts, "group": args.group,
        "new": args.new, "peaked_steps": args.peaked_steps, "bucket_mb": args.bucket_mb,
    }  # fmt: skip
    ranks = run_distributed(_rank, WORLD, settings, timeout=1800)
    return report(ranks, settings)


if __name__ == "__main__":
    main()
