"""Bytes read and written, peak host memory and wall time per rank for the two ends of a run, on a sharded HF Llama
(``init_meta_params=False``, bf16-true, 2 CPU ranks), each alternated in one launch:

- load: ``load_full_weights`` of a ``save_pretrained`` folder, rank 0 reading and streaming everything
  (``read="rank_zero"``) against every rank reading its own shards (``read="own_parts"``, torch DCP's
  ``HuggingFaceStorageReader``);
- export: ``export_safetensors(..., max_shard_bytes=64 MiB)`` streamed tensor by tensor against the whole model
  gathered on rank 0 first (``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` and one write).

    python -m benchmarks.io_per_rank --save /tmp/llama245m            # once: a bf16 copy in 5 safetensors files
    python -m benchmarks.io_per_rank --load /tmp/llama245m --repeats 2
    python -m benchmarks.io_per_rank --size 1.1b --save /tmp/llama1b --shard-size 500MB
    python -m benchmarks.io_per_rank --size 1.1b --load /tmp/llama1b
    python -m benchmarks.io_per_rank --load /tmp/llama245m --quantize-base nf4   # into a frozen NF4 base

Before each load every file is dropped from the page cache (``posix_fadvise(DONTNEED)``), so ``/proc/self/io``
``read_bytes`` counts what the load itself reads (mmap page-ins included); peak RSS is reset (``clear_refs``) after
``malloc_trim(0)`` and read (``VmHWM``) after the load. On one host the ranks share the page cache, so ``read_bytes``
attributes a page to whichever rank faulted it first (mmap readahead included); the line above the table gives the
byte ranges each rank asks for, which is what it reads on a node of its own.
"""

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from benchmarks.meta_memory import CONFIG, _reset_peak, _status, llama_config

MODES = ("rank_zero", "own_parts")
EXPORTS = ("gathered", "streamed", "streamed_16MiB")
"""``streamed``: ``weights.export_chunk_bytes`` at its default (256 MiB, more than any tensor here: each gathered
whole); ``streamed_16MiB``: 16 MiB, so the embedding and head are gathered in regions."""
SMALL_CHUNK_BYTES = 16 * 2**20
EXPORT_SHARD_BYTES = 64 * 2**20
SIZES = {
    "245m": {},  # meta_memory.CONFIG as it is
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32),
}
"""Model sizes by name; the larger one is the 1.1B Llama of ``gpu_llama.py`` (2.2 GB in bf16)."""


def save_copy(directory: str, shard_bytes: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=shard_bytes)
    files = sorted(Path(directory).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved {params / 1e6:.1f}M params, {size / 2**30:.2f} GiB in {len(files)} files")


def _drop_from_page_cache(folder: Path) -> None:
    for file in folder.glob("*.safetensors"):
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def _io_bytes(field: str = "read_bytes") -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith(f"{field}:"))


def _export_gathered(model: Any, directory: Path, plan: Any) -> None:
    """The whole model on rank 0 first, then one write: what an export did before it streamed."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_mixedfsdp.checkpoint.export import write_safetensors

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        keep = set(plan.fp32_names)
        state = {n: t.to(torch.float32 if n in keep else torch.bfloat16) for n, t in state.items()}
        write_safetensors(state, directory, EXPORT_SHARD_BYTES)


def measure(load_from: str, repeats: int, quantize_base: Any = None) -> Dict[str, Any]:
    from lightning.fabric import Fabric
    from transformers import LlamaForCausalLM

    from lightning_mixedfsdp import load_full_weights
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.materialize.stream import tensor_targets
    from lightning_mixedfsdp.model.tensors import local_tensor

    folder = Path(load_from)
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    strategy = MixedFSDP2Strategy(init_meta_params=False, quantize_base=quantize_base)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(llama_config())
    if quantize_base:  # a frozen base (QLoRA's): its Linear weights are stored in 4 bits, read in bf16
        model.requires_grad_(False)
    model = fabric.setup(model)
    libc = ctypes.CDLL("libc.so.6")
    rows: Dict[str, List[List[float]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            fabric.barrier()
            _drop_from_page_cache(folder)
            libc.malloc_trim(0)
            fabric.barrier()
            start_rss, start_read, start = _reset_peak(), _io_bytes(), time.perf_counter()
            load_full_weights(model, folder, read=mode)
            fabric.barrier()
            seconds = time.perf_counter() - start
            row = [_io_bytes() - start_read, _status("VmHWM:") - start_rss, seconds]
            rows[mode].append(fabric.all_gather(torch.tensor(row, dtype=torch.float64)).tolist())
    exports: Dict[str, List[List[float]]] = {kind: [] for kind in EXPORTS}
    plan = fabric.strategy.plan_of(model)
    for repeat in range(repeats):
        for kind in EXPORTS if repeat % 2 == 0 else EXPORTS[::-1]:
            target = folder.parent / f"{folder.name}-export-{kind}"
            fabric.barrier()
            libc.malloc_trim(0)
            start_rss, start_written, start = _reset_peak(), _io_bytes("write_bytes"), time.perf_counter()
            if kind.startswith("streamed"):
                weights = fabric.strategy.config.weights
                default = weights.export_chunk_bytes
                weights.export_chunk_bytes = SMALL_CHUNK_BYTES if kind == "streamed_16MiB" else default
                try:
                    export = fabric.strategy.export_safetensors
                    export(model, target, torch.bfloat16, max_shard_bytes=EXPORT_SHARD_BYTES)
                finally:
                    weights.export_chunk_bytes = default
            else:
                _export_gathered(model, target, plan)
            os.sync()  # the page cache written back, so write_bytes counts the export's own bytes
            fabric.barrier()
            seconds = time.perf_counter() - start
            row = [_io_bytes("write_bytes") - start_written, _status("VmHWM:") - start_rss, seconds]
            exports[kind].append(fabric.all_gather(torch.tensor(row, dtype=torch.float64)).tolist())
    params = sum(p.numel() for p in model.parameters())
    # what each rank asks of storage when it reads its own shards (the file's bf16 bytes of its local tensors);
    # read_bytes above attributes a page to whichever rank faulted it first, readahead included, on a shared cache
    requested = sum(local_tensor(t).numel() * 2 for t in tensor_targets(model).values())
    requested_by_rank = fabric.all_gather(torch.tensor(float(requested), dtype=torch.float64)).tolist()
    result = {"params": params, "bytes": total, "loads": rows, "exports": exports, "requested": requested_by_rank}
    if fabric.global_rank == 0:
        print(f"{params / 1e6:.1f}M params, {total / 2**30:.2f} GiB of safetensors, 2 ranks, {repeats} of each")
        asked = ", ".join(f"rank {r}: {b / 2**30:.3f} GiB ({b / total:.2f})" for r, b in enumerate(requested_by_rank))
        print(f"own_parts asks storage for its shards' byte ranges: {asked}")
        print("| step | path | rank | bytes read or written (share of the model's files) | peak RSS growth | seconds |")
        print("|---|---|---|---|---|---|")
        for step, measured_by in (("load", rows), ("export", exports)):
            for path, measured in measured_by.items():
                for rank in range(2):
                    moved, growth, seconds = (statistics.median(m[rank][i] for m in measured) for i in range(3))
                    share = f"{moved / 2**30:.3f} GiB ({moved / total:.2f})"
                    print(f"| {step} | {path} | {rank} | {share} | {growth / 2**30:.2f} GiB | {seconds:.2f} |")
    return result


def main(argv: Any = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", default=None, help="write the bf16 copy here and stop")
    parser.add_argument("--shard-size", default="100MB", help="max_shard_size of the copy (5 files at 245M params)")
    parser.add_argument("--load", default=None, help="the copy --save wrote")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--size", choices=list(SIZES), default="245m")
    parser.add_argument("--quantize-base", choices=["nf4"], default=None, help="load into a frozen 4-bit base")
    args = parser.parse_args(argv)
    CONFIG.update(SIZES[args.size])
    if args.save:
        return save_copy(args.save, args.shard_size)
    return measure(args.load, args.repeats, args.quantize_base)


if __name__ == "__main__":
    main()
