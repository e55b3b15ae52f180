"""The fast paths on HF models, in one process: compile with no graph break and no recompile per layer, fp32 norms
that cost no activation memory and keep their math bit for bit, measured with dynamo's own counters and saved-tensor
hooks, each against the same model with every keep rule off (and plain FSDP2)."""

from typing import Any, Dict, List

import pytest
import torch

from tests.conftest import Launch
from tests.hf_models import tiny_config

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

LAYERS = 3
RULES_OFF = dict(keep_fp32_modules=[], keep_fp32_params=[], honor_hf_keep_in_fp32=False)


def _build(arch: str, **overrides: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    layer_types = {"layer_types": ["linear_attention", "full_attention", "linear_attention"]}
    extra = layer_types if arch == "qwen3_next" else {}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_config(arch, num_hidden_layers=LAYERS, use_cache=False, **extra, **overrides)
    )


def _device() -> torch.device:
    from lightning_mixedfsdp.testing import accelerator_for

    return torch.device("cuda", 0) if accelerator_for(1) == "cuda" else torch.device("cpu")


def _sharded(model: torch.nn.Module, fields: Dict[str, Any]) -> torch.nn.Module:
    from lightning_mixedfsdp import MixedFSDPConfig
    from lightning_mixedfsdp.mesh import build_parallel_meshes
    from lightning_mixedfsdp.model_setup import shard_model

    config = MixedFSDPConfig(**fields)
    device = _device()
    meshes = build_parallel_meshes(device.type, 1, 1, 1, 1)
    return shard_model(model.to(device), config, config.bulk_dtypes("bf16-true"), meshes, device).module


def _plain_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """Uniform bf16 FSDP2 by hand: the baseline a user's ``torch.compile`` is measured against."""
    from torch.distributed.fsdp import fully_shard

    model.to(device=_device(), dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _compiled_counts(model: torch.nn.Module, top_level: bool) -> Dict[str, int]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if top_level:
        model = torch.compile(model, backend="eager")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).to(_device())
    for _ in range(2):
        model(input_ids=tokens, labels=tokens).loss.backward()
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def _saved_bytes_and_grads(fields: Dict[str, Any]) -> Dict[str, Any]:
    model = _sharded(_build("llama", hidden_size=64, intermediate_size=128, head_dim=16), fields)
    tokens = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1)).to(_device())
    storages: Dict[Any, int] = {}
    held: List[torch.Tensor] = []  # no storage is freed and its address reused while counting

    def is_param(tensor: torch.Tensor) -> bool:
        return tensor.is_leaf and tensor.requires_grad

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # activations only: params and views of them (FSDP frees the unsharded ones after each layer and reuses
        # their addresses) are the same in every set-up; views of one tensor count once
        if not (is_param(tensor) or (tensor._base is not None and is_param(tensor._base))):
            held.append(tensor)
            storages[(tensor.data_ptr(), tensor.numel(), tensor.dtype)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {"bytes": sum(storages.values()), "loss": loss.detach().cpu(), "grads": grads}


def _scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    import functools

    import torch.distributed as dist

    # graphs and breaks are dynamo's, whatever compiles the graphs: the eager backend keeps this launch short;
    # inductor compiles in tests/composed/test_compose.py and tests/strategies/test_trainer.py
    nn_compile = torch.nn.Module.compile
    torch.nn.Module.compile = functools.partialmethod(nn_compile, backend="eager")  # type: ignore[method-assign]
    if _device().type == "cuda":
        torch.cuda.set_device(_device())
    dist.init_process_group("nccl" if _device().type == "cuda" else "gloo")
    out: Dict[str, Any] = {}
    for arch in ("llama", "qwen3_next"):
        for rules, fields in (("on", {}), ("off", RULES_OFF)):
            out[f"{arch}/unit/{rules}"] = _compiled_counts(_sharded(_build(arch), {**fields, "compile": True}), False)
    for rules, fields in (("on", {}), ("off", RULES_OFF)):
        out[f"llama/top/{rules}"] = _compiled_counts(_sharded(_build("llama"), fields), True)
    out["llama/top/plain_fsdp2"] = _compiled_counts(_plain_fsdp(_build("llama")), True)
    out["memory"] = {
        "default": _saved_bytes_and_grads({}),
        "recomputed": _saved_bytes_and_grads({"recompute_keep_fp32_modules": True}),
        "all_bf16": _saved_bytes_and_grads(RULES_OFF),
    }
    return out


LAUNCH = Launch(_scenarios, 1, timeout=420, with_folder=False)


@pytest.fixture(scope="module")
def outcome(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The one rank's results."""
    return results[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_per_unit_compile_has_no_break_and_no_recompile_per_layer(outcome: Dict[str, Any], arch: str) -> None:
    on, off = outcome[f"{arch}/unit/on"], outcome[f"{arch}/unit/off"]
    assert on["breaks"] == off["breaks"] == 0
    # N identical layers compile to one graph per kind of layer, as with every keep rule off
    assert on["graphs"] == off["graphs"] <= 2


def test_a_users_top_level_compile_breaks_only_where_plain_fsdp2_does(outcome: Dict[str, Any]) -> None:
    on, off, plain = outcome["llama/top/on"], outcome["llama/top/off"], outcome["llama/top/plain_fsdp2"]
    assert on == off == plain  # the breaks left are FSDP2's own root hooks


def test_fp32_norms_save_no_fp32_activations_and_keep_their_math_bit_for_bit(outcome: Dict[str, Any]) -> None:
    memory = outcome["memory"]
    default, recomputed, all_bf16 = memory["default"], memory["recomputed"], memory["all_bf16"]
    # the bf16 input is saved instead of its fp32 upcast: the bytes of uniform bf16 (1.11x when fp32 was saved)
    assert default["bytes"] <= 1.01 * all_bf16["bytes"]
    assert recomputed["bytes"] < 0.9 * all_bf16["bytes"]  # only the norms' inputs are kept
    # two ways to the same fp32 math: upcasting the saved bf16 input, recomputing the region
    assert torch.equal(recomputed["loss"], default["loss"])
    for name, grad in default["grads"].items():
        assert torch.equal(recomputed["grads"][name], grad), name
