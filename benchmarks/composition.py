"""Step time and activation memory with activation checkpointing and torch.compile on and off: uniform bf16 FSDP2
against mixed_fsdp2 on the same model; and the training state of peft LoRA under bf16-mixed.

    python -m benchmarks.composition                            # L=4, dim 256, 2 ranks, CPU/gloo or CUDA/NCCL
    python -m benchmarks.composition --layers 2 --dim 64 --steps 3 --modes plain ac

Each mode holds both set-ups in one launch and times one step of each in turn (round-robin), so drift cannot
favour one. Activation memory is the bytes autograd saves for backward in one step (saved-tensor hooks: the same
figure on CPU and CUDA). LoRA: param + grad + AdamW bytes per rank of an HF Llama with LoRA on q/v, with the frozen
base pinned to bf16 (the default) and with it kept in fp32 (``pin_frozen_modules=False``).
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from benchmarks.baselines import shard_uniform
from benchmarks.common import device_type, init_process_group, synchronize, training_state_bytes
from lightning_mixedfsdp import MixedFSDPConfig
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss
from lightning_mixedfsdp.testing import run_distributed

MODES = {
    "plain": {},
    "ac": {"activation_checkpointing": "full"},
    "compile": {"compile": True},
    "ac+compile": {"activation_checkpointing": "full", "compile": True},
}


def uniform_bf16(model: TinyLlama, mesh: Any, ac: bool, compile_blocks: bool) -> nn.Module:
    """The hand-written uniform-dtype FSDP2 (norms bf16), with torchtitan's AC -> compile -> FSDP order."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = model.to(torch.bfloat16)
    for index, block in enumerate(model.layers):
        block = checkpoint_wrapper(block) if ac else block
        if compile_blocks:
            block.compile()
        model.layers[index] = block
    return shard_uniform(model, mesh, torch.bfloat16, torch.bfloat16)


def saved_for_backward_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = causal_lm_loss(model(tokens), tokens)
    loss.backward()
    return total[0]


def measure_modes(
    rank: int, world_size: int, modes: List[str], layers: int, dim: int, steps: int, warmup: int, kind: str
) -> Dict[str, Any]:
    device = init_process_group(kind)
    meshes = build_parallel_meshes(kind, 1, world_size, 1, world_size)
    config = TinyLlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, hidden_dim=4 * dim)
    tokens = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(rank)).to(device)
    sync = synchronize(kind)
    results: Dict[str, Any] = {}
    for mode in modes:
        fields = MODES[mode]
        torch.manual_seed(0)
        models = {"uniform bf16": uniform_bf16(TinyLlama(config).to(device), meshes.fsdp, **_flags(fields))}
        torch.manual_seed(0)
        mixed = MixedFSDPConfig(**fields)
        models["mixed_fsdp2"] = shard_model(
            TinyLlama(config).to(device), mixed, mixed.bulk_dtypes("bf16-true"), meshes, device
        ).module
        optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
        times: Dict[str, List[float]] = {name: [] for name in models}
        saved = {}
        for step in range(warmup + steps):
            for name, model in models.items():
                sync()
                start = time.perf_counter()
                if step == 0:
                    saved[name] = saved_for_backward_bytes(model, tokens)
                else:
                    causal_lm_loss(model(tokens), tokens).backward()
                optimizers[name].step()
                optimizers[name].zero_grad()
                sync()
                if step >= warmup:
                    times[name].append(time.perf_counter() - start)
        results[mode] = {
            name: {"step_ms": statistics.median(times[name]) * 1e3, "saved_mib": saved[name] / 2**20} for name in models
        }
    return results


def _flags(fields: Dict[str, Any]) -> Dict[str, bool]:
    checkpointing = fields.get("activation_checkpointing", "none") != "none"
    return {"ac": checkpointing, "compile_blocks": fields.get("compile", False)}


def lora_memory(rank: int, world_size: int, kind: str) -> Dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    device = init_process_group(kind)
    meshes = build_parallel_meshes(kind, 1, world_size, 1, world_size)
    llama = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8
    )
    out = {}
    for name, pin in (("base pinned to bf16 (default)", True), ("base kept in fp32", False)):
        torch.manual_seed(0)
        model = get_peft_model(LlamaForCausalLM(llama), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        config = MixedFSDPConfig(pin_frozen_modules=pin)
        model = shard_model(model.to(device), config, config.bulk_dtypes("bf16-mixed"), meshes, device).module
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(rank)).to(device)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        state = training_state_bytes(model, optimizer)
        params = sum(_local_bytes(p) for p in model.parameters())
        out[name] = {"params_mib": params / 2**20, "state_mib": state["actual"] / 2**20}
    return out


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def print_tables(modes: Dict[str, Any], lora: Dict[str, Any]) -> None:
    print("| mode | uniform bf16 step ms | mixed step ms | mixed/uniform | saved for backward MiB (uniform/mixed) |")
    print("|---|---|---|---|---|")
    for mode, row in modes.items():
        uniform, mixed = row["uniform bf16"], row["mixed_fsdp2"]
        ratio = mixed["step_ms"] / uniform["step_ms"]
        print(
            f"| {mode} | {uniform['step_ms']:.1f} | {mixed['step_ms']:.1f} | {ratio:.3f}"
            f" | {uniform['saved_mib']:.1f} / {mixed['saved_mib']:.1f} |"
        )
    print("\n| peft LoRA r=8 on q/v, bf16-mixed | params MiB/rank | params+grads+AdamW MiB/rank |")
    print("|---|---|---|")
    for name, row in lora.items():
        print(f"| {name} | {row['params_mib']:.2f} | {row['state_mib']:.2f} |")


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    kind = device_type(args.device)
    modes = run_distributed(
        measure_modes, 2, args.modes, args.layers, args.dim, args.steps, args.warmup, kind, timeout=3000
    )[0]
    lora = run_distributed(lora_memory, 2, kind, timeout=600)[0]
    print(f"device: {kind}, 2 ranks, TinyLlama L={args.layers} dim={args.dim}, seq 256 x batch 4 per rank")
    print_tables(modes, lora)
    results = {"modes": modes, "lora": lora}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
