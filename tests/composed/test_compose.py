"""Composes with the stacks users run, on 2 ranks with replicated fp32 params (A_log beside dt_bias, fp32 norms):
activation checkpointing (ours, torch's checkpoint_wrapper, HF gradient checkpointing, torch.utils.checkpoint in a
forward), per-block and top-level torch.compile, two forwards before one backward, tied embeddings. Each is compared
with the same run without it."""

from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import torch
from torch import nn

from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import (
    A_LOG,
    MIXER,
    full_grads,
    full_params,
    global_batch,
    make_fabric,
    rank_slice,
    reference_model,
    train_hf_steps,
    unwrap,
)

WORLD = 2
STEPS = 3
FABRIC_VARIANTS = {
    "none": {},
    "ac_full": {"activation_checkpointing": "full"},
    "ac_selective": {"activation_checkpointing": "selective:2"},
    "ac_user_wrapper": {},
    "compile": {"compile": True},
    "ac_and_compile": {"activation_checkpointing": "full", "compile": True},
}
LR = 1e-2
# compile fuses bf16 kernels differently from eager: the same math, other roundings. Losses agree within a quarter
# of a bf16 ulp (2^-8 relative). AdamW moves every element by about +-lr per step whatever its grad's size, so an
# element whose grad is near zero may step the other way: at most 2 * lr * steps apart, while the mean difference
# stays far below one step.
COMPILE_LOSS_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}
COMPILE_MAX_PARAM_DIFF, COMPILE_MEAN_PARAM_DIFF = 2 * LR * STEPS, 1e-3


def _wrap_blocks(model: nn.Module, _mesh: Any) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block)
    return model


class _CheckpointedMixer(nn.Module):
    """The mixer called through ``torch.utils.checkpoint`` from its block's forward: a part of a unit recomputed."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.mixer, x, use_reentrant=False)


def _graphs_captured() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) if "stats" in counters else 0


def _train_mixer(
    rank: int, variant: str, model: Optional[nn.Module] = None, export_to: Optional[Path] = None
) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fields = {"keep_fp32_params": A_LOG, **FABRIC_VARIANTS.get(variant, {})}
    parallelize = {"parallelize_fn": _wrap_blocks} if variant == "ac_user_wrapper" else {}
    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(**fields, **parallelize))
    if model is None:
        torch.manual_seed(0)
        model = TinyLlama(MIXER)
    graphs_before = _graphs_captured()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for step in range(STEPS):
        tokens = rank_slice(global_batch(WORLD, step), rank, WORLD)
        loss = causal_lm_loss(model(tokens), tokens)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    plan = fabric.strategy.plan_of(model)
    if export_to is not None:
        fabric.strategy.export_safetensors(model, export_to)
    return {
        "losses": losses,
        "after": full_params(model),
        "graphs": _graphs_captured() - graphs_before,
        "replicated": plan.replicated_params,
        "names": sorted(plan.params),
    }


def _checkpointed_mixer_model() -> nn.Module:
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(MIXER)
    for layer in model.layers:
        layer.attention = _CheckpointedMixer(layer.attention)
    return model


def _top_level_compile(rank: int, folder: Path) -> Dict[str, Any]:
    """``fabric.setup(torch.compile(model))``: Fabric sets up the model inside and compiles it again; the plan and
    the export speak of the user's names."""
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama

    torch.manual_seed(0)
    compiled = torch.compile(TinyLlama(MIXER))
    return _train_mixer(rank, "top_level_compile", model=compiled, export_to=folder / "export")


def _hf_gradient_checkpointing(rank: int, enabled: bool) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    model = tiny_model("qwen3_next")
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=[r"A_log$"]))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = train_hf_steps(fabric, model, optimizer, STEPS)
    plan = fabric.strategy.plan_of(model)
    return {"losses": losses, "after": full_params(model), "replicated": plan.replicated_params}


def _two_forwards_one_backward(rank: int) -> Dict[str, Any]:
    """DPO-style: two forwards (chosen, rejected), one backward of their combined loss."""
    from lightning_mixedfsdp.diagnostics.collectives import count_collectives
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=A_LOG))
    torch.manual_seed(0)
    model = fabric.setup(TinyLlama(MIXER))
    warm = rank_slice(global_batch(WORLD, 5), rank, WORLD)
    fabric.backward(causal_lm_loss(model(warm), warm))  # FSDP's lazy init is not counted
    model.zero_grad()
    first, second = (rank_slice(global_batch(WORLD, s), rank, WORLD) for s in (0, 1))
    with count_collectives() as counts:
        loss = causal_lm_loss(model(first), first) + causal_lm_loss(model(second), second)
        fabric.backward(loss)
    grads = {n: g for n, g in full_grads(model).items() if n.endswith("A_log")}
    return {"grads": grads, "all_reduce": counts.by_kind().get("all_reduce", 0)}


def _tied_embeddings(rank: int, folder: Path) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    def build(seed: int) -> nn.Module:
        return tiny_model("llama", seed=seed, tie_word_embeddings=True)

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy())
    model = fabric.setup(build(0))
    inner = unwrap(model)
    tied_after_setup = inner.lm_head.weight is inner.model.embed_tokens.weight
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = train_hf_steps(fabric, model, optimizer, STEPS)
    tied_after_training = inner.lm_head.weight is inner.model.embed_tokens.weight
    saved = full_params(model)
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    fresh = fabric.setup(build(1))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=LR))
    fabric.load(folder, {"model": fresh, "optimizer": fresh_optimizer})
    fresh_inner = unwrap(fresh)
    tied_after_load = fresh_inner.lm_head.weight is fresh_inner.model.embed_tokens.weight
    return {
        "tied": (tied_after_setup, tied_after_training, tied_after_load),
        "losses": losses,
        "names": sorted(fabric.strategy.plan_of(model).params),
        "saved": saved,
        "loaded": full_params(fresh),
        "lm_head": fresh_inner.lm_head.weight.full_tensor(),
    }


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {f"fabric/{v}": _train_mixer(rank, v) for v in FABRIC_VARIANTS}
    checkpointed = _train_mixer(rank, "none", model=_checkpointed_mixer_model())
    checkpointed["after"] = {n.replace(".mixer.", "."): v for n, v in checkpointed["after"].items()}
    out["fabric/checkpoint_in_forward"] = checkpointed
    out["fabric/top_level_compile"] = _top_level_compile(rank, Path(folder))
    out["hf/no_gc"] = _hf_gradient_checkpointing(rank, enabled=False)
    out["hf/gc"] = _hf_gradient_checkpointing(rank, enabled=True)
    out["two_forwards"] = _two_forwards_one_backward(rank)
    out["tied"] = _tied_embeddings(rank, Path(folder) / "tied")
    return out


LAUNCH = Launch(_scenarios, WORLD, timeout=600)


def _assert_same_run(got: Dict[str, Any], expected: Dict[str, Any], exact: bool) -> None:
    if exact:
        assert got["losses"] == expected["losses"]
        for name, value in expected["after"].items():
            assert torch.equal(got["after"][name], value), name
    else:
        torch.testing.assert_close(got["losses"], expected["losses"], **COMPILE_LOSS_TOLERANCE)
        for name, value in expected["after"].items():
            difference = (got["after"][name].float() - value.float()).abs()
            assert difference.max() <= COMPILE_MAX_PARAM_DIFF, (name, difference.max().item())
            assert difference.mean() <= COMPILE_MEAN_PARAM_DIFF, (name, difference.mean().item())


@pytest.mark.parametrize("variant", ["ac_full", "ac_selective", "ac_user_wrapper", "checkpoint_in_forward"])
def test_activation_checkpointing_is_bit_equal_to_the_run_without_it(results: list, variant: str) -> None:
    for result in results:
        _assert_same_run(result[f"fabric/{variant}"], result["fabric/none"], exact=True)
        assert result[f"fabric/{variant}"]["replicated"]  # A_log and the norms are replicated in every variant


@pytest.mark.parametrize("variant", ["compile", "ac_and_compile", "top_level_compile"])
def test_compile_matches_eager_within_bf16_rounding_and_really_compiles(results: list, variant: str) -> None:
    for result in results:
        _assert_same_run(result[f"fabric/{variant}"], result["fabric/none"], exact=False)
        assert result[f"fabric/{variant}"]["graphs"] > 0, "dynamo captured no graph: compile fell back to eager"


def test_checkpoint_and_compile_wrappers_do_not_change_names(results: list) -> None:
    names = results[0]["fabric/none"]["names"]
    for variant in ("ac_full", "ac_user_wrapper", "compile", "ac_and_compile", "top_level_compile"):
        assert results[0][f"fabric/{variant}"]["names"] == names, variant
        assert set(results[0][f"fabric/{variant}"]["after"]) == set(names), variant


def test_a_compiled_model_exports_with_canonical_names_and_fp32_keeps(results: list, folder: Path) -> None:
    from safetensors.torch import load_file

    exported = load_file(str(folder / "export" / "model.safetensors"))
    assert set(results[0]["fabric/top_level_compile"]["names"]) <= set(exported)
    assert exported["layers.0.attention.A_log"].dtype == exported["layers.0.ffn_norm.weight"].dtype == torch.float32
    assert exported["layers.0.feed_forward.w1.weight"].dtype == torch.bfloat16


def test_ranks_agree_in_every_variant(results: list) -> None:
    for key in results[0]:
        if "after" in results[0][key]:
            for name, value in results[0][key]["after"].items():
                assert torch.equal(value, results[1][key]["after"][name]), (key, name)


def test_hf_gradient_checkpointing_is_bit_equal_with_a_replicated_a_log(results: list) -> None:
    for result in results:
        assert any(n.endswith("A_log") for n in result["hf/gc"]["replicated"])
        _assert_same_run(result["hf/gc"], result["hf/no_gc"], exact=True)


def test_two_forwards_before_one_backward_reduce_replicated_grads_once_and_equal_the_reference(results: list) -> None:
    from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss

    for result in results:
        assert result["two_forwards"]["all_reduce"] == 1
    model = reference_model(MIXER, "bf16-true", A_LOG)
    loss = 0.0
    for rank in range(WORLD):  # the mean over ranks of each rank's two-forward loss
        for step in (0, 1):
            tokens = rank_slice(global_batch(WORLD, step), rank, WORLD)
            loss = loss + causal_lm_loss(model(tokens), tokens) / WORLD
    loss.backward()
    reference = {n: p.grad.float() for n, p in model.named_parameters() if n.endswith("A_log")}
    for result in results:
        for name, grad in result["two_forwards"]["grads"].items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-3, atol=1e-5, msg=name)


def test_tied_embeddings_hold_through_setup_training_and_a_checkpoint_round_trip(results: list) -> None:
    for result in results:
        out = result["tied"]
        assert out["tied"] == (True, True, True)
        assert "lm_head.weight" not in out["names"]  # one param, one name
        assert out["losses"][-1] < out["losses"][0]
        for name, value in out["saved"].items():
            assert torch.equal(out["loaded"][name], value), name
        assert torch.equal(out["lm_head"], out["saved"]["model.embed_tokens.weight"])
