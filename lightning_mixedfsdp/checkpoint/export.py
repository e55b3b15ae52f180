"""Safetensors export in the HF layout: every tensor in the dtype its plan keeps (fp32) or the export's dtype."""

import copy
import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from lightning_mixedfsdp._torch_compat import dtensor_with_local
from lightning_mixedfsdp._torchao_compat import is_nf4
from lightning_mixedfsdp.checkpoint.atomic import PathLike
from lightning_mixedfsdp.checkpoint.safetensors_stream import SafetensorsStream
from lightning_mixedfsdp.model.names import canonical_name, is_peft_model, peft_base_name, unwrap_model
from lightning_mixedfsdp.model.quantized import dequantized
from lightning_mixedfsdp.model.tensors import local_tensor
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
    """HF layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus an index; every tensor
    as it is. One process writes (no collective)."""
    tensors = [_Pending(name, t.shape, t.dtype, partial(_as_is, t)) for name, t in state.items()]
    written = _stream_to_files(tensors, lambda _, source: source, directory, max_shard_bytes, True, metadata)
    assert written is not None
    return written[0]


def _as_is(tensor: Tensor) -> Tensor:
    return tensor


def export_model(
    model: nn.Module,
    directory: PathLike,
    dtype: torch.dtype,
    plan: ShardPlan,
    max_shard_bytes: int = 5 * 2**30,
) -> Optional[List[Path]]:
    """Write the full weights as HF safetensors, streamed tensor by tensor; every rank must call it.

    Each tensor is gathered in turn (``DTensor.full_tensor``, on every rank), written by rank 0 into its file as it
    comes (files of at most ``max_shard_bytes``) and dropped: no rank holds more than one full tensor. The tensors
    ``plan`` keeps in fp32 (keep-fp32 params, fp32 buffers) are written in fp32, every other floating tensor in
    ``dtype``. An HF model's config is written beside them, so ``from_pretrained(directory)`` loads the export; its
    ``dtype`` is fp32 when the tensors mix dtypes, so that load keeps every value (:func:`lossless_dtype`). A PEFT
    model is exported merged under the base model's names, each layer's adapters folded into its base weight as that
    weight is written. Returns the written files on rank 0, None elsewhere.
    """
    import torch.distributed as dist

    model = unwrap_model(model)
    keep_fp32: Collection[str] = set(plan.fp32_names)
    tensors = _export_tensors(model)
    if is_peft_model(model):
        tensors = _merged_peft_tensors(model, tensors)
        keep_fp32 = {base for base in (peft_base_name(n) for n in keep_fp32) if base is not None}

    def target_dtype(name: str, source: torch.dtype) -> torch.dtype:
        return (torch.float32 if name in keep_fp32 else dtype) if source.is_floating_point else source

    written = _stream_to_files(tensors, target_dtype, Path(directory), max_shard_bytes, dist.get_rank() == 0)
    if written is None:
        return None
    files, dtypes = written
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.dtype = lossless_dtype(dtypes)
        config.save_pretrained(str(directory))
    return files


@dataclass(frozen=True)
class _Pending:
    """A tensor to export: its name, its full value's shape and dtype, and how to get the full value (a collective on
    every rank for a sharded one)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    gather: Callable[[], Tensor]


def _gathered(tensor: Tensor) -> Tensor:
    """The full value of a param or buffer: an all-gather for a DTensor (every rank calls it), else the tensor. A
    4-bit weight is dequantized on each rank first and gathered in its nominal dtype."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return dequantized(tensor)
    if is_nf4(tensor.to_local()):
        tensor = cast(DTensor, dtensor_with_local(tensor, dequantized(tensor.to_local())))
    return tensor.full_tensor()


def _export_tensors(model: nn.Module) -> List[_Pending]:
    """Every param and persistent buffer in state-dict order under its canonical name (tied names each once, as the
    state dict holds them), and the 4-bit base weights, which state dicts leave out (``apply/quantize.py``)."""
    tensors = model.state_dict(keep_vars=True)
    for name, param in model.named_parameters():
        if name not in tensors and is_nf4(local_tensor(param)):
            tensors[name] = param
    return [
        _Pending(canonical_name(name), tensor.shape, tensor.dtype, partial(_gathered, tensor.detach()))
        for name, tensor in tensors.items()
    ]


def _stream_to_files(
    tensors: Sequence[_Pending],
    target_dtype: Callable[[str, torch.dtype], torch.dtype],
    directory: Path,
    max_shard_bytes: int,
    is_rank_zero: bool,
    metadata: Optional[Dict[str, str]] = None,
) -> Optional[Tuple[List[Path], List[torch.dtype]]]:
    """Gather the tensors in order on every rank and write them on rank 0 in HF's layout (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files plus an index), each tensor written as it comes: no rank holds more
    than one full tensor."""
    sizes = [math.prod(t.shape) * target_dtype(t.name, t.dtype).itemsize for t in tensors]
    groups = _file_groups(sizes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    if is_rank_zero:
        directory.mkdir(parents=True, exist_ok=True)
    files: List[Path] = []
    weight_map: Dict[str, str] = {}
    file_metadata = {"format": "pt", **(metadata or {})}
    for file_name, members in zip(names, groups, strict=True):
        entries = [
            (tensors[i].name, tuple(tensors[i].shape), target_dtype(tensors[i].name, tensors[i].dtype)) for i in members
        ]
        stream = SafetensorsStream(directory / file_name, entries, file_metadata) if is_rank_zero else None
        with stream or nullcontext():
            for index, (name, _, dtype) in zip(members, entries, strict=True):
                full = tensors[index].gather()  # a collective for a sharded tensor: every rank, in the same order
                if stream is not None:
                    stream.write(name, full.to(dtype))
                del full
        files.append(directory / file_name)
        weight_map.update({name: file_name for name, _, _ in entries})
    if not is_rank_zero:
        return None
    if len(groups) > 1:
        contents = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(contents, indent=2))
    dtypes = [target_dtype(t.name, t.dtype) for t in tensors if t.dtype.is_floating_point]
    return files, dtypes


def _file_groups(sizes: Sequence[int], max_shard_bytes: int) -> List[List[int]]:
    """Consecutive tensors, at most ``max_shard_bytes`` a file (a larger tensor alone in its file)."""
    groups: List[List[int]] = [[]]
    size = 0
    for index, nbytes in enumerate(sizes):
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += nbytes
    return groups


def lossless_dtype(floating: Iterable[torch.dtype]) -> Optional[torch.dtype]:
    """The one dtype every floating tensor of these dtypes loads into exactly: theirs if they share one, else fp32.
    Written as the HF config's ``dtype``: ``from_pretrained(directory)`` (``dtype="auto"``) casts every tensor to it,
    so with the export's bf16 dtype it would round the fp32 norms to bf16."""
    dtypes = set(floating)
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
    adapter: str = model.active_adapter
    # the adapter's tensors alone are gathered: the base never leaves its shards
    state = {p.name: p.gather() for p in _export_tensors(model) if "lora_" in p.name}
    if dist.get_rank() != 0:
        return None
    weights = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ADAPTER_FILE
    save_safetensors({n: t.contiguous() for n, t in weights.items()}, path, {"format": "pt"})
    model.peft_config[adapter].save_pretrained(str(directory))
    return [path]


def _merged_peft_tensors(model: "PeftModel", tensors: List[_Pending]) -> List[_Pending]:
    """A PEFT model's tensors under its base model's names, each LoRA layer's active adapter folded into its base
    weight when that weight is gathered (peft's own merge of ``lora.Linear``: ``W + transpose(B @ A) * scaling``, in
    fp32 for bf16 on the CPU, added in the weight's dtype); the adapter tensors themselves are not written."""
    adapter: str = model.active_adapter
    merges: Dict[str, Any] = {}
    for module_name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None) or {}
        # peft's LoRA on an embedding keeps its adapter in lora_embedding_A, not lora_A: refused, never dropped
        embedding = adapter in (getattr(module, "lora_embedding_A", None) or {})
        if adapter not in lora_a and not embedding:
            continue
        plain_linear = not embedding and isinstance(lora_a[adapter], nn.Linear)
        if not plain_linear or getattr(module, "use_dora", {}).get(adapter, False):
            raise TypeError(
                f"export_safetensors: merging {module_name} ({type(module).__name__}) is not supported: only plain"
                " LoRA on Linear layers merges layer by layer. Export the adapter with export_adapter instead."
            )
        merges[canonical_name(f"{module_name}.base_layer.weight")] = module

    out = []
    for pending in tensors:
        base = peft_base_name(pending.name)
        if base is None:
            continue  # an adapter tensor: merged into its base weight
        module = merges.get(pending.name)
        gather = pending.gather if module is None else partial(_merged_weight, pending, module, adapter)
        out.append(_Pending(base, pending.shape, pending.dtype, gather))
    return out


def _merged_weight(pending: _Pending, module: Any, adapter: str) -> Tensor:
    """peft's merge of one ``lora.Linear`` (``get_delta_weight`` and ``merge``, peft 0.21), on the full tensors."""
    weight = pending.gather().clone()
    lora_a = _gathered(module.lora_A[adapter].weight.detach())
    lora_b = _gathered(module.lora_B[adapter].weight.detach())
    on_cpu_narrow = weight.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
    product = lora_b.float() @ lora_a.float() if on_cpu_narrow else lora_b @ lora_a
    delta = (product.T if module.fan_in_fan_out else product) * module.scaling[adapter]
    weight += delta.to(lora_b.dtype)
    return weight
