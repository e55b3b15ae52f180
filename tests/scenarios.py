"""Training runs shared by the tests: the same code runs on N ranks (sharded) and in one process (reference)."""

import re
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.compat.torch import can_reduce_unused_params
from lightning_mixedfsdp.recipes.models.tiny_llama import RMSNorm, TinyLlama, TinyLlamaConfig, causal_lm_loss

LLAMA = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
BATCH_PER_RANK, SEQ = 2, 16


NEEDS_UNUSED_REDUCTION = pytest.mark.skipif(
    not can_reduce_unused_params(),
    reason=f"torch {torch.__version__} lacks FSDPModule.set_reduce_scatter_unused_params: a trainable projector is"
    " refused at setup (test_setup_refuses_a_trainable_projector_on_a_torch_without_unused_param_reduction)",
)
"""A test that trains a module some ranks' inputs skip (a VLM's projector): refused on torch 2.11, skipped there."""


def global_batch(world_size: int, step: int, vocab: int = LLAMA.vocab_size) -> torch.Tensor:
    """Arithmetic token sequences with random start and stride: learnable, so the loss must fall."""
    generator = torch.Generator().manual_seed(1000 + step)
    rows = BATCH_PER_RANK * world_size
    start = torch.randint(0, vocab, (rows, 1), generator=generator)
    stride = torch.randint(1, 4, (rows, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % vocab


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return batch.chunk(world_size)[rank]


def reference_model(
    config: TinyLlamaConfig, precision: str, keep_fp32_params: Optional[List[str]] = None, seed: int = 0
) -> nn.Module:
    """One process, with the dtypes the documented rules give (docs/dtypes.md), written out here (not asked of the
    planner): under ``bf16-true`` every param is bf16 except the RMSNorm weights (the default keep rule) and the
    params matching ``keep_fp32_params``, which stay fp32; a norm computes in fp32 and returns bf16. ``32-true``
    changes nothing."""
    if precision not in ("32-true", "bf16-true"):
        raise ValueError(f"the reference knows 32-true and bf16-true, not {precision!r}")
    torch.manual_seed(seed)
    model = TinyLlama(config)
    if precision == "32-true":
        return model
    patterns = [re.compile(p) for p in keep_fp32_params or []]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    kept = {id(p) for norm in norms for p in norm.parameters()}
    kept |= {id(p) for name, p in model.named_parameters() if any(pattern.search(name) for pattern in patterns)}
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(torch.float32 if id(param) in kept else torch.bfloat16)
    for norm in norms:
        norm.register_forward_pre_hook(lambda _m, args: tuple(a.float() for a in args))
        norm.register_forward_hook(lambda _m, _a, output: output.to(torch.bfloat16))
    return model


def train_reference(model: nn.Module, world_size: int, steps: int, lr: float = 1e-2) -> List[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens = global_batch(world_size, step)
        loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside Fabric's wrapper (and a top-level compile), so names carry no ``_forward_module.`` prefix."""
    from lightning_mixedfsdp.model.names import unwrap_model

    return unwrap_model(model)


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every param as a full plain tensor (gathers DTensors), by canonical name (wrapper prefixes stripped)."""
    from torch.distributed.tensor import DTensor

    from lightning_mixedfsdp.model.names import canonical_name

    model = unwrap(model)
    return {
        canonical_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def describe_params(model: nn.Module) -> Dict[str, Dict[str, Any]]:
    from torch.distributed.tensor import DTensor

    model = unwrap(model)
    out = {}
    for name, p in model.named_parameters():
        out[name] = {
            "dtype": p.dtype,
            "dtensor": isinstance(p, DTensor),
            "placements": tuple(repr(pl) for pl in p.placements) if isinstance(p, DTensor) else None,
            "grad_dtype": p.grad.dtype if p.grad is not None else None,
        }
    return out


MIXER = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, mixer_layers=(0, 1))
A_LOG = [r"A_log$"]


def make_fabric(world_size: int, precision: str = "32-true", strategy: Any = "mixed_fsdp2", **kwargs: Any) -> Any:
    """A launched Fabric on the test accelerator (``lightning_mixedfsdp.testing.accelerator_for``). The tests build
    their batches on the CPU; on another device every set-up module moves its tensor inputs there."""
    from lightning.fabric import Fabric

    import lightning_mixedfsdp  # noqa: F401  registers "mixed_fsdp2"
    from lightning_mixedfsdp.testing import accelerator_for

    class TestFabric(Fabric):
        def setup(self, module: nn.Module, *optimizers: Any, **setup_kwargs: Any) -> Any:
            wrapped = super().setup(module, *optimizers, **setup_kwargs)
            model = wrapped[0] if optimizers else wrapped
            if self.device.type != "cpu":
                model.register_forward_pre_hook(lambda _m, args, kw: self.to_device((args, kw)), with_kwargs=True)
            return wrapped

    fabric = TestFabric(
        accelerator=accelerator_for(world_size), devices=world_size, strategy=strategy, precision=precision, **kwargs
    )
    fabric.launch()
    return fabric


def train_hf_steps(
    fabric: Any, model: nn.Module, optimizer: Any, steps: int, batches: int = 0, start: int = 0
) -> List[float]:
    """HF causal-LM steps ``start`` to ``steps`` on this rank's slice of the test batches (cycling through
    ``batches`` of them when set); the per-step local losses."""
    world, rank = fabric.world_size, fabric.global_rank
    losses = []
    for step in range(start, steps):
        tokens = rank_slice(global_batch(world, step % batches if batches else step), rank, world)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def clipped_hf_steps(
    fabric: Any, model: nn.Module, rank: int, steps: range, optimizer: Any = None, world: int = 2, vocab: int = 128
) -> Dict[str, Any]:
    """HF causal-LM steps ``steps`` on this rank's slice of the test batches, clipped to norm 1, with AdamW over the
    trainable params unless ``optimizer`` is given; the per-step local losses and the optimizer."""
    if optimizer is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(trainable, lr=1e-3))
    losses = []
    for step in steps:
        tokens = rank_slice(global_batch(world, step, vocab=vocab), rank, world)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "optimizer": optimizer}


def full_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    model = unwrap(model)
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def grad_norm_of(grads: Dict[str, torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads.values()])).item()


def mixer_grad_reference(world_size: int, step: int = 0) -> Dict[str, torch.Tensor]:
    """Single-process grads of the mixer model on the whole global batch, same dtypes as the plan."""
    model = reference_model(MIXER, "bf16-true", A_LOG)
    tokens = global_batch(world_size, step)
    causal_lm_loss(model(tokens), tokens).backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters()}


def moe_inputs(rank: int, dim: int = 16) -> Dict[str, torch.Tensor]:
    """Rank 0 routes every token to expert 0, so expert 1 gets no grad there; rank 1 uses both experts."""
    generator = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(2, 6, dim, generator=generator)
    route = torch.zeros(2, 6, dtype=torch.long) if rank == 0 else torch.arange(12).view(2, 6) % 2
    return {"x": x, "route": route}


class Normalizer(nn.Module):
    """``(x - std_bias) * std_scale`` with fp32 buffers: left in fp32 it promotes bf16 activations back to fp32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("std_bias", torch.linspace(-0.5, 0.5, dim))
        self.register_buffer("std_scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.std_bias) * self.std_scale


class FrozenTower(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.normalizer = Normalizer(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalizer(self.norm(self.embed(x)))


class Projector(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x)))


class TowerModel(nn.Module):
    """A frozen (vision-like) tower feeding a trainable bf16 projector; each is an FSDP unit."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.tower = FrozenTower(dim)
        self.projector = Projector(dim)
        self.tower.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(x))


TOWER_UNITS = ["FrozenTower", "Projector"]


class BufferedLlama(TinyLlama):
    """The mixer model plus a persistent buffer, so checkpoints carry params, buffers and optimizer states."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__(config)
        self.register_buffer("logit_scale", torch.linspace(0.9, 1.1, config.vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        return logits * self.logit_scale.to(logits.dtype)


def snapshot(model: nn.Module, optimizer: Any) -> Dict[str, torch.Tensor]:
    """Every param, buffer and optimizer-state tensor as a full tensor (rank 0 holds the optimizer part)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = unwrap(model)
    out = {f"param/{k}": v for k, v in full_params(inner).items()}
    out.update({f"buffer/{k}": v.detach().clone() for k, v in inner.named_buffers()})
    optim = get_optimizer_state_dict(inner, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for fqn, state in optim.get("state", {}).items():
        for key, value in state.items():
            out[f"optim/{fqn}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def assert_same_state(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))[:10]
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, (key, got[key].dtype, value.dtype)
        assert torch.equal(got[key], value), key
