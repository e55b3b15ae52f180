"""Safetensors export in the HF layout: every tensor in the dtype its plan keeps (fp32) or the export's dtype.

An export is written whole into a staging folder beside its target and committed by rename (``staging.py``): a
failed or killed export leaves the previous one as it was. Each tensor is gathered in regions of at most half a
chunk (``gather.py``), so no rank holds more than about one chunk of it at once, and rank 0 writes each region into
its file as it comes. A failure on rank 0 (a full disk, no permission) reaches every rank at the next agreement,
every chunk of data (``distributed/agreement.py``).
"""

import copy
import json
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.atomic import PathLike
from lightning_mixedfsdp.checkpoint.gather import Region, full_regions
from lightning_mixedfsdp.checkpoint.manifest import BF16_UPDATES_KEY, MANIFEST_KEY
from lightning_mixedfsdp.checkpoint.safetensors_stream import SafetensorsStream
from lightning_mixedfsdp.checkpoint.staging import StagedFolder
from lightning_mixedfsdp.compat.torchao import is_nf4
from lightning_mixedfsdp.distributed.agreement import Agreement
from lightning_mixedfsdp.model.names import canonical_name, is_peft_model, peft_base_name, unwrap_model
from lightning_mixedfsdp.model.tensors import local_tensor
from lightning_mixedfsdp.planning.types import ShardPlan

if TYPE_CHECKING:
    from peft import PeftModel

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
DEFAULT_EXPORT_CHUNK_BYTES = 256 * 2**20
"""The most an export holds of a tensor on each rank at once (``Weights.export_chunk_bytes``)."""

AlsoWrite = Callable[[Path], None]
"""Rank 0 writes more files of the export into the staging folder (a tokenizer, a model's code)."""


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


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to export: its name, its full value's shape and dtype, and its full value region by region (a
    collective on every rank for a sharded one)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    regions: Callable[[int], Iterator[Region]]


def write_safetensors(
    state: Dict[str, Tensor], directory: Path, max_shard_bytes: int, metadata: Optional[Dict[str, str]] = None
) -> List[Path]:
    """HF layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus an index; every tensor
    as it is. One process writes (no collective), in place."""
    tensors = [PendingTensor(name, t.shape, t.dtype, partial(full_regions, t)) for name, t in state.items()]
    directory.mkdir(parents=True, exist_ok=True)
    layout = _Layout(tensors, lambda _, source: source, max_shard_bytes)
    layout.write(directory, DEFAULT_EXPORT_CHUNK_BYTES, None, metadata)
    return [directory / name for name in layout.file_names]


def export_model(
    model: nn.Module,
    directory: PathLike,
    dtype: torch.dtype,
    plan: ShardPlan,
    max_shard_bytes: int = 5 * 2**30,
    chunk_bytes: int = DEFAULT_EXPORT_CHUNK_BYTES,
    also_write: Optional[AlsoWrite] = None,
    stages: Optional["PipelineStages"] = None,
) -> Optional[List[Path]]:
    """Write the full weights as HF safetensors, committed as a whole; every rank must call it.

    Each tensor is gathered in regions of at most ``chunk_bytes / 2`` on every rank and written by rank 0 into its
    file (files of at most ``max_shard_bytes``) as it comes. The tensors ``plan`` keeps in fp32 (keep-fp32 params,
    fp32 buffers) are written in fp32, every other floating tensor in ``dtype``. An HF model's config is written
    beside them, so ``from_pretrained(directory)`` loads the export; its ``dtype`` (and each sub-config's) states the
    bulk's stored dtype (:func:`bulk_dtype`). ``also_write(folder)`` adds files of the caller's
    on rank 0 (a tokenizer) before the commit. A PEFT model is exported merged under the base model's names, each
    layer's adapters folded into its base weight region by region. Under pipeline parallelism (``stages``) each
    stage gathers its own tensors over its data-parallel ranks and sends them to rank 0, which writes one folder
    with every stage's tensors under their names. Returns the written files on rank 0, None elsewhere."""
    import torch.distributed as dist

    model = unwrap_model(model)
    keep_fp32: Collection[str] = set(plan.fp32_names)
    tensors = export_tensors(model)
    if is_peft_model(model):
        tensors = merged_peft_tensors(model, tensors)
        keep_fp32 = {base for base in (peft_base_name(n) for n in keep_fp32) if base is not None}
    manifest = plan.keep_fp32_manifest
    if stages is not None:
        tensors = stages.every_stages_tensors(tensors)
        keep_fp32 = set().union(*stages.every_stages(sorted(keep_fp32)))
        manifest = {name: rule for part in stages.every_stages(manifest) for name, rule in part.items()}

    def target_dtype(name: str, source: torch.dtype) -> torch.dtype:
        return (torch.float32 if name in keep_fp32 else dtype) if source.is_floating_point else source

    layout = _Layout(tensors, target_dtype, max_shard_bytes)

    def finish(folder: Path) -> None:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config = stating_dtype(config, bulk_dtype(layout.floating_elements))
            config.save_pretrained(str(folder))
        if also_write is not None:
            also_write(folder)

    if is_peft_model(model):
        manifest = {base: rule for name, rule in manifest.items() if (base := peft_base_name(name)) is not None}

    def write(folder: Optional[Path], agreement: Agreement) -> None:
        metadata = {MANIFEST_KEY: json.dumps(manifest, sort_keys=True), BF16_UPDATES_KEY: plan.bf16_updates}
        layout.write(folder, chunk_bytes, agreement, metadata, agree_every_chunk=stages is None)

    written = _staged(Path(directory), "export_safetensors", write, finish)
    return written if dist.get_rank() == 0 else None


def _staged(
    directory: Path,
    what: str,
    write: Callable[[Optional[Path], Agreement], None],
    finish: Optional[AlsoWrite] = None,
) -> List[Path]:
    """The staging, agreement and commit around an export's writes (every rank; rank 0 writes)."""
    import torch.distributed as dist

    agreement = Agreement(f"{what} to {str(directory)!r}")
    staging = StagedFolder(directory, writer=dist.get_rank() == 0)
    folder: Optional[Path] = None
    written: List[Path] = []
    try:
        with agreement.local():
            folder = staging.open()
        agreement.agree()
        write(folder, agreement)
        with agreement.local():
            if folder is not None:
                if finish is not None:
                    finish(folder)
                written = staging.commit()
        agreement.agree()
    except BaseException:
        staging.discard()
        raise
    return written


class _Layout:
    """Which file holds which tensor, in which dtype: HF's layout (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` plus an index)."""

    def __init__(
        self,
        tensors: Sequence[PendingTensor],
        target_dtype: Callable[[str, torch.dtype], torch.dtype],
        max_shard_bytes: int,
    ) -> None:
        self.tensors = list(tensors)
        self.dtypes = [target_dtype(t.name, t.dtype) for t in tensors]
        self.sizes = [math.prod(t.shape) * dtype.itemsize for t, dtype in zip(tensors, self.dtypes, strict=True)]
        self.groups = _file_groups(self.sizes, max_shard_bytes)
        count = len(self.groups)
        self.file_names = (
            [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )

    @property
    def floating_elements(self) -> Dict[torch.dtype, int]:
        """How many floating elements are written in each dtype."""
        counts: Dict[torch.dtype, int] = {}
        for t, dtype in zip(self.tensors, self.dtypes, strict=True):
            if t.dtype.is_floating_point:
                counts[dtype] = counts.get(dtype, 0) + math.prod(t.shape)
        return counts

    def write(
        self,
        folder: Optional[Path],
        chunk_bytes: int,
        agreement: Optional[Agreement],
        metadata: Optional[Dict[str, str]] = None,
        agree_every_chunk: bool = True,
    ) -> None:
        """Every rank walks the regions (collectives); the rank given a ``folder`` writes them. With an
        ``agreement``, a failure to write reaches every rank within about one chunk of data (at the end when not
        ``agree_every_chunk``: pipeline stages walk different regions); without one (a single process) it raises at
        once."""
        region_bytes = max(1, chunk_bytes // 2)
        since_agreement = 0
        file_metadata = {"format": "pt", **(metadata or {})}
        for file_name, members in zip(self.file_names, self.groups, strict=True):
            entries = [(self.tensors[i].name, tuple(self.tensors[i].shape), self.dtypes[i]) for i in members]
            stream = _Stream(folder / file_name if folder is not None else None, entries, file_metadata, agreement)
            for index, (name, _, dtype) in zip(members, entries, strict=True):
                for dim, start, stop, value in self.tensors[index].regions(region_bytes):
                    stream.write(name, dim, start, stop, value.to(dtype))
                    since_agreement += value.numel() * dtype.itemsize
                    del value
                    if agreement is not None and agree_every_chunk and since_agreement >= chunk_bytes:
                        agreement.agree()
                        since_agreement = 0
            stream.close()
        if folder is not None:
            _local(agreement, lambda: self._write_index(folder))

    def _write_index(self, folder: Path) -> None:
        if len(self.groups) > 1:
            weight_map = {
                self.tensors[i].name: file_name
                for file_name, members in zip(self.file_names, self.groups, strict=True)
                for i in members
            }
            contents = {"metadata": {"total_size": sum(self.sizes)}, "weight_map": weight_map}
            (folder / SAFETENSORS_INDEX).write_text(json.dumps(contents, indent=2))


class _Stream:
    """One file of the export on the writing rank (a no-op elsewhere, and after a failure): opening, writing and
    closing each kept by the agreement instead of raised, so the rank stays in step with the others."""

    def __init__(self, path: Optional[Path], entries: List[Any], metadata: Dict[str, str], agreement: Any) -> None:
        self._agreement = agreement
        self._stream: Optional[SafetensorsStream] = None
        if path is not None:
            _local(agreement, lambda: self._open(path, entries, metadata))

    def _open(self, path: Path, entries: List[Any], metadata: Dict[str, str]) -> None:
        self._stream = SafetensorsStream(path, entries, metadata).__enter__()

    def write(self, name: str, dim: int, start: int, stop: int, value: Tensor) -> None:
        stream = self._stream
        if stream is not None and not (self._agreement is not None and self._agreement.failed):
            _local(self._agreement, lambda: stream.write_region(name, dim, start, stop, value))

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            failed = self._agreement is not None and self._agreement.failed
            _local(self._agreement, lambda: stream.__exit__(RuntimeError if failed else None, None, None))


def _local(agreement: Optional[Agreement], action: Callable[[], Any]) -> None:
    if agreement is None:
        action()
        return
    with agreement.local():
        action()


def export_tensors(model: nn.Module) -> List[PendingTensor]:
    """Every param and persistent buffer in state-dict order under its canonical name (tied names each once, as the
    state dict holds them), and the 4-bit base weights, which state dicts leave out (``apply/quantize.py``)."""
    tensors = model.state_dict(keep_vars=True)
    for name, param in model.named_parameters():
        if name not in tensors and is_nf4(local_tensor(param)):
            tensors[name] = param
    return [
        PendingTensor(canonical_name(name), tensor.shape, tensor.dtype, partial(full_regions, tensor.detach()))
        for name, tensor in tensors.items()
    ]


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


def bulk_dtype(elements: Mapping[torch.dtype, int]) -> Optional[torch.dtype]:
    """The dtype most of the export's floating elements are stored in (``elements``: how many in each), written as
    the HF config's ``dtype``: ``from_pretrained(directory, dtype="auto")`` and serving engines build the model in
    it. The keep-fp32 tensors (norms, ``A_log``) are few: an export stored in bf16 with fp32 norms is a bf16 model,
    and fp32 there would build the whole model at twice its memory. Their fp32 values stay in the files, named in
    the manifest; ``load_export`` and ``load_weights`` keep them fp32."""
    return max(elements, key=lambda dtype: elements[dtype]) if elements else None


def stating_dtype(config: Any, dtype: Optional[torch.dtype]) -> Any:
    """A copy of an HF ``config`` whose ``dtype`` is ``dtype``, and so is each sub-config's (a composite model's
    ``text_config`` and ``vision_config``: transformers sets neither when the top level's is set)."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "dtype"):
            sub.dtype = dtype
    return config


def export_adapter(model: nn.Module, directory: PathLike) -> Optional[List[Path]]:
    """Write a PEFT model's active adapter in PEFT's own format (``adapter_model.safetensors`` and
    ``adapter_config.json``), committed as a whole, so ``PeftModel.from_pretrained(base, directory)`` loads it. Every
    rank must call it; rank 0 writes. The adapter keeps its storage dtype (fp32 master weights under ``bf16-mixed``).
    """
    import torch.distributed as dist

    model = unwrap_model(model)
    if not is_peft_model(model):
        raise TypeError(
            f"export_adapter: {type(model).__name__} is not a PEFT model; use export_safetensors for its weights, or"
            " wrap the model with peft.get_peft_model before setup."
        )
    from peft.utils import get_peft_model_state_dict  # a PEFT model: its code imported peft

    adapter: str = model.active_adapter
    # the adapter's tensors alone are gathered (they are small: whole): the base never leaves its shards
    state = {p.name: _whole(p) for p in export_tensors(model) if "lora_" in p.name}

    def finish(folder: Path) -> None:
        weights = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
        save_safetensors({n: t.contiguous() for n, t in weights.items()}, folder / ADAPTER_FILE, {"format": "pt"})
        model.peft_config[adapter].save_pretrained(str(folder))

    written = _staged(Path(directory), "export_adapter", lambda folder, agreement: None, finish)
    return [path for path in written if path.name == ADAPTER_FILE] if dist.get_rank() == 0 else None


def _whole(pending: PendingTensor) -> Tensor:
    """A tensor's full value in one piece (for small tensors: an adapter's)."""
    regions = list(pending.regions(max(1, math.prod(pending.shape) * pending.dtype.itemsize)))
    return regions[0][3] if len(regions) == 1 else torch.cat([r[3] for r in regions], dim=regions[0][0])


def merged_peft_tensors(model: "PeftModel", tensors: List[PendingTensor]) -> List[PendingTensor]:
    """A PEFT model's tensors under its base model's names, each LoRA layer's active adapter folded into its base
    weight region by region (peft's own merge of ``lora.Linear``: ``W + transpose(B @ A) * scaling``, in fp32 for
    bf16 on the CPU, added in the weight's dtype); the adapter tensors themselves are not written."""
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
        regions = pending.regions if module is None else partial(_merged_regions, pending, module, adapter)
        out.append(PendingTensor(base, pending.shape, pending.dtype, regions))
    return out


def _whole_weight(weight: Tensor) -> Tensor:
    """A (small) weight gathered whole on every rank."""
    return _whole(PendingTensor("adapter", weight.shape, weight.dtype, partial(full_regions, weight.detach())))


def _merged_regions(pending: PendingTensor, module: Any, adapter: str, region_bytes: int) -> Iterator[Region]:
    """peft's merge of one ``lora.Linear`` (``get_delta_weight`` and ``merge``, peft 0.21), region by region of the
    base weight: the adapter's A and B are gathered whole (rank x features), the delta of each region from them."""
    lora_a, lora_b = _whole_weight(module.lora_A[adapter].weight), _whole_weight(module.lora_B[adapter].weight)
    on_cpu_narrow = lora_b.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_a.float(), lora_b.float()) if on_cpu_narrow else (lora_a, lora_b)
    for dim, start, stop, value in pending.regions(region_bytes):
        # the weight is (out, in) = B @ A, or its transpose with fan_in_fan_out: a region of rows of one is a
        # region of columns of the other
        rows = (dim == 0) != bool(module.fan_in_fan_out)
        product = b[start:stop] @ a if rows else b @ a[:, start:stop]
        delta = (product.T if module.fan_in_fan_out else product) * module.scaling[adapter]
        merged = value.clone()
        merged += delta.to(lora_b.dtype)
        yield dim, start, stop, merged


class PipelineStages:
    """How an export reaches across pipeline stages: ``group`` is this rank's pipeline group (the ranks of the other
    stages with its own data-parallel coordinates); ``sends`` whether this rank sends its stage's tensors to rank 0
    (its stage's first data-parallel rank, in rank 0's pipeline group); ``copies``: names of tied params whose
    other stage exports them (the last stage's tied head)."""

    _END = -1

    def __init__(self, group: Any, sends: bool, copies: Sequence[str] = ()) -> None:
        import torch.distributed as dist

        self.group, self.sends, self.copies = group, sends, frozenset(copies)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.writer = dist.get_rank() == 0

    def every_stages(self, value: Any) -> List[Any]:
        """``value`` of every stage, in stage order."""
        import torch.distributed as dist

        gathered: List[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def every_stages_tensors(self, tensors: List[PendingTensor]) -> List[PendingTensor]:
        """Every stage's tensors in stage order: this stage's walk their regions (collectives over its data-parallel
        ranks) and, on the sending rank, send them to rank 0; rank 0 receives the others'."""
        tensors = [t for t in tensors if t.name not in self.copies]  # a tied copy: the first stage exports it
        described = self.every_stages([(t.name, tuple(t.shape), t.dtype) for t in tensors])
        every: List[PendingTensor] = []
        for stage, entries in enumerate(described):
            for index, (name, shape, dtype) in enumerate(entries):
                regions: Callable[[int], Iterator[Region]]
                if stage == self.rank:
                    regions = partial(self._sent, tensors[index].regions)
                elif self.writer:
                    regions = partial(self._received, stage, shape, dtype)
                else:
                    regions = _nothing
                every.append(PendingTensor(name, torch.Size(shape), dtype, regions))
        return every

    def _sent(self, regions: Callable[[int], Iterator[Region]], region_bytes: int) -> Iterator[Region]:
        import torch.distributed as dist

        for dim, start, stop, value in regions(region_bytes):
            if self.writer:
                yield dim, start, stop, value
            elif self.sends:
                peer = dist.get_global_rank(self.group, 0)
                dist.send(torch.tensor([dim, start, stop], device=value.device), peer, group=self.group)
                dist.send(value.contiguous(), peer, group=self.group)
        if self.sends and not self.writer:
            end = torch.tensor([self._END, 0, 0], device=_device_of(self.group))
            dist.send(end, dist.get_global_rank(self.group, 0), group=self.group)

    def _received(self, stage: int, shape: Tuple[int, ...], dtype: torch.dtype, _: int) -> Iterator[Region]:
        import torch.distributed as dist

        peer, device = dist.get_global_rank(self.group, stage), _device_of(self.group)
        while True:
            header = torch.empty(3, dtype=torch.int64, device=device)
            dist.recv(header, peer, group=self.group)
            dim, start, stop = header.tolist()
            if dim == self._END:
                return
            region_shape = list(shape)
            if region_shape:
                region_shape[dim] = stop - start
            value = torch.empty(region_shape, dtype=dtype, device=device)
            dist.recv(value, peer, group=self.group)
            yield dim, start, stop, value


def _nothing(_: int) -> Iterator[Region]:
    return iter(())


def _device_of(group: Any) -> torch.device:
    """The device a group's point-to-point tensors live on (CUDA for NCCL, the CPU for gloo)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
