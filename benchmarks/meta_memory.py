"""Peak host memory (RSS) growth per rank while setting up a 245M-param HF Llama built on the meta device, under
``Fabric(strategy="mixed_fsdp2", precision="bf16-true")`` on 2 ranks: with meta init, and with
``init_meta_params=False`` followed by ``load_full_weights`` of a saved copy.

    python -m benchmarks.meta_memory --save /tmp/llama245m                 # once: a bf16 safetensors copy
    python -m benchmarks.meta_memory --load /tmp/llama245m --scenario meta  # each in its own launch (2 processes)
    python -m benchmarks.meta_memory --load /tmp/llama245m --scenario load

It uses public entry points only, so the same file measures an older checkout (``PYTHONPATH=<old tree>``). Peak RSS
is reset (``/proc/self/clear_refs``) right before setup and read (``VmHWM``) after it, per rank; one scenario per
launch, so no memory freed by another scenario is reused.
"""

import argparse
import os
import time
from typing import Any, Dict

import torch

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=14,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
)


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def save_copy(directory: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).to(torch.bfloat16)
    model.save_pretrained(directory)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params to {directory}")


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS:")


SCENARIOS = {
    "meta": ("meta init (init_meta_params=True)", True),
    "load": ("load_full_weights of the saved copy", False),
}


def measure(load_from: str, scenario: str) -> None:
    from lightning.fabric import Fabric
    from transformers import LlamaForCausalLM

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    try:
        from lightning_mixedfsdp import load_full_weights
    except ImportError:  # before the layout change
        from lightning_mixedfsdp.loading import load_full_weights

    rows: Dict[str, Any] = {}
    for name, init in (SCENARIOS[scenario],):
        strategy = MixedFSDP2Strategy(init_meta_params=init)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true")
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = LlamaForCausalLM(llama_config())
        params = sum(p.numel() for p in model.parameters())
        start_rss = _reset_peak()
        start = time.perf_counter()
        model = fabric.setup(model)
        if not init:
            load_full_weights(model, load_from)
        seconds = time.perf_counter() - start
        growth = _status("VmHWM:") - start_rss
        shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        gathered = fabric.all_gather(torch.tensor([growth, shard], dtype=torch.float64))
        rows[name] = {"growth": gathered[:, 0].tolist(), "shard": gathered[:, 1].tolist(), "seconds": seconds}
        del model
    if fabric.global_rank == 0:
        package = os.path.dirname(__import__("lightning_mixedfsdp").__file__)
        print(f"{params / 1e6:.1f}M params, bf16-true, 2 ranks, package {package}")
        print("| setup | rank 0 peak RSS growth | rank 1 peak RSS growth | shard per rank | seconds |")
        print("|---|---|---|---|---|")
        for name, row in rows.items():
            growth, shard = row["growth"], row["shard"]
            print(
                f"| {name} | {growth[0] / 2**30:.2f} GB | {growth[1] / 2**30:.2f} GB | {shard[0] / 2**30:.2f} GB |"
                f" {row['seconds']:.1f} |"
            )


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", default=None, help="write the bf16 safetensors copy here and stop")
    parser.add_argument("--load", default=None, help="the copy --save wrote")
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="meta")
    args = parser.parse_args(argv)
    if args.save:
        save_copy(args.save)
    else:
        measure(args.load, args.scenario)


if __name__ == "__main__":
    main()
