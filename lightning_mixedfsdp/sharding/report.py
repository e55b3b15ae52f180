"""The dtype report: one row per param and per floating buffer, repeated blocks collapsed to ``layers.*``."""

import re
from typing import Dict, List, Sequence, Tuple

from lightning_mixedfsdp.sharding.plan import ShardPlan, short_dtype

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=[.\[:,\]]|$)")


def _collapse(name: str) -> str:
    return _INDEX.sub("*", name)


def format_report(plan: ShardPlan) -> str:
    param_rows = [
        (
            _collapse(p.name) + ("" if p.requires_grad else " (frozen)"),
            _shape(p.shape),
            short_dtype(p.key.storage),
            short_dtype(p.key.compute),
            short_dtype(p.key.reduce),
            "replicated" if p.replicated else "sharded",
            _collapse(p.group),
            p.rule or "-",
        )
        for p in plan.params.values()
    ]
    header = ("parameter", "shape", "storage", "compute", "reduce", "placement", "group", "keep-fp32 rule")
    buffer_rows = [(_collapse(b.name), _shape(b.shape), short_dtype(b.dtype), b.rule) for b in plan.buffers.values()]
    sharded, replicated = plan.sharded_groups, plan.replicated_groups
    total_bytes = sum(p.nbytes for p in plan.params.values())
    bulk = plan.bulk
    summary = [
        f"mixed_fsdp2 dtype plan: {len(plan.params)} params ({total_bytes / 2**20:.2f} MiB),"
        f" {len(sharded)} sharded groups, {len(replicated)} replicated groups"
        f" ({sum(plan.params[p].nbytes for p in plan.replicated_params) / 2**10:.1f} KiB replicated),"
        f" {len(plan.buffers)} floating buffers",
        f"bulk: storage {short_dtype(bulk.storage) if bulk.storage else 'as loaded'},"
        f" compute {short_dtype(bulk.compute) if bulk.compute else 'own dtype'},"
        f" reduce {short_dtype(bulk.reduce) if bulk.reduce else 'own dtype'}; keep-fp32: fp32/fp32/fp32",
        "collectives per step (predicted): " + ", ".join(f"{k} {v}" for k, v in plan.predicted_collectives().items()),
    ]
    lines = summary + [""] + _table(header, param_rows)
    if buffer_rows:
        lines += [""] + _table(("buffer", "shape", "dtype", "set by"), buffer_rows)
    if plan.warnings:
        lines += [""] + [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _table(header: Tuple[str, ...], rows: Sequence[Tuple[str, ...]]) -> List[str]:
    """Aligned columns; identical rows counted once with ``xN`` on the first cell."""
    counts: Dict[Tuple[str, ...], int] = {}
    for row in rows:
        counts[row] = counts.get(row, 0) + 1
    table = [header] + [(f"{r[0]} x{n}" if n > 1 else r[0], *r[1:]) for r, n in counts.items()]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _shape(shape: Tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"
