"""Loading weights without losing a dtype: dtype-aware casting, and loads into sharded models where every rank reads
its own part of a safetensors checkpoint (a torch file: rank 0 reads and streams)."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.apply.boundaries import apply_dtype_boundaries
from lightning_mixedfsdp.checkpoint.atomic import PathLike
from lightning_mixedfsdp.checkpoint.export import SAFETENSORS_INDEX, SINGLE_FILE
from lightning_mixedfsdp.checkpoint.safetensors_stream import read_header
from lightning_mixedfsdp.compat.torch import dtensor_with_local, non_persistent_buffer_names, replace_parameter
from lightning_mixedfsdp.compat.torchao import is_nf4
from lightning_mixedfsdp.compat.transformers import checkpoint_key_renames
from lightning_mixedfsdp.config import BulkDtypes, MixedFSDPConfig
from lightning_mixedfsdp.distributed.agreement import on_rank_zero
from lightning_mixedfsdp.materialize.stream import produce_each, stream_into, tensor_targets
from lightning_mixedfsdp.model.names import canonical_name, is_peft_model, peft_base_name, unwrap_model, user_class
from lightning_mixedfsdp.model.pipeline_stages import pipeline_stage_group, tied_copies
from lightning_mixedfsdp.model.quantized import fill_nf4, quantize_part, quantize_rows
from lightning_mixedfsdp.model.tensors import local_tensor
from lightning_mixedfsdp.planning.memory import STAGING_BYTES
from lightning_mixedfsdp.planning.planner import plan_validated

DEFAULT_CHUNK_BYTES = 64 * 2**20

TensorFacts = Tuple[Tuple[int, ...], torch.dtype]
"""A tensor's shape and dtype."""


def read_state_dict(path: PathLike) -> Dict[str, Tensor]:
    """A flat tensor dict from a ``.safetensors`` file, an HF export folder (single file or sharded with an index),
    or a torch file (memory-mapped, weights only)."""
    reader = CheckpointReader(path)
    return {name: reader.get(name) for name in reader.keys()}


def load_weights(
    model: nn.Module,
    source: Union[PathLike, Dict[str, Tensor]],
    dtype: torch.dtype,
    config: Optional[MixedFSDPConfig] = None,
) -> nn.Module:
    """Load a full checkpoint into an unsharded model (meta or not), every tensor in the dtype its plan gives it with
    ``dtype`` as the bulk: keep-fp32 params and buffers fp32, other buffers as the plan's buffer rule says, the rest
    ``dtype``. The plan's dtype boundaries are installed too (a keep-fp32 module computes in fp32 and returns
    ``dtype``), so a plain forward runs. Tied params stay one tensor; a checkpoint may hold every tied name (equal
    copies) or one of them."""
    config = (config or MixedFSDPConfig()).validate()
    plan = plan_validated(model, config, BulkDtypes.uniform(dtype))
    state = read_state_dict(source) if isinstance(source, (str, Path)) else dict(source)
    ties = tied_names(model)
    state = _untied_state(state, ties)
    planned = plan.storage_dtypes
    for alias, own in ties.items():
        planned[alias] = planned[own]
    # a name the plan lacks is no tensor of the model: the strict load below refuses it by name
    cast = {n: t.to(planned[n]) if t.is_floating_point() and n in planned else t for n, t in state.items()}
    model.load_state_dict(cast, strict=True, assign=True)
    tie_again(model, ties)
    apply_dtype_boundaries(model, plan)
    return model


def tied_names(model: nn.Module) -> Dict[str, str]:
    """Every alias of a tied param -> the name it is tied to (the first name ``named_parameters`` gives it)."""
    owner_of: Dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        own = owner_of.setdefault(id(param), name)
        if own != name:
            aliases[canonical_name(name)] = canonical_name(own)
    return aliases


def tie_again(model: nn.Module, ties: Dict[str, str]) -> None:
    """After ``load_state_dict(assign=True)`` replaced tied params one by one: make each alias the same param again."""
    for alias, own in ties.items():
        module_name, _, attribute = alias.rpartition(".")
        replace_parameter(model.get_submodule(module_name), attribute, model.get_parameter(own))


def _untied_state(state: Dict[str, Tensor], ties: Dict[str, str]) -> Dict[str, Tensor]:
    """``state`` with each tied group held once under every name: copies must be equal, one name is enough."""
    groups: Dict[str, List[str]] = {}
    for alias, own in ties.items():
        groups.setdefault(own, [own]).append(alias)
    state = dict(state)
    for names in groups.values():
        present = [n for n in names if n in state]
        if not present:
            continue
        first = state[present[0]]
        differing = [n for n in present[1:] if not torch.equal(state[n], first)]
        if differing:
            raise ValueError(
                f"load_weights: the model ties {names}, but the checkpoint holds different values for"
                f" {[present[0], *differing]}. Save the tied model's own state dict, or untie the model before"
                " loading (e.g. tie_word_embeddings=False)."
            )
        for name in names:
            state[name] = first
    return state


ReadMode = Literal["own_parts", "rank_zero"]


def load_full_weights(
    model: nn.Module,
    path: PathLike,
    strict: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    read: ReadMode = "own_parts",
) -> None:
    """Load a full checkpoint into a sharded model.

    A safetensors checkpoint (an HF folder, one file or sharded with an index, or a ``.safetensors`` file alone in
    its folder) is read by every rank, each reading only the byte ranges of its own shards (torch DCP's
    ``HuggingFaceStorageReader``): a rank reads about ``1/N`` of the bytes, plus the small replicated params whole.
    Any other checkpoint (a torch file) is read by rank 0 alone, tensor by tensor (memory-mapped), and streamed in
    chunks of about ``chunk_bytes``, so no rank holds more than one chunk beyond its shards; ``read="rank_zero"``
    takes that path for safetensors too (storage that serves one reader best).

    Names and shapes are agreed with every rank before any tensor moves, so no rank waits on a mismatched
    collective. Every tensor takes the dtype the plan gave the matching param or buffer (a checkpoint's bf16 norm
    widens to fp32 exactly; an fp32 tensor kept fp32 stays exact). Tied copies in the checkpoint are accepted and
    skipped. A PEFT model loads its base model's checkpoint; its adapters keep their values.
    """
    model = unwrap_model(model)
    stage_group = _stage_group(model, path, read)  # a pipeline stage matches the checkpoint against its own names
    targets = tensor_targets(model)
    from_checkpoint = _checkpoint_names(model)
    expected = {
        key: (tuple(targets[name].shape), targets[name].dtype)
        for key, name in from_checkpoint.items()
        if key == _own_key(name)
    }
    readers: List[CheckpointReader] = []
    base = hf_base_model(model)

    def _match(reader: "CheckpointReader", renamed: Dict[str, str]) -> Tuple[Dict[str, str], List[str]]:
        return _matched_keys(reader, renamed, expected, from_checkpoint, strict, stage_group is not None)

    def survey() -> Dict[str, str]:
        """Rank 0: the checkpoint's names, shapes and dtypes against the model's; model name -> checkpoint key."""
        reader = CheckpointReader(path)
        readers.append(reader)
        sources, problems = _match(reader, _with_tied_copies(model, reader.keys()))
        rename = checkpoint_key_renames(user_class(base), base.config) if problems and base is not None else None
        if rename is not None:  # a legacy layout, renamed as from_pretrained renames it
            sources, problems = _match(reader, {key: rename(key) for key in reader.keys()})
        if problems:
            raise ValueError(f"load_full_weights: {str(path)!r} does not fit the model: {'; '.join(problems)}")
        # model name -> the checkpoint key it loads from, in the model's order
        return {name: sources[name] for name in dict.fromkeys(from_checkpoint.values()) if name in sources}

    present = on_rank_zero("load_full_weights", survey, group=stage_group)
    folder = _safetensors_folder(Path(path)) if read == "own_parts" else None
    if folder is not None:
        _read_own_parts(folder, {key: targets[name] for name, key in present.items()})
        return
    chunks = _byte_chunks(targets, list(present), chunk_bytes)
    produce = None
    if readers:
        produce = produce_each(chunks, lambda chunk: _LazyChunk(readers[0], present, chunk))
    stream_into(model, chunks, produce)


def _with_tied_copies(model: nn.Module, keys: Iterable[str]) -> Dict[str, str]:
    """Checkpoint key -> model name: each key its own name, and a tied weight the checkpoint stores once (under the
    first stage's name) loaded into the last stage's copy on a rank that holds the copy alone."""
    renamed = {key: key for key in keys}
    for copy, first in tied_copies(model).items():
        if copy not in renamed and first in renamed:
            renamed[first] = copy
    return renamed


def _stage_group(model: nn.Module, path: PathLike, read: ReadMode) -> Optional[Any]:
    """The data-parallel group of ``model``'s pipeline stage (None: no stage), once ``read`` is known to be a mode;
    a stage reads its own tensors of an HF safetensors folder, and any other checkpoint is refused."""
    if read not in ("own_parts", "rank_zero"):
        raise ValueError(f"load_full_weights: read={read!r} is not supported; use 'own_parts' or 'rank_zero'.")
    group = pipeline_stage_group(model)
    if group is not None and (read != "own_parts" or _safetensors_folder(Path(path)) is None):
        raise ValueError(
            f"load_full_weights: {str(path)!r} into pipeline stages: each stage reads its own tensors of an HF"
            " safetensors folder (read='own_parts'); save the checkpoint as one (e.g. with export_safetensors, or"
            " save_pretrained), or load it before pipeline parallelism splits the model."
        )
    return group


def _read_own_parts(folder: Path, targets: Dict[str, Tensor], staging_bytes: int = STAGING_BYTES) -> None:
    """Every rank reads its own shards' byte ranges into ``targets`` (checkpoint key -> DTensor or plain tensor of
    the model; a plain or Replicate one is read whole), cast to the target's dtype. A 4-bit target is read in its
    nominal dtype into a staging shard, about ``staging_bytes`` of them per rank at a time, and quantized from
    there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    quantized = {key: target for key, target in targets.items() if is_nf4(local_tensor(target))}
    with torch.no_grad():
        plain = {key: target for key, target in targets.items() if key not in quantized}
        dcp.load(plain, storage_reader=HuggingFaceStorageReader(str(folder)))
        local = {key: local_tensor(target) for key, target in quantized.items()}
        for chunk in _byte_chunks(local, list(quantized), staging_bytes):
            staged = {key: _staging_shard(quantized[key]) for key in chunk}
            dcp.load(dict(staged), storage_reader=HuggingFaceStorageReader(str(folder)))
            _quantize_into([quantized[key] for key in chunk], [staged[key] for key in chunk])


def _staging_shard(target: Tensor) -> Tensor:
    """An empty tensor of ``target``'s nominal dtype, placed as ``target`` is: what DCP reads a 4-bit shard into."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return torch.empty(target.shape, dtype=target.dtype, device=target.device)
    local = target.to_local()
    return dtensor_with_local(target, torch.empty(local.shape, dtype=local.dtype, device=local.device))


def _quantize_into(targets: List[Tensor], staged: List[Tensor]) -> None:
    """Quantize each staged shard into its 4-bit target, with the whole weight's scaler mean (one all-reduce over
    the ranks sharing the weight's rows for the whole chunk)."""
    from torch.distributed.tensor import DTensor, Shard

    by_group: Dict[Any, List[int]] = {}
    for position, target in enumerate(targets):
        group = None
        if isinstance(target, DTensor):
            shard_dims = [d for d, p in enumerate(target.placements) if isinstance(p, Shard)]
            group = target.device_mesh.get_group(shard_dims[-1]) if shard_dims else None
        by_group.setdefault(group, []).append(position)
    for group, positions in by_group.items():
        rows = [local_tensor(staged[i]) for i in positions]
        parts = quantize_rows(rows, group) if group is not None else [quantize_part(r, r) for r in rows]
        for i, part in zip(positions, parts, strict=True):
            fill_nf4(local_tensor(targets[i]), part)


def _safetensors_folder(path: Path) -> Optional[Path]:
    """The folder every rank reads with DCP's HF reader, which reads every ``*.safetensors`` file in it: an HF folder
    whose safetensors files are exactly the checkpoint's (its index's files, or ``model.safetensors``), or a
    ``.safetensors`` file alone in its folder. None otherwise (a torch file; a folder holding other safetensors files
    too, e.g. an adapter beside the model), which rank 0 then reads alone."""
    folder = path if path.is_dir() else path.parent
    present = sorted(folder.glob("*.safetensors"))
    if not path.is_dir():
        return folder if path.suffix == ".safetensors" and present == [path] else None
    try:
        checkpoint_files = sorted(_safetensors_files(folder))
    except FileNotFoundError:
        return None
    return folder if present and present == checkpoint_files else None


class CheckpointReader:
    """Rank 0's lazy view of a checkpoint: names, shapes and dtypes from the metadata, one tensor at a time on demand.

    Reads a ``.safetensors`` file, an HF folder (``model.safetensors`` or shards with an index), or a torch file
    (memory-mapped, weights only). Every safetensors file is checked whole when the reader opens it (a truncated file
    is refused, by name); each is opened for each read and closed after it, so the pages read do not stay mapped in
    this process.
    """

    def __init__(self, path: PathLike) -> None:
        path = Path(path)
        self._file_of: Dict[str, Path] = {}
        self._facts: Dict[str, TensorFacts] = {}
        self._torch: Optional[Dict[str, Tensor]] = None
        if path.is_dir() or path.suffix == ".safetensors":
            for file in _safetensors_files(path):
                if not file.is_file():
                    raise FileNotFoundError(f"{str(file)!r}, a file of the checkpoint {str(path)!r}, does not exist.")
                for name, facts in read_header(file).items():
                    self._file_of[name] = file
                    self._facts[name] = facts
        else:
            self._torch = _torch_state(path)
            self._facts = {name: (tuple(t.shape), t.dtype) for name, t in self._torch.items()}

    def keys(self) -> List[str]:
        return list(self._facts)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._facts[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._facts[name][1]

    def get(self, name: str) -> Tensor:
        if self._torch is not None:
            return self._torch[name]
        from safetensors import safe_open

        with safe_open(str(self._file_of[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)


class _LazyChunk(Mapping):
    """A chunk's tensors, each read when the stream copies it: one tensor in memory at a time."""

    def __init__(self, reader: CheckpointReader, sources: Dict[str, str], names: Sequence[str]) -> None:
        self._reader, self._sources, self._names = reader, sources, list(names)

    def __getitem__(self, name: str) -> Tensor:
        return self._reader.get(self._sources[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _safetensors_files(path: Path) -> List[Path]:
    if not path.is_dir():
        return [path]
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        import json

        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(
        f"{str(path)!r} has neither {SINGLE_FILE} nor {SAFETENSORS_INDEX}; pass the weights file itself."
    )


def _torch_state(path: Path) -> Dict[str, Tensor]:
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # a truncated or foreign file: torch names neither the file nor the fix
        raise ValueError(
            f"{str(path)!r} cannot be read as a torch checkpoint ({error}); save or copy it again."
        ) from error
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"read_state_dict: {str(path)!r} does not hold a flat name -> tensor dict; for a Fabric checkpoint pass"
            " its 'model' entry, e.g. torch.save(torch.load(path)['model'], 'weights.pt')."
        )
    return state


def _checkpoint_names(model: nn.Module) -> Dict[str, str]:
    """Checkpoint key -> the model's canonical name, for every param (tied aliases too) and persistent buffer. A PEFT
    model's base names are its base model's checkpoint keys; its adapters are in no base checkpoint."""
    names = [(canonical_name(n), p) for n, p in model.named_parameters(remove_duplicate=False)]
    for module_name, module in model.named_modules():
        skipped = non_persistent_buffer_names(module)
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name not in skipped:
                names.append((canonical_name(f"{module_name}.{buffer_name}" if module_name else buffer_name), buffer))
    known: Dict[int, str] = {}
    mapping = {}
    for name, tensor in names:
        own = known.setdefault(id(tensor), name)
        key = peft_base_name(name) if is_peft_model(model) else name
        if key is not None:
            mapping[key] = own
    return mapping


def _matched_keys(
    reader: "CheckpointReader",
    renamed: Dict[str, str],
    expected: Dict[str, TensorFacts],
    from_checkpoint: Dict[str, str],
    strict: bool,
    held_only: bool = False,
) -> Tuple[Dict[str, str], List[str]]:
    """Model name -> checkpoint key, with the checkpoint's keys read as ``renamed`` says; and the mismatches.
    ``held_only``: the checkpoint's keys the model does not hold are left out (another pipeline stage's)."""
    if held_only:
        renamed = {key: name for key, name in renamed.items() if name in from_checkpoint or name in expected}
    # a tied alias loads its param only when the checkpoint lacks the param's own key
    in_order = sorted((k for k in reader.keys() if k in renamed), key=lambda k: renamed[k] in expected)
    sources = {from_checkpoint.get(renamed[key], renamed[key]): key for key in in_order}
    found = {_own_key(name): (reader.shape(key), reader.dtype(key)) for name, key in sources.items()}
    return sources, _mismatches(expected, found, strict)


def hf_base_model(model: nn.Module) -> Optional[nn.Module]:
    """The transformers model a checkpoint's keys name (a PEFT model's base), or None for another model."""
    base = model.get_base_model() if is_peft_model(model) else model
    return base if hasattr(base, "config") and hasattr(base, "base_model_prefix") else None


def _own_key(name: str) -> str:
    """The checkpoint key of a model name (the inverse of the PEFT mapping for base params)."""
    return peft_base_name(name) or name


def _byte_chunks(targets: Dict[str, Tensor], names: Sequence[str], chunk_bytes: int) -> List[List[str]]:
    """Consecutive names, about ``chunk_bytes`` of full tensors each (one larger tensor travels alone)."""
    chunks: List[List[str]] = [[]]
    size = 0
    for name in names:
        nbytes = targets[name].numel() * targets[name].element_size()
        if chunks[-1] and size + nbytes > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(name)
        size += nbytes
    return [chunk for chunk in chunks if chunk]


def _mismatches(expected: Dict[str, TensorFacts], found: Dict[str, TensorFacts], strict: bool) -> List[str]:
    """Every way the checkpoint's tensors (``found``) do not fit the model's (``expected``), each named: missing and
    unexpected keys (under ``strict``), any dimension that differs (0-dim tensors included), and a dtype that cannot
    load (a float loads into a float of any width, as the plan says; an integer or a bool only into its own dtype)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing and strict:
        problems.append(f"missing keys {missing[:8]}{'...' if len(missing) > 8 else ''} (pass strict=False to skip)")
    if unexpected and strict:
        problems.append(f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for key in sorted(set(expected) & set(found)):
        (model_shape, model_dtype), (saved_shape, saved_dtype) = expected[key], found[key]
        if tuple(model_shape) != tuple(saved_shape):
            problems.append(
                f"{key} has shape {tuple(saved_shape)} in the checkpoint, {tuple(model_shape)} in the model"
            )
        elif not _loads_into(saved_dtype, model_dtype):
            problems.append(
                f"{key} is {_name(saved_dtype)} in the checkpoint, {_name(model_dtype)} in the model (a float loads"
                " into any float; an integer or a bool only into its own dtype)"
            )
    return problems


def _loads_into(saved: torch.dtype, model: torch.dtype) -> bool:
    return (saved.is_floating_point and model.is_floating_point) or saved == model


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
