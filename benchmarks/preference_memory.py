"""Preference tuning's references side by side (``recipes/objectives/preference.py``): what each costs a rank in bytes,
by device, and in step time, on one HF Llama, one launch of 2 ranks (gloo, bf16-true), the set-ups taking steps in
turn (the order reversed every other round).

- ``copy, bf16`` / ``copy, nf4`` / ``copy, offloaded``: the whole policy trains beside a frozen copy of it, set up on
  its own by ``MixedFSDP2Strategy`` as the Trainer strategy shards the recipe's ``reference`` child: sharded at its
  storage dtype, its Linear weights in 4 bits (``quantize_base="nf4"``), or its shards on the host between forwards
  (``offload_frozen="cpu"``: on a CPU machine host and device are one, so read the ``where`` column, not a saving);
- ``precomputed``: the same policy, the reference's scores looked up (``[pairs, 2]`` fp32 for the whole data set);
- ``LoRA, adapters_off``: a LoRA policy (r=16 on every projection) whose reference is its own base with the adapters
  disabled; ``LoRA, precomputed``: the same LoRA policy, scores looked up: the two differ only in the reference's
  forward.

Bytes are counted tensor by tensor (a 4-bit weight by its parts) with each tensor's device, after the timed steps:
the reference's stored tensors (the precomputed scores for ``precomputed``) and the policy's trained state (the
trainable params, their grads' shards and AdamW's states). A step: the reference's scores of ``--pairs`` pairs
(chosen and rejected rows of ``--seq`` tokens), the policy's forward on the same rows, DPO's loss, backward, AdamW;
medians of the slower rank's steps.

    python -m benchmarks.preference_memory          # 2 CPU ranks, about 3 minutes

Figures, never asserted: ``tests/test_benchmarks.py`` runs it at tiny sizes for its structure.
"""

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn

from benchmarks.distill_memory import _add, _by_device, _where
from benchmarks.qlora_memory import TARGETS, stored_bytes
from lightning_mixedfsdp.testing import run_distributed

SIZES: Dict[str, Dict[str, int]] = {
    "default": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4),
}
VOCAB = {"default": 16000, "tiny": 512}
COPIES: Dict[str, Dict[str, Any]] = {
    "copy, bf16": {},
    "copy, nf4": {"quantize_base": "nf4"},
    "copy, offloaded": {"offload_frozen": "cpu"},
}
SETUPS = [*COPIES, "precomputed", "LoRA, adapters_off", "LoRA, precomputed"]
DATA_PAIRS = 10_000
"""The data set's pairs a precomputed reference stores scores for (its bytes grow with the data, not the model)."""
MiB = 2**20


def llama(size: str) -> Any:
    from transformers import LlamaConfig

    fields: Dict[str, Any] = dict(SIZES[size])
    heads = fields["num_attention_heads"]
    return LlamaConfig(vocab_size=VOCAB[size], num_key_value_heads=heads, max_position_embeddings=2048, **fields)


def _trained_state(model: nn.Module, optimizer: Any) -> Dict[str, int]:
    """The rank's trainable params, grads and optimizer states, by device."""
    tensors: List[Tuple[Tensor, int]] = []
    for param in model.parameters():
        if param.requires_grad:
            tensors.append((param, stored_bytes(param)))
            if param.grad is not None:
                tensors.append((param.grad, stored_bytes(param.grad)))
    for state in optimizer.state.values():
        tensors += [(t, stored_bytes(t)) for t in state.values() if isinstance(t, Tensor) and t.dim() > 0]
    return _by_device(tensors)


def _launch(rank: int, world: int, size: str, seq: int, pairs: int, steps: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.objectives.precomputed_reference import looked_up
    from lightning_mixedfsdp.recipes.objectives.preference import answer_log_probs, preference_scores

    config = llama(size)

    def fabric_with(**options: Any) -> Fabric:
        fabric = Fabric(accelerator="cpu", devices=world, strategy=MixedFSDP2Strategy(**options), precision="bf16-true")
        fabric.launch()
        return fabric

    def built(fabric: Fabric, frozen: bool = False, lora: bool = False) -> nn.Module:
        torch.manual_seed(0)
        with fabric.init_module(empty_init=True):
            model: Any = LlamaForCausalLM(config)
        if lora:
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
        return fabric.setup_module(model.requires_grad_(False) if frozen else model).module

    fabric = fabric_with()
    references = {name: built(fabric_with(**options), frozen=True) for name, options in COPIES.items()}
    policies = {"full": built(fabric), "LoRA": built(fabric, lora=True)}
    optimizers = {
        name: fabric.setup_optimizers(torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5))
        for name, m in policies.items()
    }
    scores = torch.randn(DATA_PAIRS, 2) * 10 - 50  # what a precomputed reference stores: [pairs, 2] fp32
    generator = torch.Generator().manual_seed(rank)

    def batch() -> Dict[str, Tensor]:
        ids = torch.randint(0, config.vocab_size, (pairs, 2, seq), generator=generator)
        labels = ids.clone()
        labels[..., : seq // 2] = -100  # the prompt untrained
        index = torch.randint(0, DATA_PAIRS, (pairs,), generator=generator)
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).expand_as(ids), "index": index}

    def reference_of(setup: str, policy: nn.Module) -> Callable[[Dict[str, Tensor], Tensor, Tensor, Tensor], Tensor]:
        def score(rows: Dict[str, Tensor], ids: Tensor, labels: Tensor, positions: Tensor) -> Tensor:
            with torch.no_grad():
                if setup in COPIES:
                    return answer_log_probs(references[setup], ids, labels, positions)[0]
                if setup == "LoRA, adapters_off":
                    with policy.disable_adapter():  # type: ignore[operator]
                        return answer_log_probs(policy, ids, labels, positions)[0]
                return looked_up(scores, rows["index"])

        return score

    def step(setup: str) -> float:
        from lightning_mixedfsdp.recipes.data.preference import pair_batch

        kind = "LoRA" if setup.startswith("LoRA") else "full"
        policy, optimizer = policies[kind], optimizers[kind]
        rows = batch()
        ids, labels, positions = pair_batch(rows)
        dist.barrier()
        started = time.perf_counter()
        reference = reference_of(setup, policy)(rows, ids, labels, positions)
        policy_scores, tokens = answer_log_probs(policy, ids, labels, positions)
        half = len(ids) // 2
        loss = preference_scores(
            (policy_scores[:half], policy_scores[half:]),
            (reference[:half], reference[half:]),
            (tokens[:half], tokens[half:]),
            "sigmoid",
            0.1,
            0.0,
        ).loss.mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the grads' bytes stay counted
        seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's
        return seconds.item()

    for setup in ("precomputed", "LoRA, precomputed"):  # warm-up: AdamW's states exist before the timed steps
        step(setup)
    times: Dict[str, List[float]] = {setup: [] for setup in SETUPS}
    for index in range(steps):
        for setup in SETUPS if index % 2 == 0 else SETUPS[::-1]:
            times[setup].append(step(setup))
    out: Dict[str, Dict[str, Any]] = {}
    for setup in SETUPS:
        if setup in COPIES:
            reference = references[setup]
            held = _by_device((t, stored_bytes(t)) for t in [*reference.parameters(), *reference.buffers()])
        elif setup.endswith("precomputed"):
            held = _by_device([(scores, scores.numel() * scores.element_size())])
        else:
            held = {}
        kind = "LoRA" if setup.startswith("LoRA") else "full"
        out[setup] = {"reference": held, "policy": _trained_state(policies[kind], optimizers[kind])}
    return {"bytes": out, "times": times}


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="default")
    parser.add_argument("--seq", type=int, default=64, help="tokens per answer row")
    parser.add_argument("--pairs", type=int, default=2, help="pairs per rank in a step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each set-up")
    args = parser.parse_args(argv)
    world = 2
    launch = run_distributed(_launch, world, args.size, args.seq, args.pairs, args.steps, timeout=3600)
    config = llama(args.size)
    print(
        f"HF Llama policy (hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}),"
        f" bf16-true, {world} ranks (gloo, CPU), {args.pairs} pairs of {args.seq}-token rows per rank a step\n"
    )
    busiest = {s: max((r["bytes"][s] for r in launch), key=lambda b: sum(b["reference"].values())) for s in SETUPS}
    times = {setup: statistics.median(values) for setup, values in launch[0]["times"].items()}
    columns = ["its bytes per rank", "where", "policy's trained state per rank", "step median s", "vs copy, bf16"]
    print(f"| reference | {' | '.join(columns)} |")
    print("|---|---|---|---|---|---|")
    for setup in SETUPS:
        row = busiest[setup]
        held, state = sum(row["reference"].values()), sum(row["policy"].values())
        where = _where(_add(row["reference"], {})) if held else "-"
        print(
            f"| {setup} | {held / MiB:.2f} MiB | {where} | {state / MiB:.1f} MiB | {times[setup]:.3f} |"
            f" {times[setup] / times['copy, bf16']:.2f}x |"
        )
    print(f"\nprecomputed: the scores of {DATA_PAIRS} pairs (every pair of the data set, on every rank)")
    return {"bytes": busiest, "step_s": times}


if __name__ == "__main__":
    main()
