"""The dtype report: a plan read back as text (one row per param and buffer, repeated blocks collapsed to ``*``), and
the table and unit formatting it and the dry-run planner use. It reads a plan and decides nothing."""

import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from lightning_mixedfsdp.config import short_dtype
from lightning_mixedfsdp.planning.memory import ADAMW_BF16_STATE_BYTES
from lightning_mixedfsdp.planning.types import ShardPlan

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=[.\[:,\]]|$)")


def collapse_indices(name: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn``: rows of repeated blocks become one."""
    return _INDEX.sub("*", name)


def format_table(header: Tuple[str, ...], rows: Sequence[Tuple[str, ...]]) -> List[str]:
    """Aligned columns; identical rows counted once with ``xN`` on the first cell."""
    counts: Dict[Tuple[str, ...], int] = {}
    for row in rows:
        counts[row] = counts.get(row, 0) + 1
    table = [header] + [(f"{r[0]} x{n}" if n > 1 else r[0], *r[1:]) for r, n in counts.items()]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_shape(shape: Tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def format_bytes(count: float) -> str:
    """Bytes in the largest binary unit that leaves at least 1 before the point: ``512 B``, ``5.00 KiB``, ``1.69 MiB``,
    ``130.42 GiB``."""
    if abs(count) < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if abs(round(count, 2)) < 1024:
            return f"{count:.2f} {unit}"
    return f"{count / 1024:.2f} TiB"


def format_count(count: float) -> str:
    """A count in K, M or B (thousands, millions, billions): ``420.00K``, ``1.69M``, ``70.55B``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{unit}"
    return f"{count:.0f}"


PARAM_COLUMNS = ("parameter", "shape", "storage", "compute", "reduce", "placement", "group", "keep-fp32 rule")
"""The dtype report's columns for params (``stalled`` and ``optimizer`` follow when given)."""


def format_plan(
    plan: ShardPlan,
    stalled: Optional[Mapping[str, float]] = None,
    optimizers: Optional[Mapping[str, str]] = None,
    stages: Optional[Mapping[str, int]] = None,
) -> str:
    """The dtype report: a row per param and buffer, blocks collapsed to ``layers.*``; optional columns: the monitor's
    ``stalled`` share per param (a collapsed row's largest), the ``optimizers``, the pipeline ``stages``."""
    in_experts = {n for m in (plan.experts.modules if plan.experts else ()) for n in plan.params_in(m)}
    fp32_compute = {n for m in plan.fp32_compute for n in plan.params_in(m)}
    param_rows: List[Tuple[str, ...]] = [
        (
            collapse_indices(p.name) + ("" if p.requires_grad else " (frozen)"),
            format_shape(p.shape),
            p.storage_name,
            short_dtype(p.key.compute) + ("->fp32" if p.name in fp32_compute else ""),
            short_dtype(p.key.reduce),
            "replicated" if p.replicated else "expert-parallel" if p.name in in_experts else "sharded",
            collapse_indices(p.group),
            str(p.rule) if p.rule is not None else "-",
        )
        for p in plan.params.values()
    ]
    header: Tuple[str, ...] = PARAM_COLUMNS
    if stages is not None:
        header, param_rows = _with_stages(header, param_rows, [p.name for p in plan.params.values()], stages)
    if stalled is not None:
        header, param_rows = _with_stalled(header, param_rows, stalled)
    if optimizers is not None:
        header, param_rows = _with_optimizers(header, param_rows, optimizers)
    buffer_rows = [
        (collapse_indices(b.name), format_shape(b.shape), short_dtype(b.dtype), b.set_by) for b in plan.buffers.values()
    ]
    total_bytes, bulk = sum(p.nbytes for p in plan.params.values()), plan.bulk
    replicated_bytes = sum(plan.params[p].nbytes for p in plan.replicated_params)
    summary = [
        f"mixed_fsdp2 dtype plan: {len(plan.params)} params ({format_bytes(total_bytes)}),"
        f" {len(plan.sharded_groups)} sharded groups, {len(plan.replicated_groups)} replicated groups"
        f" ({format_bytes(replicated_bytes)} replicated), {len(plan.buffers)} floating buffers",
        f"bulk: storage {short_dtype(bulk.storage) if bulk.storage else 'as loaded'},"
        f" compute {short_dtype(bulk.compute) if bulk.compute else 'own dtype'},"
        f" reduce {short_dtype(bulk.reduce) if bulk.reduce else 'own dtype'}; keep-fp32: fp32/fp32/fp32",
        "collectives per step (predicted): " + ", ".join(f"{k} {v}" for k, v in plan.predicted_collectives().items()),
    ]
    if plan.experts is not None:
        summary += expert_lines(plan)
    summary += quantization_lines(plan)
    summary += float8_lines(plan)
    summary += fault_tolerance_lines(plan)
    summary += context_parallel_lines(plan)
    summary += conditional_lines(plan)
    summary += offload_lines(plan)
    summary += bf16_update_lines(plan)
    summary += fp32_compute_lines(plan)
    lines = summary + [""] + format_table(header, param_rows)
    if buffer_rows:
        lines += [""] + format_table(("buffer", "shape", "dtype", "set by"), buffer_rows)
    if plan.warnings:
        lines += [""] + [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _with_stages(
    header: Tuple[str, ...], rows: List[Tuple[str, ...]], names: List[str], stages: Mapping[str, int]
) -> Tuple[Tuple[str, ...], List[Tuple[str, ...]]]:
    """The report's rows with each param's pipeline stage after its name (``names``: the rows' params, in order)."""
    staged = [(row[0], str(stages.get(name, "-")), *row[1:]) for row, name in zip(rows, names, strict=True)]
    return (header[0], "stage", *header[1:]), staged


def _with_stalled(
    header: Tuple[str, ...], rows: List[Tuple[str, ...]], stalled: Mapping[str, float]
) -> Tuple[Tuple[str, ...], List[Tuple[str, ...]]]:
    """The report's rows with the precision monitor's largest share of each (collapsed) param."""
    worst: Dict[str, float] = {}
    for name, share in stalled.items():
        worst[collapse_indices(name)] = max(share, worst.get(collapse_indices(name), 0.0))
    return (*header, "stalled"), [(*row, f"{worst[row[0]]:.0%}" if row[0] in worst else "-") for row in rows]


def _with_optimizers(
    header: Tuple[str, ...], rows: List[Tuple[str, ...]], optimizers: Mapping[str, str]
) -> Tuple[Tuple[str, ...], List[Tuple[str, ...]]]:
    """The report's rows with the optimizer of each (collapsed) param."""
    by_row = {collapse_indices(name): optimizer for name, optimizer in optimizers.items()}
    return (*header, "optimizer"), [(*row, by_row.get(row[0], "-")) for row in rows]


def conditional_lines(plan: ShardPlan, shard_ranks: Optional[int] = None) -> List[str]:
    """The modules that run for some inputs only: frozen or trainable, their bytes (per rank over ``shard_ranks``),
    and where they are all-gathered."""
    if not plan.conditional_modules:
        return []
    lines = [
        "run for some inputs only (no unit of their own: all-gathered with the unit around them, which every rank"
        " runs; minority dtypes replicated):"
    ]
    for module in plan.conditional_modules:
        params = [plan.params[name] for name in plan.params_in(module)]
        trainable = sum(math.prod(p.shape) for p in params if p.requires_grad)
        total = sum(math.prod(p.shape) for p in params)
        state = f"trainable ({format_count(trainable)} of {format_count(total)} params)" if trainable else "frozen"
        sharded = sum(p.nbytes for p in params if not p.replicated)
        replicated = sum(p.nbytes for p in params if p.replicated)
        size = format_bytes(sharded + replicated)
        if shard_ranks is not None:
            size += f", {format_bytes(sharded / shard_ranks + replicated)} per rank"
        units = sorted({collapse_indices(p.group) for p in params if not p.replicated})
        lines.append(f"  {module}: {state}, {size}, in {', '.join(units) or 'replicated groups'}")
    return lines


def context_parallel_lines(plan: ShardPlan) -> List[str]:
    """The context-parallel dim: what it splits and where the params go."""
    if plan.context_parallel <= 1:
        return []
    cp = plan.context_parallel
    return [
        f"context parallel: every sequence split over {cp} ranks (ring attention, head-tail load balanced); each rank"
        f" holds 1/{cp} of a sequence's activations; params sharded over the data-parallel shard ranks x {cp}"
    ]


def fault_tolerance_lines(plan: ShardPlan) -> List[str]:
    """The fault-tolerant dim: the replica groups and the reductions across them, by reduce dtype."""
    if plan.replica_groups is None:
        return []
    counts = sorted((short_dtype(dtype), count) for dtype, count in plan.cross_replica_reductions().items())
    by_dtype = ", ".join(f"{count} in {name}" for name, count in counts)
    return [
        f"fault-tolerant replica dim (torchft): {plan.replica_groups} replica groups; every step each dtype group's"
        f" gradients are also averaged across them in its reduce dtype ({by_dtype or 'none trainable'})"
    ]


def expert_lines(plan: ShardPlan, expert_shard_ranks: Optional[int] = None) -> List[str]:
    """The expert lines of the report: mesh, per-rank experts and bytes, all-to-alls per step."""
    experts = plan.experts
    if experts is None:
        return []
    counts = sorted(set(experts.num_experts.values()))
    total, per_rank = plan.expert_bytes(expert_shard_ranks or 1)
    all_to_alls = experts.all_to_alls_per_step()
    layers = len(experts.modules)
    shard = (
        f"expert_data_parallel = data-parallel shard ranks / {experts.size}"
        if expert_shard_ranks is None
        else f"expert_data_parallel={expert_shard_ranks}"
    )
    return [
        f"expert parallel: expert_parallel={experts.size} x {shard}; {layers} MoE layers, experts per layer"
        f" {'/'.join(map(str, counts))} -> {'/'.join(str(c // experts.size) for c in counts)} per rank",
        f"expert params: {format_bytes(total)} in all, {format_bytes(per_rank)} per rank"
        + ("" if expert_shard_ranks else " before FSDP sharding over expert_data_parallel"),
        f"all-to-all per step (predicted): forward {all_to_alls['forward']} ({layers} layers x (dispatch + combine"
        f" + split sizes)), backward {all_to_alls['backward']} ({layers} layers x (dispatch + combine)); an"
        " activation-checkpointed layer adds its forward's again in backward",
    ]


def quantization_lines(plan: ShardPlan) -> List[str]:
    """The 4-bit base: how many weights, their bytes against the nominal dtype's, and each weight left as it is."""
    quantized = [plan.params[name] for name in plan.quantized_params]
    if not quantized and not plan.not_quantized:
        return []
    stored = sum(p.nbytes for p in quantized)
    nominal = sum(math.prod(p.shape) * p.key.storage.itemsize for p in quantized)
    ratio = f" ({stored / nominal:.3f}x)" if nominal else ""
    lines = [
        f"4-bit base: {len(quantized)} frozen weights in nf4, {format_bytes(stored)} instead of"
        f" {format_bytes(nominal)}{ratio}, all-gathered in 4 bits with their group; {len(plan.not_quantized)} frozen"
        " Linear weights left as they are"
    ]
    reasons = [(collapse_indices(name), reason) for name, reason in plan.not_quantized.items()]
    lines += [f"  not quantized: {row[0]}: {row[1]}" for row in dict.fromkeys(reasons)]
    return lines


def float8_lines(plan: ShardPlan) -> List[str]:
    """The float8 decision of every Linear layer with its reason, repeated blocks collapsed."""
    if plan.float8_recipe is None:
        return []
    converted = plan.float8_modules
    lines = [
        f"float8 {plan.float8_recipe}: {len(converted)} of {len(plan.float8)} Linear layers train in float8; the"
        " rest stay in the compute dtype"
    ]
    rows = [(collapse_indices(name), "float8" if c.converted else "-", c.reason) for name, c in plan.float8.items()]
    lines += ["  " + line for line in format_table(("linear", "float8", "reason"), rows)]
    if plan.float8_left_experts:
        experts = sorted({collapse_indices(name) for name in plan.float8_left_experts})
        lines.append(
            f"  experts stay in the compute dtype: {', '.join(experts)} (fused 3-D expert weights, no nn.Linear)"
        )
    return lines


def bf16_update_lines(plan: ShardPlan) -> List[str]:
    """How the trainable bf16 params' updates are written back, and what that costs in AdamW state."""
    if plan.bf16_updates == "nearest":
        return []
    trained = [p for p in plan.params.values() if p.requires_grad and p.key.storage == torch.bfloat16]
    if not trained:
        return []
    per_element = ADAMW_BF16_STATE_BYTES[plan.bf16_updates]
    what = "rounded stochastically" if plan.bf16_updates == "stochastic" else "compensated (a bf16 Kahan buffer)"
    return [
        f"bf16_updates {plan.bf16_updates}: the updates of {len(trained)} trainable bf16 params {what}; AdamW keeps"
        f" {per_element} bytes per element (bf16 param: {2 + per_element} with it, fp32 masters: 12; nearest: 6)"
    ]


def fp32_compute_lines(plan: ShardPlan) -> List[str]:
    """The modules that compute in fp32 while stored in their group's dtype (``dtypes.fp32_compute_modules``)."""
    if not plan.fp32_compute:
        return []
    rows = []
    for module, entry in plan.fp32_compute.items():
        weight = plan.params.get(f"{module}.weight")
        tied = " (tied: its weight is another module's, whose own compute is unchanged)" if weight is None else ""
        rows.append(f"{module} [{entry}]{tied}")
    return [
        "compute fp32 (fp32_compute_modules): gathered in the group's dtype, then weight and input upcast, the matmul"
        " and its output in fp32; storage and sharding unchanged: " + ", ".join(rows)
    ]


def offload_lines(plan: ShardPlan) -> List[str]:
    """What the plan keeps in host memory: the whole sharded state, or only the units with no trainable param."""
    if plan.offload is not None:
        return [
            f"offload {plan.offload}: sharded params, their grads and optimizer states in host memory; replicated"
            " params stay on the device"
        ]
    if plan.offload_frozen is not None:
        return [
            f"offload_frozen {plan.offload_frozen}: the units with no trainable param keep their shards in host memory"
        ]
    return []
