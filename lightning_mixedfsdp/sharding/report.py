"""The dtype report: one row per parameter, repeated blocks collapsed to ``layers.*``."""

import re
from typing import Dict

from lightning_mixedfsdp.sharding.plan import ShardPlan, short_dtype

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=[.\[:,\]]|$)")


def _collapse(name: str) -> str:
    return _INDEX.sub("*", name)


def format_report(plan: ShardPlan) -> str:
    rows: Dict[tuple, int] = {}
    for p in plan.params.values():
        placement = "replicated" if p.replicated else "sharded"
        frozen = "" if p.requires_grad else " (frozen)"
        row = (
            _collapse(p.name) + frozen,
            "x".join(map(str, p.shape)) or "scalar",
            short_dtype(p.key.storage),
            short_dtype(p.key.compute),
            short_dtype(p.key.reduce),
            placement,
            _collapse(p.group),
            p.rule or "-",
        )
        rows[row] = rows.get(row, 0) + 1
    header = ("parameter", "shape", "storage", "compute", "reduce", "placement", "group", "keep-fp32 rule")
    table = [header] + [(f"{r[0]} x{n}" if n > 1 else r[0], *r[1:]) for r, n in rows.items()]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    sharded, replicated = plan.sharded_groups, plan.replicated_groups
    total_bytes = sum(p.nbytes for p in plan.params.values())
    bulk = plan.bulk
    summary = [
        f"mixed_fsdp2 dtype plan: {len(plan.params)} params ({total_bytes / 2**20:.2f} MiB),"
        f" {len(sharded)} sharded groups, {len(replicated)} replicated groups"
        f" ({sum(plan.params[p].nbytes for p in plan.replicated_params) / 2**10:.1f} KiB replicated)",
        f"bulk: storage {short_dtype(bulk.storage) if bulk.storage else 'as loaded'},"
        f" compute {short_dtype(bulk.compute) if bulk.compute else 'own dtype'},"
        f" reduce {short_dtype(bulk.reduce) if bulk.reduce else 'own dtype'}; keep-fp32: fp32/fp32/fp32",
        "collectives per step (predicted): " + ", ".join(f"{k} {v}" for k, v in plan.predicted_collectives().items()),
    ]
    warnings = [f"warning: {w}" for w in plan.warnings]
    return "\n".join(summary + [""] + lines + ([""] + warnings if warnings else []))
