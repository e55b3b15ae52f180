"""The keep-fp32 manifest: every param and buffer a keep-fp32 rule pinned, with that rule, stored with each
checkpoint (under :data:`MANIFEST_KEY`) and in each export's safetensors metadata. A resume whose rules pin another
set says what changed: a tensor the checkpoint trained in fp32 now in bf16 loses precision from the first step, one
now fp32 that trained in bf16 starts from bf16 values."""

import json
from pathlib import Path
from typing import Dict, List, Optional

MANIFEST_KEY = "mixed_fsdp2_keep_fp32"
BF16_UPDATES_KEY = "mixed_fsdp2_bf16_updates"
"""How the trained bf16 params' updates were written back (``dtypes.bf16_updates``), in each export's metadata; a
checkpoint's optimizer param groups hold it under ``bf16_updates``."""


def manifest_differences(saved: Dict[str, str], current: Dict[str, str], limit: int = 6) -> List[str]:
    """What differs between the manifest a checkpoint holds and the plan's now, each a short phrase."""
    differences = []
    left = sorted(set(saved) - set(current))
    added = sorted(set(current) - set(saved))
    changed = sorted(name for name in set(saved) & set(current) if saved[name] != current[name])
    if left:
        differences.append(f"no longer kept fp32: {_listed(left, saved, limit)}")
    if added:
        differences.append(f"now kept fp32: {_listed(added, current, limit)}")
    if changed:
        differences.append(
            f"kept by another rule: {', '.join(f'{n} ({saved[n]} -> {current[n]})' for n in changed[:limit])}"
        )
    return differences


def _listed(names: List[str], rules: Dict[str, str], limit: int) -> str:
    shown = ", ".join(f"{name} ({rules[name]})" for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def export_manifest(directory: Path) -> Optional[Dict[str, str]]:
    """The manifest an export's first safetensors file holds, or None."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    with safe_open(str(files[0]), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return json.loads(metadata[MANIFEST_KEY]) if MANIFEST_KEY in metadata else None
