"""Tensor parallelism from a Hugging Face model's own plan (``config.base_model_tp_plan``) when no ``parallelize_fn``
is given, on 2 ranks at tensor_parallel_size=2: a Llama and a Mistral train as one process does (32-true, the same
batch on both ranks: every loss and every param after 3 SGD steps within fp32 rounding), their planned projections
split (q_proj by output rows, o_proj by input columns) and the rest whole; under bf16-true the norms stay fp32. A
model without a plan, a plan with a style not applied here (Qwen3's norms) and heads the split cannot divide are
refused on every rank before any collective, naming the fix, and so is float8 (torchao's own TP styles)."""

import logging
from typing import Any, Dict, List

import pytest
import torch

from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import MIXER, BufferedLlama, full_params, make_fabric, unwrap

pytestmark = pytest.mark.compat  # transformers' plans on both ends of its range

WORLD, STEPS = 2, 3
ARCHITECTURES = ("llama", "mistral")


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(5))


def _train(model: Any, optimizer: Any, backward: Any) -> List[float]:
    batch = _batch(unwrap(model).config.vocab_size)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _split(rank: int, world_size: int, architecture: str) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world_size, "32-true", MixedFSDP2Strategy(tensor_parallel_size=2, print_report=True))
    said: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_mixedfsdp").addHandler(handler)
    try:
        model = fabric.setup(tiny_model(architecture))
    finally:
        logging.getLogger("lightning_mixedfsdp").removeHandler(handler)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    layer = unwrap(model).model.layers[0]
    placements = {
        name: [("shard", p.dim) if p.is_shard() else str(p) for p in param.placements]  # type: ignore[attr-defined]
        if isinstance(param, DTensor)
        else None
        for name, param in (("q_proj", layer.self_attn.q_proj.weight), ("o_proj", layer.self_attn.o_proj.weight),
                            ("norm", layer.input_layernorm.weight))
    }  # fmt: skip
    local_rows = layer.self_attn.q_proj.weight.to_local().shape[0]
    losses = _train(model, optimizer, fabric.backward)
    split = [line for line in said if line.startswith("tensor parallel 2 by the model's")]
    return {"losses": losses, "params": full_params(model), "placements": placements, "q_rows": local_rows,
            "said": split}  # fmt: skip


def _bf16_dtypes(rank: int, world_size: int) -> Dict[str, str]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world_size, "bf16-true", MixedFSDP2Strategy(tensor_parallel_size=2))
    model = unwrap(fabric.setup(tiny_model("llama")))
    return {name: str(param.dtype) for name, param in model.named_parameters()}


def _refusals(rank: int, world_size: int) -> Dict[str, str]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    cases = {
        "no_plan": (lambda: BufferedLlama(MIXER), {}),
        "qwen3": (lambda: tiny_model("qwen3"), {}),
        "heads": (lambda: tiny_model("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48), {}),
        "float8": (lambda: tiny_model("llama"), {"float8": "tensorwise", "float8_emulate": True}),
    }
    out = {}
    for case, (build, options) in cases.items():
        fabric = make_fabric(world_size, "32-true", MixedFSDP2Strategy(tensor_parallel_size=2, **options))
        try:
            fabric.setup(build())
            out[case] = "set up"
        except ValueError as error:
            out[case] = str(error)
    return out


def _scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {arch: _split(rank, world_size, arch) for arch in ARCHITECTURES}
    out["bf16"] = _bf16_dtypes(rank, world_size)
    out["refusals"] = _refusals(rank, world_size)
    return out


LAUNCH = Launch(_scenarios, WORLD, with_folder=False)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_models_own_plan_splits_it_and_it_trains_as_one_process(results: list, architecture: str) -> None:
    reference = tiny_model(architecture)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = _train(reference, optimizer, lambda loss: loss.backward())
    for rank in range(WORLD):
        got = results[rank][architecture]
        # (data parallel, tensor parallel): FSDP's dim over one rank, then the split; the norm on FSDP's alone
        placements = got["placements"]
        assert placements["q_proj"][-1] == ("shard", 0) and placements["o_proj"][-1] == ("shard", 1), placements
        assert len(placements["q_proj"]) == len(placements["o_proj"]) == 2, placements
        assert placements["norm"] is None or len(placements["norm"]) == 1, placements
        assert got["q_rows"] == reference.model.layers[0].self_attn.q_proj.weight.shape[0] // 2
        assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        expected = {name: p.detach() for name, p in reference.named_parameters()}
        assert got["params"].keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert losses[-1] < losses[0]
    # rank 0 says the split beside the dtype report: 2 layers x (q, k, v, gate, up) colwise, (o, down) rowwise
    assert results[0][architecture]["said"] == [
        "tensor parallel 2 by the model's `base_model_tp_plan`: 10 colwise (`ColwiseParallel`), 4 rowwise"
        " (`RowwiseParallel`); every other param whole on each"
    ]
    assert results[1][architecture]["said"] == []


def test_under_bf16_true_the_split_projections_are_bf16_and_the_norms_fp32(results: list) -> None:
    dtypes = results[0]["bf16"]
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "torch.bfloat16"
    assert dtypes["model.layers.0.input_layernorm.weight"] == dtypes["model.norm.weight"] == "torch.float32"


def test_a_model_without_a_plan_is_refused_naming_parallelize_fn(results: list) -> None:
    for rank in range(WORLD):
        message = results[rank]["refusals"]["no_plan"]
        assert message.startswith("mixed_fsdp2 (BufferedLlama): tensor_parallel_size=2 without a split in")
        assert "every tensor-parallel rank would compute the same whole layers" in message
        assert "Split it in `parallelize_fn`" in message and "or set tensor_parallel_size=1" in message


def test_a_plan_style_not_applied_here_is_refused_by_name(results: list) -> None:
    for rank in range(WORLD):
        message = results[rank]["refusals"]["qwen3"]
        assert "uses the styles ['replicated_with_grad_allreduce']" in message, message
        assert "Pass a `parallelize_fn` that splits this model" in message


def test_heads_the_split_cannot_divide_are_refused(results: list) -> None:
    for rank in range(WORLD):
        message = results[rank]["refusals"]["heads"]
        assert "does not divide the model's num_attention_heads=3" in message, message
        assert "num_key_value_heads=1" in message


def test_float8_with_the_models_own_plan_is_refused_naming_torchaos_styles(results: list) -> None:
    for rank in range(WORLD):
        message = results[rank]["refusals"]["float8"]
        assert "tensor_parallel_size=2 with float8: the model's own plan splits with torch's" in message, message
        assert "Float8ColwiseParallel and Float8RowwiseParallel, or turn float8 off" in message
