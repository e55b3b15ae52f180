"""Per-rank training state and step time of peft LoRA (r=16 on every projection) on an HF Llama, three ways, side by
side in one launch (interleaved, bf16-true, 2 ranks):

- ``bf16 base``: the frozen base in bf16 (what ``mixed_fsdp2`` does without ``quantize_base``);
- ``nf4``: ``quantize_base="nf4"``, the frozen Linear weights in torchao's NF4 (4 bits and block scales);
- ``nf4 + offload``: ``quantize_base="nf4", offload="cpu"``: the sharded params, grads and AdamW states on the host.

Bytes are what each rank stores (a 4-bit weight by its parts: data, scalers, factors, mean): params, grads and
AdamW states, split into the frozen base's share and the rest, and where they live (device or host). On a GPU it
also reports the peak GPU memory of the steps. The step is forward, backward, clip and AdamW.

    python -m benchmarks.qlora_memory                        # CPU, 2 ranks, the 245M Llama of meta_memory.py
    python -m benchmarks.qlora_memory --accelerator cuda --devices 1 --size 1.1b
"""

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch

from benchmarks.meta_memory import CONFIG

SETUPS = {
    "bf16 base": {},
    "nf4": {"quantize_base": "nf4"},
    "nf4 + offload": {"quantize_base": "nf4", "offload": "cpu"},
}
SIZES = {
    "245m": {},  # meta_memory.CONFIG as it is
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def stored_bytes(tensor: torch.Tensor) -> int:
    """What a rank stores for ``tensor``: its local shard, a 4-bit weight by its parts."""
    from lightning_mixedfsdp.compat.torchao import is_nf4
    from lightning_mixedfsdp.model.quantized import nf4_parts
    from lightning_mixedfsdp.model.tensors import local_tensor

    local = local_tensor(tensor)
    parts = nf4_parts(local) if is_nf4(local) else (local,)
    return sum(p.numel() * p.element_size() for p in parts)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """Per-rank bytes: the frozen base's params, the rest (adapters, norms, embeddings and head), grads, AdamW
    states, and of all of them what lives on the host."""
    params = list(model.parameters())
    base = [p for n, p in model.named_parameters() if "base_layer" in n]
    base_ids = {id(p) for p in base}
    states = [t for p in params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0]
    grads = [p.grad for p in params if p.grad is not None]
    every = [*params, *grads, *states]
    return {
        "base": sum(stored_bytes(p) for p in base),
        "other params": sum(stored_bytes(p) for p in params if id(p) not in base_ids),
        "grads": sum(stored_bytes(g) for g in grads),
        "AdamW": sum(stored_bytes(s) for s in states),
        "on host": sum(stored_bytes(t) for t in every if _on_host(t)),
    }


def _on_host(tensor: torch.Tensor) -> bool:
    from lightning_mixedfsdp.model.tensors import local_tensor

    return local_tensor(tensor).device.type == "cpu"


def measure(size: str, accelerator: str, devices: int, steps: int, repeats: int, seq: int) -> Dict[str, Any]:
    from lightning.fabric import Fabric
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    config = LlamaConfig(**{**CONFIG, **SIZES[size]})
    results: Dict[str, Dict[str, List[float]]] = {name: {} for name in SETUPS}
    fabric = None
    for repeat in range(repeats):
        for name in list(SETUPS) if repeat % 2 == 0 else list(SETUPS)[::-1]:
            fabric = Fabric(
                accelerator=accelerator,
                devices=devices,
                strategy=MixedFSDP2Strategy(**SETUPS[name]),
                precision="bf16-true",
            )
            fabric.launch()
            torch.manual_seed(0)
            with fabric.init_module(empty_init=True):
                model = get_peft_model(
                    LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
                )
            model = fabric.setup(model)
            optimizer = fabric.setup_optimizers(
                torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            )
            if accelerator == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            for step in range(steps + 1):
                tokens = torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(step))
                tokens = tokens.to(fabric.device)
                fabric.barrier()
                start = time.perf_counter()
                loss = model(input_ids=tokens, labels=tokens).loss
                fabric.backward(loss)
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                if accelerator == "cuda":
                    torch.cuda.synchronize()
                if step:  # the first step initialises FSDP and the optimizer
                    times.append(time.perf_counter() - start)
            measured = {**state_bytes(model, optimizer), "step s": statistics.median(times)}
            if accelerator == "cuda":
                measured["peak GPU"] = torch.cuda.max_memory_allocated()
            for key, value in measured.items():
                results[name].setdefault(key, []).append(value)
            del model, optimizer
    assert fabric is not None
    medians = {name: {key: statistics.median(v) for key, v in values.items()} for name, values in results.items()}
    if fabric.global_rank == 0:
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters()) if size == "245m" else None
        world = fabric.world_size
        print(f"Llama {size} ({params / 1e6:.0f}M params) " if params else f"Llama {size} ", end="")
        print(f"+ LoRA r=16 on {len(TARGETS)} projections, bf16-true, {world} ranks on {accelerator}, seq {seq}")
        keys = [k for k in medians["bf16 base"] if k != "step s"]
        print("| setup | " + " | ".join(f"{k} per rank" for k in keys) + " | step s |")
        print("|---" * (len(keys) + 2) + "|")
        for name, values in medians.items():
            cells = " | ".join(f"{values[k] / 2**20:.1f} MiB" for k in keys)
            print(f"| {name} | {cells} | {values['step s']:.3f} |")
        base = medians["bf16 base"]
        state = ("base", "other params", "grads", "AdamW")
        for name in ("nf4", "nf4 + offload"):
            values = medians[name]
            ratios = [
                f"base {values['base'] / base['base']:.3f}x",
                f"training state {sum(values[k] for k in state) / sum(base[k] for k in state):.3f}x",
                f"step {values['step s'] / base['step s']:.2f}x",
            ]
            if accelerator == "cuda":
                on_device = sum(values[k] for k in state) - values["on host"]
                ratios.append(f"state on the GPU {on_device / (sum(base[k] for k in state) - base['on host']):.3f}x")
                ratios.append(f"peak GPU {values['peak GPU'] / base['peak GPU']:.3f}x")
            print(f"{name} against bf16 base: " + ", ".join(ratios))
    return medians


def main(argv: Any = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="245m")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    return measure(args.size, args.accelerator, args.devices, args.steps, args.repeats, args.seq)


if __name__ == "__main__":
    main()
