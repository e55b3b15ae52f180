"""Fault-tolerant replica groups (torchft) against plain HSDP, on the same 4 CPU ranks: two groups of 2 ranks each
with ``fault_tolerance`` (every gradient averaged across the groups through torchft's Manager, a quorum and a commit
vote per step) against one launch of ``data_parallel_replicate_size=2`` x shard 2, interleaved launch by launch;
then one fault-tolerant run where group 1 is SIGKILLed and restarted: the seconds from the kill to the survivor's
next committed step, and what the heal moved (bytes per rank) and took.

    python -m benchmarks.fault_tolerance [--hidden 256 --layers 4 --seq 128 --steps 30 --pairs 3]

The model is an HF Llama from a small config, bf16-true with fp32 norms, AdamW; the per-rank batch is 2 sequences.
The lighthouse is the tests' (a group silent for 1 s is dead, a new quorum waits 1 s for joiners); torchft's own
default heartbeat timeout is 5 s.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from lightning_mixedfsdp.fault_tolerance.hooks import ReplicaGroups
from lightning_mixedfsdp.testing.replica_groups import (
    Group,
    build_fabric,
    read_step,
    records,
    start_lighthouse,
    stderr_tails,
    wait_until,
)

WORKER = "benchmarks.fault_tolerance"


def worker(argv: List[str]) -> None:
    """One rank: a plain HSDP launch (no ``--replica-id``) runs ``--steps`` steps; a fault-tolerant one runs until
    torchft's step reaches the number in ``folder/stop``. One JSON line per step: wall seconds, torchft step, vote."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--replica-id", type=int, default=None)
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 4
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=args.hidden // heads,
        vocab_size=512,
    )
    fabric, model, optimizer = build_fabric(
        args.replica_id, args.lighthouse, lambda: LlamaForCausalLM(config), args.world, args.replicate
    )
    strategy = fabric.strategy
    session = strategy.fault_tolerance.session if isinstance(strategy.fault_tolerance, ReplicaGroups) else None
    log = (args.folder / f"g{args.replica_id}_r{fabric.global_rank}.jsonl").open("a")
    iteration = 0
    while True:
        step = session.manager.current_step() if session is not None else iteration
        stop = read_step(args.folder / "stop") if session is not None else args.steps
        if stop is not None and step >= stop:
            break
        sampler = strategy.distributed_sampler_kwargs
        generator = torch.Generator().manual_seed(1000 * iteration + sampler["rank"])
        tokens = torch.randint(0, 512, (2, args.seq), generator=generator)
        started = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - started
        record: Dict[str, Any] = {"event": "step", "seconds": seconds, "time": time.time(), "pid": os.getpid()}
        if session is not None:
            heal = session.last_heal
            record.update(
                step=session.manager.current_step(),
                committed=session.last_decision,
                participants=session.manager.num_participants(),
                heal=None if heal is None else {"step": heal.step, "bytes": heal.bytes, "seconds": heal.seconds},
            )
        log.write(json.dumps(record) + "\n")
        log.flush()
        iteration += 1


def sizes_of(args: argparse.Namespace) -> List[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq)]


def median_step(folder: Path, group: Optional[int], warmup: int) -> float:
    seen = records(folder, group, 0)
    times = [r["seconds"] for r in seen if r["event"] == "step"][warmup:]  # type: ignore[arg-type]
    if not times:  # a group that joined late healed past the steps: say so instead of an empty median
        events = [r["event"] for r in seen]
        raise RuntimeError(f"no committed step after the {warmup} warm-up steps to time; the launch recorded {events}")
    return statistics.median(times)


def hsdp_launch(args: argparse.Namespace, folder: Path) -> float:
    launch = Group(None, None, folder, world=4, module=WORKER, extra=["--world", "4", "--replicate", "2"]
                   + ["--steps", str(args.steps), *sizes_of(args)])  # fmt: skip
    assert launch.wait(600) == [0] * 4, stderr_tails(folder)
    return median_step(folder, None, args.warmup)


def ft_launch(args: argparse.Namespace, folder: Path, url: str) -> float:
    (folder / "stop").write_text(str(args.steps))
    groups = [Group(g, url, folder, module=WORKER, extra=sizes_of(args)) for g in (0, 1)]
    for group in groups:
        assert group.wait(600) == [0, 0], stderr_tails(folder)
    return median_step(folder, 0, args.warmup)


def failure_run(args: argparse.Namespace, folder: Path, url: str) -> Dict[str, Any]:
    """Group 1 SIGKILLed after ``warmup`` steps together; restarted once group 0 committed 3 steps alone."""
    (folder / "stop").write_text("1000000")
    survivor = Group(0, url, folder, module=WORKER, extra=sizes_of(args))
    victim = Group(1, url, folder, module=WORKER, extra=sizes_of(args))
    groups = [survivor, victim]

    def steps_of(group: int, pid: Optional[int] = None) -> List[Dict[str, Any]]:
        return [r for r in records(folder, group, 0) if r["event"] == "step" and (pid is None or r["pid"] == pid)]

    try:
        wait_until(lambda: len(steps_of(1)) >= args.warmup, "both groups training", 300, groups, folder)
        victim.kill()
        killed_at = time.time()
        groups = [survivor]
        wait_until(
            lambda: sum(1 for r in steps_of(0) if r["time"] > killed_at and r["committed"]) >= 3,
            "the survivor alone",
            300,
            groups,
            folder,
        )
        restarted = Group(1, url, folder, module=WORKER, extra=sizes_of(args))
        groups = [survivor, restarted]
        pid = restarted.processes[0].pid
        wait_until(lambda: len(steps_of(1, pid)) >= 2, "the heal", 300, groups, folder)
        (folder / "stop").write_text(str(max(r["step"] for r in steps_of(0)) + 2))
        for group in groups:
            assert group.wait(300) == [0, 0], stderr_tails(folder)
    except BaseException:
        for group in groups:
            group.kill()
        raise
    after = [r for r in steps_of(0) if r["time"] > killed_at]
    next_commit = next(r for r in after if r["committed"])
    before = [r["seconds"] for r in steps_of(0) if r["time"] <= killed_at]
    heal = steps_of(1, pid)[0]["heal"]
    return {
        "kill_to_next_commit_s": next_commit["time"] - killed_at,
        "discarded_steps": sum(1 for r in after if r["committed"] is False and r["time"] <= next_commit["time"]),
        "step_s_before_kill": statistics.median(before),
        "heal_bytes": heal["bytes"],
        "heal_s": heal["seconds"],
        "healed_to_step": heal["step"],
    }


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_tolerance", description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (HSDP, fault-tolerant) launch pairs")
    parser.add_argument("--no-kill", action="store_true", help="time the launch pairs only (no kill and heal run)")
    args = parser.parse_args(argv)
    # the timed launches: every quorum waits for both groups, so each timed step is a 2-group step whichever group
    # started first; the kill and heal: a quorum of one lets the survivor train on alone
    both, alone = start_lighthouse(min_replicas=2), start_lighthouse()
    results: Dict[str, Any] = {"pairs": []}
    try:
        with tempfile.TemporaryDirectory() as root:
            for index in range(args.pairs):
                hsdp_folder, ft_folder = Path(root, f"hsdp{index}"), Path(root, f"ft{index}")
                hsdp_folder.mkdir()
                ft_folder.mkdir()
                hsdp = hsdp_launch(args, hsdp_folder)
                fault_tolerant = ft_launch(args, ft_folder, both.address())
                results["pairs"].append({"hsdp_s": hsdp, "ft_s": fault_tolerant, "ratio": fault_tolerant / hsdp})
            if not args.no_kill:
                failure_folder = Path(root, "failure")
                failure_folder.mkdir()
                results["failure"] = failure_run(args, failure_folder, alone.address())
    finally:
        both.shutdown()
        alone.shutdown()
    ratios = [p["ratio"] for p in results["pairs"]]
    results["median_ratio"] = statistics.median(ratios)
    print_table(args, results)
    return results


def print_table(args: argparse.Namespace, results: Dict[str, Any]) -> None:
    print(f"HF Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, 2 sequences per rank, bf16-true,")
    print(f"4 CPU ranks; median step of rank 0 over steps {args.warmup + 1}-{args.steps}, interleaved launches\n")
    print("| launch pair | plain HSDP 2x2 (s/step) | fault-tolerant 2 groups x 2 (s/step) | ratio |")
    print("|---|---|---|---|")
    for index, pair in enumerate(results["pairs"]):
        print(f"| {index + 1} | {pair['hsdp_s']:.3f} | {pair['ft_s']:.3f} | {pair['ratio']:.3f}x |")
    print(f"\nmedian ratio: {results['median_ratio']:.3f}x\n")
    failure = results.get("failure")
    if failure is None:
        return
    print("| kill group 1 (SIGKILL) | |")
    print("|---|---|")
    print(f"| survivor's step before the kill (median) | {failure['step_s_before_kill']:.3f} s |")
    print(f"| kill to the survivor's next committed step | {failure['kill_to_next_commit_s']:.2f} s |")
    print(f"| steps discarded on the survivor | {failure['discarded_steps']} |")
    print(f"| heal: bytes to each restarted rank | {failure['heal_bytes']:,} |")
    print(f"| heal: seconds (quorum + transfer + load) | {failure['heal_s']:.2f} s |")
    print(f"| healed to step | {failure['healed_to_step']} |")


if __name__ == "__main__":
    if "--folder" in sys.argv:
        worker(sys.argv[1:])
    else:
        main()
