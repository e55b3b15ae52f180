"""The dry-run planner: the dtype plan, collectives and per-rank memory of a model at a given scale, before renting
the GPUs. The model is built on the meta device from its HF config: nothing is allocated, 70B-120B configs plan in
well under a second (0.12 s for Llama-3-70B; the command takes a few seconds more to import torch and transformers).
--hf-config takes a config.json or a model directory holding one; the examples run from the project's root:

    python -m lightning_mixedfsdp.plan --hf-config benchmarks/configs/llama3_8b.json --world-size 64 --gpu-memory 80
    python -m lightning_mixedfsdp.plan --hf-config benchmarks/configs/llama3_70b.json --world-size 512 \
        --replicate 64 --precision bf16-mixed
    python -m lightning_mixedfsdp.plan --recipe conf/hf_qwen3_next_tiny.yaml --world-size 8
    python -m lightning_mixedfsdp.plan --hf-config benchmarks/configs/gpt_oss_120b.json --world-size 64 \
        --expert-parallel 8
    python -m lightning_mixedfsdp.plan --hf-config benchmarks/configs/llama3_70b.json --world-size 8 --gpu-memory 24 \
        --lora-rank 16 --quantize-base nf4 --offload cpu
    python -m lightning_mixedfsdp.plan --hf-config benchmarks/configs/llama3_405b.json --world-size 512 \
        --tensor-parallel 8 --pipeline 8 --seq-len 8192 --batch 8
"""

import argparse
import math
import sys
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from lightning_mixedfsdp.apply.conditional import conditional_problems
from lightning_mixedfsdp.apply.context_parallel import context_parallel_problems
from lightning_mixedfsdp.apply.tensor_parallel import (
    describe_split,
    keep_tensor_parallel_share,
    tensor_parallel_problems,
)
from lightning_mixedfsdp.compat.extras import MissingPackage
from lightning_mixedfsdp.config import MixedFSDPConfig, Parallelism, precision_problem
from lightning_mixedfsdp.mesh import ParallelDims
from lightning_mixedfsdp.planning.memory import (
    ActivationShape,
    MemoryEstimate,
    activation_bytes,
    estimate_io,
    estimate_memory,
    longest_sequence,
)
from lightning_mixedfsdp.planning.planner import plan_sharding
from lightning_mixedfsdp.planning.report import (
    conditional_lines,
    expert_lines,
    format_bytes,
    format_count,
    format_plan,
)
from lightning_mixedfsdp.planning.stages import plan_stages, stage_of_params
from lightning_mixedfsdp.planning.types import ShardPlan
from lightning_mixedfsdp.recipes.models.hf import build_hf_model
from lightning_mixedfsdp.recipes.run.loader import in_recipe_keys, load_recipe
from lightning_mixedfsdp.recipes.run.stage_plans import stage_lines
from lightning_mixedfsdp.recipes.settings.inputs import load_hf_config
from lightning_mixedfsdp.recipes.settings.schema import recipe_storage


def build_on_meta(
    config: Any,
    freeze: Optional[List[str]] = None,
    lora_rank: Optional[int] = None,
    targets: Optional[List[str]] = None,
) -> nn.Module:
    """The model of ``config`` on meta (a causal LM, or an image-text model with its tower frozen unless ``freeze``
    says otherwise), with peft LoRA adapters of ``lora_rank`` on ``targets`` (default: every Linear but the head)."""
    lora = None
    if lora_rank is not None:
        lora = dict(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets or "all-linear")
    return build_hf_model(config, lora, freeze, lora_key="--lora-rank")


def dry_run(
    model: nn.Module, config: MixedFSDPConfig, precision: str, world_size: int, replicate: int
) -> Tuple[ShardPlan, MemoryEstimate]:
    shard = world_size // replicate
    plan = plan_sharding(model, config, precision, shard_ranks=shard)
    return plan, estimate_memory(plan, shard_ranks=shard, data_parallel_ranks=world_size)


def format_summary(
    plan: ShardPlan,
    estimate: MemoryEstimate,
    world_size: int,
    replicate: int,
    gpu_memory_gb: Optional[float],
    parallelism: Optional[Parallelism] = None,
) -> str:
    hsdp = replicate > 1
    collectives = plan.predicted_collectives(hsdp=hsdp)
    shard = world_size // replicate
    cp = plan.context_parallel
    split = f" ({shard // cp} data-parallel x {cp} context-parallel)" if cp > 1 else ""
    lines = [
        f"world size {world_size}: {'HSDP ' + str(replicate) + ' x ' if hsdp else 'FSDP over '}{shard} shard"
        f" ranks{split}",
        "collectives per step: " + ", ".join(f"{k} {v}" for k, v in collectives.items()),
    ]
    if plan.experts is not None:
        lines += expert_lines(plan, expert_shard_ranks=shard // plan.experts.size)
    lines += conditional_lines(plan, shard_ranks=shard)
    if replicate > 1:
        lines += replicate_sync_lines(plan, replicate, shard, parallelism or Parallelism())
    lines += ["training state per rank (activations not included):"]
    lines += [f"  {name:<13}{format_bytes(value)}" for name, value in estimate.rows().items()]
    lines.append(f"  of which replicated params add {format_bytes(estimate.replicated)} over full sharding")
    lines += [
        f"  host memory  {format_bytes(estimate.host)}" + (" (offloaded)" if plan.offload else ""),
        f"  GPU memory   {format_bytes(estimate.device)} (training state on the device, and"
        f" {format_bytes(estimate.gathered)} of units all-gathered at once)",
    ]
    if gpu_memory_gb is not None:
        left = gpu_memory_gb * 2**30 - estimate.device
        verdict = (
            f"fits, {format_bytes(left)} left for activations"
            if left >= 0
            else f"does not fit: short by {format_bytes(-left)}"
        )
        lines.append(f"  on a {gpu_memory_gb:g} GiB GPU: {verdict}")
    io = estimate_io(plan, shard_ranks=shard)
    lines += [
        "loading an HF folder (load_full_weights, every rank reads its own shards):",
        f"  read per rank {format_bytes(io.load_read_per_rank)}, host memory beyond the shards"
        f" {format_bytes(io.load_host_peak)} (the largest slice)",
        "exporting (export_safetensors, streamed tensor by tensor, in the compute dtype with the fp32 set):",
        f"  rank 0 writes {format_bytes(io.export_written)}, holding at most {format_bytes(io.export_host_peak)}"
        " (the largest tensor); the other ranks write nothing",
    ]
    return "\n".join(lines)


def replicate_sync_lines(plan: ShardPlan, replicate: int, shard: int, parallelism: Parallelism) -> List[str]:
    """Bytes each rank exchanges across the replicate dim per optimizer step, every-step sync against the chosen
    semi-synchronous one (``replicate_sync``), and the outer state each rank holds."""
    trainable = [p for p in plan.params.values() if p.requires_grad]
    elements = sum(math.prod(p.shape) / (1 if p.replicated else shard) for p in trainable)
    every_step = sum(math.prod(p.shape) / (1 if p.replicated else shard) * p.key.reduce.itemsize for p in trainable)
    lines = [
        f"across the replicate dim ({replicate} replicas), per rank and optimizer step:",
        f"  every step: {format_bytes(every_step)} all-reduced (each trainable shard's gradient, in its reduce dtype)",
    ]
    method, every = parallelism.replicate_sync, parallelism.sync_every
    if method == "every_step":
        return lines
    state = (
        "no outer state"
        if method == "local_sgd"
        else (
            f"outer state {format_bytes(elements * 8)} per rank (fp32 global copy and momentum, on"
            f" {'the host' if parallelism.outer_state == 'cpu' else 'the device'})"
        )
    )
    what = "params" if method == "local_sgd" else "pseudo-gradients"
    lines.append(
        f"  {method} every {every} steps: {format_bytes(elements * 4 / every)} all-reduced (the fp32 {what} of each"
        f" trainable shard, {format_bytes(elements * 4)} per sync; {every_step / (elements * 4 / every):.1f}x less);"
        f" {state}"
    )
    return lines


def activation_lines(
    hf_config: Any,
    context_parallel: int,
    seq_len: Optional[int],
    batch: int,
    estimate: MemoryEstimate,
    gpu_memory_gb: Optional[float],
    tensor_parallel: int = 1,
) -> List[str]:
    """The activation estimate per rank at ``seq_len`` with and without context parallelism, and with a GPU size the
    longest sequence that fits beside the training state (``planning/memory.py``'s estimate, checkpointing on; one
    TP rank's share under tensor parallelism)."""
    shape = ActivationShape.of_config(hf_config).tensor_parallel_share(tensor_parallel)
    lines = []
    if seq_len is not None:
        with_cp = activation_bytes(shape, seq_len, batch, context_parallel)
        alone = activation_bytes(shape, seq_len, batch, 1)
        lines.append(
            f"activations per rank at {seq_len} tokens x {batch} (estimate, activation checkpointing):"
            f" {format_bytes(with_cp)} with context_parallel={context_parallel}, {format_bytes(alone)} without"
        )
    if gpu_memory_gb is not None:
        free = gpu_memory_gb * 2**30 - estimate.device
        longest = longest_sequence(shape, free, batch, context_parallel)
        lines.append(
            f"longest sequence beside the training state on a {gpu_memory_gb:g} GiB GPU with"
            f" context_parallel={context_parallel}: {longest} tokens (batch {batch}, estimate)"
        )
    return lines


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mixedfsdp.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf-config", help="config.json, or a directory holding one (overrides the recipe's model)")
    parser.add_argument("--world-size", type=int, required=True, help="total ranks (GPUs)")
    parser.add_argument("--replicate", type=int, default=None, help="HSDP replicas (e.g. nodes); default 1")
    parser.add_argument("--precision", default=None, help="bf16-true (default), bf16-mixed or 32-true")
    parser.add_argument("--recipe", help="a recipe YAML: its strategy section and precision are used")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU, to say whether it fits")
    parser.add_argument(
        "--expert-parallel", type=int, default=None, help="expert_parallel_size (overrides the recipe's); default 1"
    )
    parser.add_argument(
        "--freeze",
        nargs="*",
        default=None,
        help="regexes of param names to freeze (model.freeze); default: an image-text model's vision tower",
    )
    parser.add_argument("--lora-rank", type=int, default=None, help="plan peft LoRA adapters of this rank")
    parser.add_argument("--lora-targets", nargs="+", default=None, help="LoRA target modules; default all Linears")
    parser.add_argument("--quantize-base", choices=["nf4"], default=None, help="4-bit frozen base (QLoRA)")
    parser.add_argument("--offload", choices=["cpu"], default=None, help="sharded state in host memory")
    parser.add_argument(
        "--bf16-updates",
        choices=["nearest", "stochastic", "kahan"],
        default=None,
        help="how bf16 params' updates are written back (bf16-true): its AdamW bytes per element",
    )
    parser.add_argument(
        "--context-parallel", type=int, default=None, help="ranks each sequence is split over (overrides the recipe's)"
    )
    parser.add_argument(
        "--pipeline", type=int, default=None, help="pipeline_parallel_size (overrides the recipe's); default 1"
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        help="tensor_parallel_size: the model split by its own HF plan (overrides the recipe's); default 1",
    )
    parser.add_argument(
        "--pipeline-schedule", choices=["1F1B", "GPipe", "Interleaved1F1B"], default=None, help="default 1F1B"
    )
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline_microbatches; default pp x v")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, for the activation estimate")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace) -> Tuple[Any, MixedFSDPConfig, str, int]:
    """The HF config, strategy config, precision and replicas, from the flags and an optional recipe (whose peft
    section fills ``args.lora_rank`` and ``args.lora_targets`` when the flags leave them out)."""
    config, precision, replicate, hf_source = MixedFSDPConfig(), "bf16-true", 1, args.hf_config
    if args.recipe:
        recipe = load_recipe(args.recipe, launching=False, parallel=False)  # sizes from the flags, checked below
        config = recipe.mixed_fsdp_config()
        precision, replicate = recipe.trainer.precision, recipe.strategy.parallelism.data_parallel_replicate_size
        hf_source = hf_source or recipe.model.hf_source()
        if args.freeze is None:
            args.freeze = recipe.model.freeze
        if recipe.peft.enabled and args.lora_rank is None:
            args.lora_rank, args.lora_targets = recipe.peft.r, args.lora_targets or list(recipe.peft.target_modules)
    if args.recipe and args.precision:  # the recipe's storage as the flag's precision reads it
        config.dtypes = replace(config.dtypes, storage=recipe_storage(args.precision, recipe.strategy.dtypes.storage))
    precision = args.precision or precision
    replicate = args.replicate or replicate
    if args.quantize_base is not None:
        config.memory = replace(config.memory, quantize_base=args.quantize_base)
    if args.offload is not None:
        config.memory = replace(config.memory, offload=args.offload)
    if args.bf16_updates is not None:
        config.dtypes = replace(config.dtypes, bf16_updates=args.bf16_updates)
    sizes = {
        "expert_parallel_size": args.expert_parallel,
        "context_parallel_size": args.context_parallel,
        "tensor_parallel_size": args.tensor_parallel,
        "pipeline_parallel_size": args.pipeline,
        "pipeline_schedule": args.pipeline_schedule,
        "pipeline_microbatches": args.microbatches,
    }
    config.parallelism = replace(config.parallelism, **{k: v for k, v in sizes.items() if v is not None})
    experts, context = config.parallelism.expert_parallel_size, config.parallelism.context_parallel_size
    tensor_parallel, stages = config.parallelism.tensor_parallel_size, config.parallelism.pipeline_parallel_size
    flags = {
        "parallelism.tensor_parallel_size": f"--tensor-parallel {tensor_parallel}",
        "parallelism.expert_parallel_size": f"--expert-parallel {experts}",
        "parallelism.context_parallel_size": f"--context-parallel {context}",
        "parallelism.pipeline_": "--pipeline",
        "pipeline_": "--pipeline",
    }
    problems = [f"{flag}: {p}" for p in config.problems() for key, flag in flags.items() if p.startswith(key)]
    if hf_source is None:
        problems.append("no model: pass --hf-config PATH (or a --recipe whose model names an HF config)")
    if args.lora_rank is not None and args.lora_rank < 1:
        problems.append(f"--lora-rank {args.lora_rank} must be >= 1")
    if precision_problem(precision):
        problems.append(f"--{precision_problem(precision)}")
    elif config.bf16_updates_problem(precision) is not None:
        problems.append(f"--bf16-updates: {config.bf16_updates_problem(precision)}")
    if tensor_parallel == "auto":  # Lightning's: the devices of a node, which a dry run does not know
        problems.append("tensor_parallel_size='auto' needs the devices of a node; pass --tensor-parallel N")
    elif args.world_size < 1 or replicate < 1 or args.world_size % replicate:
        problems.append(f"--world-size {args.world_size} must be a positive multiple of --replicate {replicate}")
    elif min(experts, context, tensor_parallel, stages) >= 1:
        problems += mesh_problems(args.world_size, replicate, experts, context, tensor_parallel, stages)
    if problems:
        raise SystemExit("python -m lightning_mixedfsdp.plan: " + "; ".join(problems))
    return load_hf_config(hf_source), config, precision, replicate


FLAGS = {
    "data_parallel_replicate_size": "--replicate",
    "tensor_parallel_size": "--tensor-parallel",
    "pipeline_parallel_size": "--pipeline",
    "context_parallel_size": "--context-parallel",
    "expert_parallel_size": "--expert-parallel",
}
"""The strategy's size names and the flags that set them here (``--context-parallel=3`` is a flag as written)."""


def mesh_problems(
    world_size: int, replicate: int, experts: int, context: int, tensor_parallel: int = 1, stages: int = 1
) -> List[str]:
    """What the strategy would refuse of these sizes at launch (``ParallelDims``), in the flags' names."""
    problems = ParallelDims.resolve_problems(
        world_size=world_size,
        devices_per_node=world_size,
        replicate=replicate,
        tensor_parallel_size=tensor_parallel,
        expert_parallel=experts,
        context_parallel=context,
        pipeline=stages,
    )
    world = f"--world-size {world_size}"
    return [
        in_recipe_keys(p, FLAGS)
        .replace(f"world size ({world_size})", f"world size ({world})")
        .replace("the number of devices/nodes", world)
        for p in problems
    ]


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = _parse(argv)
    hf_config, config, precision, replicate = _settings(args)
    start = time.perf_counter()
    tensor_parallel = int(config.parallelism.tensor_parallel_size)  # "auto" refused by _settings
    try:
        model = build_on_meta(hf_config, args.freeze, args.lora_rank, args.lora_targets)
    except MissingPackage as missing:
        raise SystemExit(f"python -m lightning_mixedfsdp.plan: {missing}") from None
    params = sum(p.numel() for p in model.parameters())
    context = config.parallelism.context_parallel_size
    refused = context_parallel_problems(model, context)  # what the model setup refuses at setup
    refused += tensor_parallel_problems(model, tensor_parallel) if tensor_parallel > 1 else []
    if refused:
        raise SystemExit("python -m lightning_mixedfsdp.plan: " + " ".join(in_recipe_keys(p, FLAGS) for p in refused))
    split = describe_split(model, tensor_parallel) if tensor_parallel > 1 else ""
    model = _tensor_parallel_share(model, tensor_parallel)
    world = args.world_size // tensor_parallel  # one TP rank's share is planned over the other dims' ranks
    stages = config.parallelism.pipeline_parallel_size
    if stages > 1:
        stage_plans = stage_lines(
            lambda: _tensor_parallel_share(build_on_meta(hf_config, args.freeze, args.lora_rank, args.lora_targets),
                                           tensor_parallel),
            config, precision, world, replicate, hf_config, args.seq_len, args.batch, tensor_parallel,
        )  # fmt: skip
    plan, estimate = dry_run(model, config, precision, world // stages, replicate)
    refused = conditional_problems(plan, context, fault_tolerant=config.fault_tolerance is not None)
    if refused:
        raise SystemExit("python -m lightning_mixedfsdp.plan: " + " ".join(in_recipe_keys(p, FLAGS) for p in refused))
    seconds = time.perf_counter() - start
    print(f"{type(model).__name__}: {format_count(params)} params, {precision}, planned in {seconds:.1f} s on meta")
    if split:
        print(f"{split}. Every figure below is one TP rank's share, planned over the {world} ranks of its TP position")
    if stages > 1:
        parallelism = config.parallelism
        planned, _ = plan_stages(model, stages * parallelism.stages_per_rank, parallelism.pipeline_split)
        print(format_plan(plan, stages=stage_of_params(model, planned or [])))
    else:
        print(format_plan(plan))
        print()
        print(format_summary(plan, estimate, world, replicate, args.gpu_memory, config.parallelism))
    lines = activation_lines(hf_config, context, args.seq_len, args.batch, estimate, args.gpu_memory, tensor_parallel)
    if stages > 1:
        lines = stage_plans
    if lines:
        print("\n".join(lines))
    sys.stdout.flush()
    return {"plan": plan, "estimate": estimate, "seconds": seconds, "params": params, "activations": lines}


def _tensor_parallel_share(model: nn.Module, tensor_parallel: int) -> nn.Module:
    """``model`` (on meta) as one of ``tensor_parallel`` TP ranks holds it (itself without TP)."""
    if tensor_parallel > 1:
        keep_tensor_parallel_share(model, tensor_parallel)
    return model
