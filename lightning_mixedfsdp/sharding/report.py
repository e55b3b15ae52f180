"""Text tables for reports: aligned columns, repeated rows counted once, block indices collapsed to ``*``.

Nothing here knows about plans; the plan describes itself with these (``ShardPlan.report``).
"""

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

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


def short_dtype(dtype: Optional[torch.dtype]) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return names.get(dtype, str(dtype).replace("torch.", "")) if dtype is not None else "-"


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
