"""Pipeline parallelism on 2 CPU ranks: each schedule's bubble against its formula, activation memory per stage
(1F1B against GPipe), and the step against FSDP alone at the same world size; the bubble at 4 ranks computed from
the schedules' action orders and the measured time of each action.

An HF Llama from config (``--hidden``, ``--layers``), 32-true, one stage per rank (two under Interleaved1F1B), a batch
of ``--batch`` sequences of ``--seq`` tokens split into m = 4, 8, 16 micro-batches. Per rank and step:
- busy: the seconds its stages spend in forward and backward actions (torch's ``PipelineStage.forward_one_chunk`` and
  ``backward_one_chunk``, timed); the bubble is ``1 - busy / step``, the mean of the ranks';
- the formula: GPipe and 1F1B ``(p - 1) / (m + p - 1)``, Interleaved1F1B ``(p - 1) / (v m + p - 1)``;
- activations: the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``) that are alive at once,
  micro-batch by micro-batch, on the first stage.
At 4 ranks the two cores cannot run four stages at once, so the bubble is computed: each rank's actions in the
schedule's order (GPipe: every forward then every backward; 1F1B: ``p - 1 - rank`` warm-up forwards, then one
forward one backward), each starting when its rank is free and its input has arrived (the previous stage's forward,
the next stage's backward), with the forward and backward seconds of one block measured here.

    python -m benchmarks.pipeline [--steps 4] [--microbatches 4 8 16]
"""

import argparse
import statistics
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from lightning_mixedfsdp.testing import run_distributed

SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}


def formula(schedule: str, p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1) if schedule == "Interleaved1F1B" else (p - 1) / (m + p - 1)


def _model(hidden: int, layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class _Timer:
    """Seconds in forward and backward actions, and the saved-for-backward bytes alive at once (first stage)."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.alive = self.peak = 0
        self.saved: Dict[int, int] = {}
        self.current = 0

    @contextmanager
    def installed(self) -> Iterator[None]:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        forward, backward = _PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk
        timer = self

        def timed_forward(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            timer.current = chunk
            started = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(timer._pack, lambda t: t):
                out = forward(stage, chunk, *args, **kwargs)
            timer.busy += time.perf_counter() - started
            return out

        def timed_backward(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = backward(stage, chunk, *args, **kwargs)
            timer.busy += time.perf_counter() - started
            timer.alive -= timer.saved.pop(chunk, 0)
            return out

        _PipelineStageBase.forward_one_chunk = timed_forward  # type: ignore[method-assign]
        _PipelineStageBase.backward_one_chunk = timed_backward  # type: ignore[method-assign]
        try:
            yield
        finally:
            _PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk = forward, backward

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.saved[self.current] = self.saved.get(self.current, 0) + size
        self.alive += size
        self.peak = max(self.peak, self.alive)
        return tensor


def _measure(rank: int, world: int, args: Dict[str, Any]) -> Dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 512, (args["batch"], args["seq"]), generator=generator)
    out: Dict[str, Any] = {}
    for schedule, per_rank in SCHEDULES.items():
        for micro in args["microbatches"]:
            strategy = MixedFSDP2Strategy(
                pipeline_parallel_size=world, pipeline_schedule=schedule, pipeline_stages_per_rank=per_rank,
                pipeline_microbatches=micro,
            )  # fmt: skip
            fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
            fabric.launch()
            model = fabric.setup(_model(args["hidden"], args["layers"]))
            timer, steps, busy, peaks = _Timer(), [], [], []
            with timer.installed():
                for step in range(args["steps"] + 1):
                    timer.busy, timer.peak, timer.alive, timer.saved = 0.0, 0, 0, {}
                    torch.distributed.barrier()
                    started = time.perf_counter()
                    fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=_loss)
                    torch.distributed.barrier()
                    if step:  # the first builds the schedule and its buffers
                        steps.append(time.perf_counter() - started)
                        busy.append(timer.busy)
                        peaks.append(timer.peak)
            for p in model.parameters():
                p.grad = None
            out[(schedule, micro)] = {
                "step": statistics.median(steps),
                "busy": statistics.median(busy),
                "peak": max(peaks),
            }
    fsdp = Fabric(accelerator="cpu", devices=world, strategy=MixedFSDP2Strategy(), precision="32-true")
    fsdp.launch()
    model = fsdp.setup(_model(args["hidden"], args["layers"]))
    part = batch.chunk(world)[rank]
    times = []
    for step in range(args["steps"] + 1):
        torch.distributed.barrier()
        started = time.perf_counter()
        fsdp.backward(_loss(model(part), part))
        torch.distributed.barrier()
        if step:
            times.append(time.perf_counter() - started)
    out["fsdp"] = statistics.median(times)
    return out


def _resharding(rank: int, world: int, args: Dict[str, Any]) -> Dict[str, Any]:
    """PP 2 x FSDP 2: all-gathers and their bytes per step, and the step, with and without resharding after each
    micro-batch's forward."""
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.diagnostics.collectives import count_collectives
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    torch.set_num_threads(1)
    batch = torch.randint(0, 512, (args["batch"] // 2, args["seq"]), generator=torch.Generator().manual_seed(1))
    out = {}
    for reshard in (True, False):
        strategy = MixedFSDP2Strategy(pipeline_parallel_size=2, pipeline_microbatches=4, reshard_after_forward=reshard)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
        fabric.launch()
        model = fabric.setup(_model(args["hidden"], args["layers"]))
        fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=_loss)  # builds the schedule
        with count_collectives() as counts:
            started = time.perf_counter()
            fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=_loss)
            seconds = time.perf_counter() - started
        out[reshard] = {
            "all_gathers": counts.by_kind().get("all_gather", 0),
            "bytes": counts.bytes_by_kind().get("all_gather", 0),
            "step": seconds,
        }
    return out


def simulated_bubble(schedule: str, p: int, m: int, forward: float, backward: float) -> float:
    """The bubble of one stage per rank on ``p`` ranks: the actions in the schedule's order, each starting once its
    rank is free and its input is there; ``1 - busy / makespan`` (communication taken as free)."""
    done: Dict[Tuple[str, int, int], float] = {}
    orders = {rank: _order(schedule, rank, p, m) for rank in range(p)}
    free = [0.0] * p
    position = [0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            if position[rank] >= len(orders[rank]):
                continue
            kind, micro = orders[rank][position[rank]]
            needs = ("F", rank - 1, micro) if kind == "F" else ("B", rank + 1, micro)
            if kind == "F" and rank == 0 or kind == "B" and rank == p - 1:
                ready = done[("F", rank, micro)] if kind == "B" else 0.0
            elif needs in done:
                ready = max(done[needs], done.get(("F", rank, micro), 0.0))
            else:
                continue
            start = max(free[rank], ready)
            free[rank] = done[(kind, rank, micro)] = start + (forward if kind == "F" else backward)
            position[rank] += 1
            progressed = True
        assert progressed, "the schedule's order deadlocks"
    makespan = max(free)
    return 1 - m * (forward + backward) / makespan


def _order(schedule: str, rank: int, p: int, m: int) -> List[Tuple[str, int]]:
    if schedule == "GPipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, p - 1 - rank)
    order = [("F", i) for i in range(warmup)]
    forwards, backwards = warmup, 0
    while backwards < m:
        if forwards < m:
            order.append(("F", forwards))
            forwards += 1
        order.append(("B", backwards))
        backwards += 1
    return order


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    args = vars(parser.parse_args(argv))
    results = run_distributed(_measure, 2, args, timeout=3600)
    print(
        f"Llama hidden {args['hidden']}, {args['layers']} layers, batch {args['batch']} x {args['seq']} tokens, 32-true"
    )
    print("\n2 ranks, measured (median of steps; bubble = 1 - busy / step, mean of the ranks):")
    print(f"{'schedule':<16}{'m':>4}{'step s':>9}{'bubble':>9}{'formula':>9}{'saved MiB (stage 0)':>22}")
    table: Dict[str, Any] = {}
    for schedule, per_rank in SCHEDULES.items():
        for micro in args["microbatches"]:
            ranks = [r[(schedule, micro)] for r in results]
            step = max(r["step"] for r in ranks)
            bubble = statistics.mean(1 - r["busy"] / r["step"] for r in ranks)
            expected = formula(schedule, 2, micro, per_rank)
            table[f"{schedule} m={micro}"] = {"step": step, "bubble": bubble, "formula": expected}
            print(
                f"{schedule:<16}{micro:>4}{step:>9.3f}{bubble:>9.1%}{expected:>9.1%}{ranks[0]['peak'] / 2**20:>22.1f}"
            )
    fsdp = max(r["fsdp"] for r in results)
    best = min(table.values(), key=lambda row: row["step"])
    print(f"\nFSDP alone on the same 2 ranks: {fsdp:.3f} s a step; the fastest pipeline {best['step']:.3f} s")
    one = min(r[("1F1B", args["microbatches"][0])]["busy"] for r in results) / args["microbatches"][0] / 3
    print("\n4 ranks, computed from each schedule's action order (a stage's forward of a micro-batch", end="")
    print(f" {one:.4f} s, backward {2 * one:.4f} s):")
    for schedule in ("GPipe", "1F1B"):
        for micro in args["microbatches"]:
            computed = simulated_bubble(schedule, 4, micro, one, 2 * one)
            print(f"{schedule:<16}{micro:>4}   bubble {computed:6.1%}   formula {formula(schedule, 4, micro, 1):6.1%}")
    resharding = run_distributed(_resharding, 4, args, timeout=3600)
    print("\nPP 2 x FSDP 2 on 4 ranks, 1F1B, m = 4, per step on stage 0's rank 0:")
    for reshard in (True, False):
        row = resharding[0][reshard]
        print(
            f"  reshard_after_forward={reshard!s:<5}: {row['all_gathers']} all-gathers,"
            f" {row['bytes'] / 2**20:.1f} MiB gathered, step {row['step']:.3f} s (4 ranks on 2 cores)"
        )
    return {"table": table, "fsdp": fsdp, "resharding": resharding[0]}


if __name__ == "__main__":
    main()
