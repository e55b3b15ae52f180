"""Shared by the benchmark scripts: device choice, process groups, model configurations, state accounting."""

import os
import resource
from typing import Any, Callable, Dict

import torch
from torch import nn

from benchmarks.baselines import shard_each_norm_separately, shard_uniform
from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.apply.applier import apply_dtypes
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.model_setup import shard_model
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

CONFIGS = {
    "a": "uniform all-bf16 FSDP2 (norms bf16: fast, numerically wrong)",
    "b": "uniform fp32 storage + bf16 compute (the common default)",
    "c": "per-norm fully_shard with an fp32 policy (hand-written today)",
    "d": "mixed_fsdp2, norms grouped and sharded",
    "e": "mixed_fsdp2, small fp32 params replicated (default)",
}


def device_type(requested: str = "auto") -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def init_process_group(kind: str) -> torch.device:
    """Plain torch.distributed (no Lightning), so the loop measures FSDP and nothing else."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return torch.device(kind, rank) if kind == "cuda" else torch.device("cpu")


def build_sharded(config: str, model_config: TinyLlamaConfig, kind: str, device: torch.device) -> nn.Module:
    """One of the five configurations, sharded over all ranks of the default group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    meshes = build_parallel_meshes(kind, 1, world, 1, world)
    torch.manual_seed(0)
    model = TinyLlama(model_config).to(device)
    if config == "a":
        return shard_uniform(model.to(torch.bfloat16), meshes.fsdp, torch.bfloat16, torch.bfloat16)
    if config == "b":
        return shard_uniform(model, meshes.fsdp, torch.bfloat16, torch.float32)
    if config == "c":
        apply_dtypes(model, plan_sharding(model, MixedFSDPConfig(), "bf16-true"))
        return shard_each_norm_separately(model, meshes.fsdp)
    fields = {"replicate_below_bytes": 0} if config == "d" else {}
    mixed = MixedFSDPConfig(**fields)
    return shard_model(model, mixed, mixed.bulk_dtypes("bf16-true"), meshes, device).module


def local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Per-rank bytes of params, grads and optimizer states, and the ideal: the full sizes / world size."""
    import torch.distributed as dist

    params = list(model.parameters())
    state = [t for p in params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0]
    actual = sum(local_bytes(p) for p in params)
    actual += sum(local_bytes(p.grad) for p in params if p.grad is not None)
    actual += sum(local_bytes(t) for t in state)
    full = sum(p.numel() * p.element_size() for p in params)  # DTensor numel is the global size
    states_per_param = sum(1 for p in params if p.grad is not None and p in optimizer.state)
    ideal = full * (2 + (2 if states_per_param else 0)) // dist.get_world_size()
    return {"actual": actual, "ideal": ideal}


def peak_memory_mib(kind: str) -> float:
    if kind == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def synchronize(kind: str) -> Callable[[], Any]:
    return torch.cuda.synchronize if kind == "cuda" else (lambda: None)
