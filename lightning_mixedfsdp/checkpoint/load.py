"""Loading weights without losing a dtype: dtype-aware casting and rank-0-only reads into sharded models."""

from pathlib import Path
from typing import Any, Collection, Dict, Optional, Union

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.export import SAFETENSORS_INDEX, SINGLE_FILE
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.sharding.matching import KeepFp32Rules, match_keep_fp32
from lightning_mixedfsdp.sharding.names import unwrap_model

PathLike = Union[str, Path]


def read_state_dict(path: PathLike) -> Dict[str, Tensor]:
    """A flat tensor dict from a ``.safetensors`` file, an HF export folder (single file or sharded with an index),
    or a torch file (memory-mapped, weights only)."""
    path = Path(path)
    if path.is_dir():
        return _read_export_folder(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"read_state_dict: {str(path)!r} does not hold a flat name -> tensor dict; for a Fabric checkpoint pass"
            " its 'model' entry, e.g. torch.save(torch.load(path)['model'], 'weights.pt')."
        )
    return state


def _read_export_folder(folder: Path) -> Dict[str, Tensor]:
    import json

    from safetensors.torch import load_file

    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(
            f"read_state_dict: {str(folder)!r} has neither model.safetensors nor model.safetensors.index.json;"
            " pass the weights file itself."
        )
    state: Dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def dtype_aware(
    state_dict: Dict[str, Tensor],
    pinned: Collection[str],
    requested: torch.dtype,
    buffer_dtypes: Optional[Dict[str, torch.dtype]] = None,
) -> Dict[str, Tensor]:
    """Cast to ``requested``; pinned entries get the promotion of their checkpoint dtype with the request, so an
    fp32 ``A_log`` stays fp32 in a bf16 load and an explicit fp32 request makes everything fp32. Buffers no rule
    pins keep the dtype the model built them in (``buffer_dtypes``), as the dtype plan does."""
    buffer_dtypes = buffer_dtypes or {}
    out = {}
    for name, tensor in state_dict.items():
        if not tensor.is_floating_point():
            out[name] = tensor
        elif name in pinned:
            out[name] = tensor.to(torch.promote_types(tensor.dtype, requested))
        else:
            out[name] = tensor.to(buffer_dtypes.get(name, requested))
    return out


def load_weights(
    model: nn.Module,
    source: Union[PathLike, Dict[str, Tensor]],
    dtype: torch.dtype,
    config: Optional[MixedFSDPConfig] = None,
) -> nn.Module:
    """Load into an unsharded model (meta or not), dtype-aware; the model's params take the loaded dtypes."""
    config = config or MixedFSDPConfig()
    state = read_state_dict(source) if isinstance(source, (str, Path)) else source
    pinned = match_keep_fp32(model, KeepFp32Rules.of(config))
    buffers = {name: b.dtype for name, b in model.named_buffers() if b.is_floating_point()}
    model.load_state_dict(dtype_aware(state, pinned.rule_of, dtype, buffers), strict=True, assign=True)
    return model


def load_full_weights(model: nn.Module, path: PathLike, strict: bool = True) -> None:
    """Load a full checkpoint into a sharded model: only rank 0 reads ``path``.

    Every tensor is cast on rank 0 to the dtype the plan gave the matching param or buffer, and the names, shapes
    and dtypes are agreed with every rank before any tensor moves, so no rank waits on a mismatched collective.
    """
    import torch.distributed as dist

    model = unwrap_model(model)
    state: Optional[Dict[str, Tensor]] = read_state_dict(path) if dist.get_rank() == 0 else None
    broadcast_full_state(model, state, strict=strict)


def broadcast_full_state(model: nn.Module, full_state: Optional[Dict[str, Tensor]], strict: bool = True) -> None:
    """Rank 0 holds ``full_state`` (others pass None); shards, replicas and persistent buffers are filled from it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    local = model.state_dict()
    expected = {name: (tuple(t.shape), t.dtype) for name, t in local.items()}
    problems = [None]
    if full_state is not None:
        full_state = {
            k: v.to(expected[k][1]) if k in expected and v.is_floating_point() else v for k, v in full_state.items()
        }
        problems = [_mismatches(expected, {k: (tuple(v.shape), v.dtype) for k, v in full_state.items()}, strict)]
    dist.broadcast_object_list(problems, src=0)
    if problems[0]:
        raise ValueError(f"load_full_weights: the checkpoint does not fit the model: {problems[0]}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, full_state if full_state is not None else {}, options=options)


def _mismatches(expected: Dict[str, Any], found: Dict[str, Any], strict: bool) -> str:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k][0] != found[k][0])
    problems = []
    if missing and strict:
        problems.append(f"missing keys {missing[:8]}{'...' if len(missing) > 8 else ''} (pass strict=False to skip)")
    if unexpected and strict:
        problems.append(f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    if wrong:
        problems.append("shape mismatch for " + ", ".join(f"{k}: {found[k][0]} vs {expected[k][0]}" for k in wrong[:8]))
    return "; ".join(problems)
