"""Bytes read from storage, peak host memory and wall time per rank while ``load_full_weights`` fills a sharded HF
Llama (``init_meta_params=False``, bf16-true) from a ``save_pretrained`` folder, 2 CPU ranks: rank 0 reading and
streaming everything (``read="rank_zero"``) against every rank reading its own shards (``read="own_parts"``, torch
DCP's ``HuggingFaceStorageReader``), alternated in one launch.

    python -m benchmarks.load_io --save /tmp/llama245m            # once: a bf16 copy in 5 safetensors files
    python -m benchmarks.load_io --load /tmp/llama245m --repeats 2
    python -m benchmarks.load_io --size 1.1b --save /tmp/llama1b --shard-size 500MB
    python -m benchmarks.load_io --size 1.1b --load /tmp/llama1b

Before each load every file is dropped from the page cache (``posix_fadvise(DONTNEED)``), so ``/proc/self/io``
``read_bytes`` counts what the load itself reads (mmap page-ins included); peak RSS is reset (``clear_refs``) after
``malloc_trim(0)`` and read (``VmHWM``) after the load.
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


def _read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


def measure(load_from: str, repeats: int) -> Dict[str, Any]:
    from lightning.fabric import Fabric
    from transformers import LlamaForCausalLM

    from lightning_mixedfsdp import load_full_weights
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    folder = Path(load_from)
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    fabric = Fabric(
        accelerator="cpu", devices=2, strategy=MixedFSDP2Strategy(init_meta_params=False), precision="bf16-true"
    )
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(llama_config())
    model = fabric.setup(model)
    libc = ctypes.CDLL("libc.so.6")
    rows: Dict[str, List[List[float]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            fabric.barrier()
            _drop_from_page_cache(folder)
            libc.malloc_trim(0)
            fabric.barrier()
            start_rss, start_read, start = _reset_peak(), _read_bytes(), time.perf_counter()
            load_full_weights(model, folder, read=mode)
            fabric.barrier()
            seconds = time.perf_counter() - start
            row = [_read_bytes() - start_read, _status("VmHWM:") - start_rss, seconds]
            rows[mode].append(fabric.all_gather(torch.tensor(row, dtype=torch.float64)).tolist())
    params = sum(p.numel() for p in model.parameters())
    result = {"params": params, "bytes": total, "rows": rows}
    if fabric.global_rank == 0:
        print(f"{params / 1e6:.1f}M params, {total / 2**30:.2f} GiB of safetensors, 2 ranks, {repeats} loads per mode")
        print("| read | rank | bytes read (share of the files) | peak RSS growth | seconds |")
        print("|---|---|---|---|---|")
        for mode, measured in rows.items():
            for rank in range(2):
                read = statistics.median(m[rank][0] for m in measured)
                growth = statistics.median(m[rank][1] for m in measured)
                seconds = statistics.median(m[rank][2] for m in measured)
                share = f"{read / 2**30:.3f} GiB ({read / total:.2f})"
                print(f"| {mode} | {rank} | {share} | {growth / 2**30:.2f} GiB | {seconds:.2f} |")
    return result


def main(argv: Any = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", default=None, help="write the bf16 copy here and stop")
    parser.add_argument("--shard-size", default="100MB", help="max_shard_size of the copy (5 files at 245M params)")
    parser.add_argument("--load", default=None, help="the copy --save wrote")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--size", choices=list(SIZES), default="245m")
    args = parser.parse_args(argv)
    CONFIG.update(SIZES[args.size])
    if args.save:
        return save_copy(args.save, args.shard_size)
    return measure(args.load, args.repeats)


if __name__ == "__main__":
    main()
