"""Safetensors export in the HF layout, keeping the plan's fp32 params fp32."""

import json
import re
from pathlib import Path
from typing import Collection, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.sharding.names import unwrap_model

PathLike = Union[str, Path]
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def export_dtypes(
    names: Sequence[str], dtype: torch.dtype, keep_fp32: Union[Collection[str], Sequence[str]], patterns: bool
) -> Dict[str, torch.dtype]:
    """Save dtype per name: fp32 for the keep set (names, or regexes when ``patterns``), ``dtype`` for the rest."""
    compiled = [re.compile(p) for p in keep_fp32] if patterns else []
    keep = set() if patterns else set(keep_fp32)
    return {name: torch.float32 if name in keep or any(c.search(name) for c in compiled) else dtype for name in names}


def write_safetensors(
    state: Dict[str, Tensor], directory: Path, max_shard_bytes: int, metadata: Optional[Dict[str, str]] = None
) -> List[Path]:
    """HF layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus an index."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shards: List[Dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    metadata = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata=metadata)
        return [directory / SINGLE_FILE]
    files = [directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file.name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return files


def export_model(
    model: nn.Module,
    directory: PathLike,
    dtype: torch.dtype,
    keep_fp32_names: Collection[str] = (),
    keep_fp32_patterns: Optional[Sequence[str]] = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Optional[List[Path]]:
    """Gather the full weights on rank 0 and write them as safetensors; every rank must call it.

    Params in ``keep_fp32_names`` (or matching ``keep_fp32_patterns`` when given) are written in fp32, the rest in
    ``dtype``. An HF model's config is written beside them, so ``from_pretrained(directory)`` loads the export.
    Returns the written files on rank 0, None elsewhere.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = unwrap_model(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    if keep_fp32_patterns is not None:
        targets = export_dtypes(list(state), dtype, keep_fp32_patterns, patterns=True)
    else:
        targets = export_dtypes(list(state), dtype, keep_fp32_names, patterns=False)
    converted = {n: t.to(targets[n]) if t.is_floating_point() else t for n, t in state.items()}
    directory = Path(directory)
    files = write_safetensors(converted, directory, max_shard_bytes)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))
    return files
