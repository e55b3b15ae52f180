"""Safetensors export in the HF layout: every tensor in the dtype its plan keeps (fp32) or the export's dtype."""

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Dict, Iterable, List, Optional, cast

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.atomic import PathLike
from lightning_mixedfsdp.model.names import is_peft_model, peft_base_name, unwrap_model, user_class
from lightning_mixedfsdp.planning.planner import ShardPlan

if TYPE_CHECKING:
    from peft import PeftModel

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"


def save_safetensors(tensors: Dict[str, Tensor], path: Path, metadata: Dict[str, str]) -> None:
    """``safetensors.torch.save_file``, with the file's mode set as ``open()`` would set it: safetensors writes a
    temporary file (mode 0600) and renames it, so an export would be readable by its owner only while the
    ``config.json`` beside it is world-readable."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process umask, read without changing it where Linux reports it (``os.umask`` sets it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_safetensors(
    state: Dict[str, Tensor], directory: Path, max_shard_bytes: int, metadata: Optional[Dict[str, str]] = None
) -> List[Path]:
    """HF layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus an index."""
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
        save_safetensors(shards[0], directory / SINGLE_FILE, metadata)
        return [directory / SINGLE_FILE]
    files = [directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        save_safetensors(shard, file, metadata)
        weight_map.update(dict.fromkeys(shard, file.name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return files


def export_model(
    model: nn.Module,
    directory: PathLike,
    dtype: torch.dtype,
    plan: ShardPlan,
    max_shard_bytes: int = 5 * 2**30,
) -> Optional[List[Path]]:
    """Gather the full weights on rank 0 and write them as safetensors; every rank must call it.

    The tensors ``plan`` keeps in fp32 (keep-fp32 params, fp32 buffers) are written in fp32, every other floating
    tensor in ``dtype``. An HF model's config is written beside them, so ``from_pretrained(directory)`` loads the
    export; its ``dtype`` is fp32 when the tensors mix dtypes, so that load keeps every value (:func:`lossless_dtype`).
    A PEFT model is exported merged (its adapters folded into the base weights, by peft's own ``merge_and_unload``),
    under the base model's names. Returns the written files on rank 0, None elsewhere.
    """
    import torch.distributed as dist

    model = unwrap_model(model)
    state = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    keep_fp32: Collection[str] = set(plan.fp32_names)
    if is_peft_model(model):
        state = _merged_peft_state(model, state)
        keep_fp32 = {base for base in (peft_base_name(n) for n in keep_fp32) if base is not None}
    converted = {
        n: t.to(torch.float32 if n in keep_fp32 else dtype) if t.is_floating_point() else t for n, t in state.items()
    }
    directory = Path(directory)
    files = write_safetensors(converted, directory, max_shard_bytes)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.dtype = lossless_dtype(converted.values())
        config.save_pretrained(str(directory))
    return files


def lossless_dtype(tensors: Iterable[Tensor]) -> Optional[torch.dtype]:
    """The one dtype every floating tensor loads into exactly: theirs if they share one, else fp32. Written as the
    HF config's ``dtype``: ``from_pretrained(directory)`` (``dtype="auto"``) casts every tensor to it, so with the
    export's bf16 dtype it would round the fp32 norms to bf16."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(dtypes) <= 1:
        return dtypes.pop() if dtypes else None
    return torch.float64 if torch.float64 in dtypes else torch.float32


def export_adapter(model: nn.Module, directory: PathLike) -> Optional[List[Path]]:
    """Write a PEFT model's active adapter in PEFT's own format (``adapter_model.safetensors`` and
    ``adapter_config.json``), so ``PeftModel.from_pretrained(base, directory)`` loads it. Every rank must call it;
    rank 0 writes. The adapter keeps its storage dtype (fp32 master weights under ``bf16-mixed``)."""
    import torch.distributed as dist
    from peft.utils import get_peft_model_state_dict

    model = unwrap_model(model)
    if not is_peft_model(model):
        raise TypeError(
            f"export_adapter: {type(model).__name__} is not a PEFT model; use export_safetensors for its weights, or"
            " wrap the model with peft.get_peft_model before setup."
        )
    state = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    adapter: str = model.active_adapter
    weights = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ADAPTER_FILE
    save_safetensors({n: t.contiguous() for n, t in weights.items()}, path, {"format": "pt"})
    model.peft_config[adapter].save_pretrained(str(directory))
    return [path]


def full_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """The full (gathered) state dict on rank 0, offloaded to the CPU; empty elsewhere. Names are canonical."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(Dict[str, Tensor], get_model_state_dict(model, options=options))


def _merged_peft_state(model: "PeftModel", state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The merged weights of a PEFT model under its base model's names, computed by peft on an unsharded copy that
    rank 0 builds from the base model's class and config (the export needs the full model on rank 0 anyway)."""
    from peft import get_peft_model

    base = model.get_base_model()
    config = getattr(base, "config", None)
    if config is None:
        raise TypeError(
            f"export_safetensors: merging the adapters of a PEFT model needs a Hugging Face base model (with a config);"
            f" {type(base).__name__} has none. Export the adapter with export_adapter instead."
        )
    with torch.device("meta"):
        copy_of_base = user_class(base)(copy.deepcopy(config))
    adapter: str = model.active_adapter
    unsharded = get_peft_model(copy_of_base, copy.deepcopy(model.peft_config[adapter]), adapter_name=adapter)
    unsharded.load_state_dict(state, strict=True, assign=True)
    tie_weights = getattr(copy_of_base, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()  # assign=True replaced the tied tensors one by one
    merged: nn.Module = unsharded.merge_and_unload()
    return merged.state_dict()
