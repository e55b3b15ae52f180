"""The dry run's pipeline stages: each stage's blocks, params, training state per rank, what it holds unsharded
during a step (its params and grads: gradient sync and resharding are off across the micro-batches), activations
counting the micro-batches it holds at once under the schedule (the last stage's logits and loss copies per
micro-batch among them), and their sum: the stage's peak per rank (``planning/memory.py``). Each stage is planned as the
strategy plans it: the model cut to that stage (``pipelining/stage_forward.py``), then the dtype plan over the
stage's data-parallel ranks."""

from typing import Any, Callable, List, Optional

from torch import nn

from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.pipelining.stage_forward import cut_to_stages
from lightning_mixedfsdp.planning.memory import (
    ActivationShape,
    estimate_memory,
    in_flight_microbatches,
    stage_activation_bytes,
    unsharded_step_bytes,
)
from lightning_mixedfsdp.planning.planner import plan_sharding
from lightning_mixedfsdp.planning.report import format_bytes, format_count
from lightning_mixedfsdp.planning.stages import block_layout, plan_stages


def stage_lines(
    build: Callable[[], nn.Module],
    config: MixedFSDPConfig,
    precision: str,
    world_size: int,
    replicate: int,
    hf_config: Any,
    seq_len: Optional[int],
    batch: int,
    tensor_parallel: int = 1,
) -> List[str]:
    """One line per stage (``build()`` makes a fresh model on meta, one per stage, since cutting is in place; under
    tensor parallelism one TP rank's share, and ``world_size`` the ranks of one TP position)."""
    parallelism = config.parallelism
    size, per_rank, micro = parallelism.pipeline_parallel_size, parallelism.stages_per_rank, parallelism.microbatches
    schedule, num_stages = parallelism.pipeline_schedule, size * per_rank
    model = build()
    stages, problems = plan_stages(model, num_stages, parallelism.pipeline_split)
    layout = block_layout(model, parallelism.pipeline_split)
    if stages is None or layout is None:
        raise SystemExit("pipeline stages: " + " ".join(problems))
    stage_world = world_size // size
    shard = stage_world // replicate
    micro_batch = max(1, batch // micro)
    shape = ActivationShape.of_config(hf_config).tensor_parallel_share(tensor_parallel) if hf_config else None
    layout_words = f"HSDP {replicate} x {shard}" if replicate > 1 else f"FSDP over {shard}"
    layout_words += f" x TP {tensor_parallel}" if tensor_parallel > 1 else ""
    lines = [
        f"pipeline: {num_stages} stages on {size} ranks ({schedule}, {micro} micro-batches of {micro_batch}"
        f"{' x ' + str(seq_len) + ' tokens' if seq_len else ''}), each stage {layout_words} ranks"
    ]
    for stage in stages:
        stage_model = build()
        cut_to_stages(stage_model, layout, [stage])
        plan = plan_sharding(stage_model, config, precision, shard_ranks=shard)
        estimate = estimate_memory(plan, shard_ranks=shard, data_parallel_ranks=stage_world)
        params = sum(p.numel() for p in stage_model.parameters())
        unsharded = unsharded_step_bytes(plan)
        line = (
            f"  stage {stage.index} (pipeline rank {stage.index % size}): {stage.describe()}, {format_count(params)}"
            f" params; training state {format_bytes(estimate.total)} per rank, + {format_bytes(unsharded)} params"
            " and grads unsharded during a step"
        )
        peak = estimate.total - estimate.host + unsharded  # the whole stage is gathered: no working set beyond
        if shape is not None and seq_len:
            held = in_flight_microbatches(schedule, stage.index, num_stages, micro, per_rank)
            each = stage_activation_bytes(shape, len(stage.blocks), bool(stage.last), seq_len, micro_batch)
            batches = "micro-batch" if held == 1 else "micro-batches"
            line += f"; activations {held} {batches} in flight x {format_bytes(each)} = {format_bytes(held * each)}"
            peak += held * each
        lines.append(f"{line}; at most {format_bytes(peak)} per rank during a step")
    return lines
