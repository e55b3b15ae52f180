"""Muon on sharded params (``apply/muon.py``): each matrix orthogonalised whole on its owner rank, 2 ranks against one
process with the same batches (an MLP weight of 67 rows, split 34/33): the user's ``torch.optim.Muon`` beside AdamW
through Fabric, ``muon_with_adamw`` through Fabric and the Trainer with clipping, the momentum buffer held as the
param's shard, the collectives of a step, a DCP save and resume, bf16-true on an HF Llama with fp32 norms, and each
refusal on every rank. The exchange's row split and owners, and ``MuonWithAdamW`` in one process against torch's own
optimizers, run here."""

from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.apply.muon import MuonWithAdamW, muon_with_adamw, split_for_muon
from lightning_mixedfsdp.apply.muon_exchange import owners, row_counts
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss
from tests.conftest import Launch
from tests.scenarios import full_params, global_batch, make_fabric, rank_slice, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD, STEPS = 2, 3
CONFIG = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=67)
"""Each block's w1 and w3 are 67 x 32: 34 rows on rank 0, 33 on rank 1."""
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
EXACT = 1e-5
BF16_FLIPS = 5e-4
"""Where a last-bit difference in the gradients' scale reaches Muon's bf16 Newton-Schulz (see the Trainer's test)."""


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLlama(CONFIG)


def _torch_optimizers(model: nn.Module) -> Tuple[torch.optim.Muon, torch.optim.AdamW]:
    """A user's pair: torch's Muon over the blocks' matrices, torch's AdamW over the rest."""
    muon, rest = split_for_muon(model)
    return torch.optim.Muon([p for _, p in muon], **MUON), torch.optim.AdamW([p for _, p in rest], **ADAMW)


def _step(model: nn.Module, optimizers: Any, step: int, world: int, rank: int, backward: Any) -> float:
    tokens = rank_slice(global_batch(world, step), rank, world)
    loss = causal_lm_loss(model(tokens), tokens)
    backward(loss)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def _one_process(pair: bool, clip: float = 0.0) -> Dict[str, torch.Tensor]:
    """The reference: one process, torch's Muon + AdamW or ``muon_with_adamw``, each step's gradient accumulated over
    the ranks' batches (each loss over the rank count) on one thread, as each rank computes its own: Muon's bf16
    Newton-Schulz turns a last-bit difference in a gradient into a visible one, so the sums must match."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model()
        optimizers = _torch_optimizers(model) if pair else (muon_with_adamw(model, adamw_lr=1e-2, **MUON),)
        for step in range(STEPS):
            for rank in range(WORLD):
                tokens = rank_slice(global_batch(WORLD, step), rank, WORLD)
                (causal_lm_loss(model(tokens), tokens) / WORLD).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _user_pair(rank: int, folder: Path) -> Dict[str, Any]:
    from lightning_mixedfsdp.diagnostics.collectives import count_collectives

    fabric = make_fabric(WORLD)
    model = fabric.setup_module(_model())
    muon, adamw = fabric.setup_optimizers(*_torch_optimizers(model))
    counts = None
    for step in range(STEPS):
        if step == 1:
            fabric.save(folder / "checkpoint", {"model": model, "muon": muon, "adamw": adamw})
        if step == 0:
            with count_collectives() as counted:
                _step(model, (), step, WORLD, rank, fabric.backward)
                muon.step()
            counts = dict(counted.calls)
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
        else:
            _step(model, (muon, adamw), step, WORLD, rank, fabric.backward)
    inner = unwrap(model)
    w1 = inner.layers[0].feed_forward.w1.weight
    buffer = muon.state[w1]["momentum_buffer"]
    out = {
        "after": full_params(model),
        "counts": counts,
        "buffer": (type(buffer).__name__, buffer.placements == w1.placements, buffer.to_local().shape),
        "w1_local": tuple(w1.to_local().shape),
    }
    # a fresh model and optimizers resumed from step 1 repeat the last steps
    again = fabric.setup_module(_model(seed=5))
    muon_again, adamw_again = fabric.setup_optimizers(*_torch_optimizers(again))
    fabric.load(folder / "checkpoint", {"model": again, "muon": muon_again, "adamw": adamw_again})
    for step in range(1, STEPS):
        _step(again, (muon_again, adamw_again), step, WORLD, rank, fabric.backward)
    out["resumed"] = full_params(again)
    return out


def _combined(rank: int) -> Dict[str, Any]:
    fabric = make_fabric(WORLD)
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(muon_with_adamw(model, adamw_lr=1e-2, **MUON))
    for step in range(STEPS):
        _step(model, (optimizer,), step, WORLD, rank, fabric.backward)
    return {"after": full_params(model), "muon": optimizer.muon_names, "adamw": optimizer.adamw_names}


def _fabric_clipped(rank: int) -> Dict[str, Any]:
    """``_combined`` with Fabric's clipping at the Trainer's ``gradient_clip_val``: what the Trainer must repeat."""
    fabric = make_fabric(WORLD)
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(muon_with_adamw(model, adamw_lr=1e-2, **MUON))
    for step in range(STEPS):
        tokens = rank_slice(global_batch(WORLD, step), rank, WORLD)
        fabric.backward(causal_lm_loss(model(tokens), tokens))
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {"after": full_params(model)}


def _hf_llama_bf16(rank: int) -> Dict[str, Any]:
    from tests.hf_models import tiny_model

    fabric = make_fabric(WORLD, "bf16-true")
    model = fabric.setup_module(tiny_model("llama"))
    optimizer = fabric.setup_optimizers(muon_with_adamw(model, lr=0.02, adamw_lr=1e-3))
    losses = []
    for step in range(4):
        tokens = rank_slice(global_batch(WORLD, step % 2), rank, WORLD)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    dtypes = {n: p.dtype for n, p in unwrap(model).named_parameters()}
    return {"losses": losses, "dtypes": dtypes, "muon": optimizer.muon_names}


def _refusals(rank: int) -> Dict[str, str]:
    fabric = make_fabric(WORLD)
    model = fabric.setup_module(_model())
    inner = unwrap(model)
    w1, w3 = inner.layers[0].feed_forward.w1.weight, inner.layers[0].feed_forward.w3.weight
    norm = inner.layers[0].attention_norm.weight
    cases = {
        "one_d": lambda: _with_group(torch.optim.Muon([w1]), {"params": [norm]}),
        "two_groups": lambda: _in_two_groups(torch.optim.Muon([{"params": [w1]}, {"params": [w3]}]), w1),
        "foreign_option": lambda: torch.optim.Muon([{"params": [w1], "amsgrad": True}]),
    }
    out = {}
    for case, build in cases.items():
        try:
            fabric.setup_optimizers(build())
        except ValueError as error:
            out[case] = str(error)
    bf16 = make_fabric(WORLD, "bf16-true", strategy=_strategy(bf16_updates="stochastic"))
    stochastic = bf16.setup_module(_model())
    try:
        bf16.setup_optimizers(muon_with_adamw(stochastic))
    except ValueError as error:
        out["bf16_updates"] = str(error)
    return out


def _strategy(**fields: Any) -> Any:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    return MixedFSDP2Strategy(**fields)


def _with_group(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> torch.optim.Optimizer:
    optimizer.add_param_group(group)  # torch checks a Muon's params are 2-D only in its constructor
    return optimizer


def _in_two_groups(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.optim.Optimizer:
    optimizer.param_groups[1]["params"].append(param)  # torch refuses it at construction, not after
    return optimizer


def _trainer(rank: int) -> Dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.testing import accelerator_for

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            tokens = rank_slice(global_batch(WORLD, self.global_step), self.global_rank, WORLD)
            return causal_lm_loss(self.model(tokens), tokens)

        def configure_optimizers(self) -> Any:
            return muon_with_adamw(self.model, adamw_lr=1e-2, **MUON)

    module = Module()
    trainer = pl.Trainer(
        accelerator=accelerator_for(WORLD), devices=WORLD, strategy="mixed_fsdp2", precision="32-true",
        max_steps=STEPS, gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(torch.zeros(STEPS * WORLD, 1), batch_size=1))
    return {"after": full_params(module.model)}


def _scenarios(rank: int, world: int, folder: str) -> Dict[str, Any]:
    return {
        "pair": _user_pair(rank, Path(folder)),
        "combined": _combined(rank),
        "trainer": _trainer(rank),
        "fabric_clipped": _fabric_clipped(rank),
        "hf_bf16": _hf_llama_bf16(rank),
        "refusals": _refusals(rank),
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=300)


def _assert_close(after: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor], tolerance: float) -> None:
    assert after.keys() == reference.keys()
    for name, value in reference.items():
        assert (after[name] - value).abs().max().item() <= tolerance, name


def test_torch_muon_beside_adamw_on_two_ranks_equals_one_process(results: list) -> None:
    reference = _one_process(pair=True)
    for result in results:
        _assert_close(result["pair"]["after"], reference, EXACT)
    untouched = _model()
    w1 = "layers.0.feed_forward.w1.weight"
    assert not torch.allclose(reference[w1], untouched.state_dict()[w1])  # the steps moved it


def test_the_momentum_buffer_is_held_as_the_params_shard(results: list) -> None:
    for rank, result in enumerate(results):
        kind, same_placements, local_shape = result["pair"]["buffer"]
        assert kind == "DTensor" and same_placements
        assert tuple(local_shape) == result["pair"]["w1_local"] == ((34, 32) if rank == 0 else (33, 32))


def test_one_all_to_all_pair_per_dtype_bucket_and_no_gather_in_the_step(results: list) -> None:
    for result in results:
        counts = result["pair"]["counts"]
        # forward and backward: FSDP's gathers and reduce-scatters; Muon's step: one fp32 bucket, two all-to-alls
        assert counts["all_to_all_single"] == 2
        assert counts.get("all_gather", 0) == 0


def test_a_dcp_save_and_resume_repeats_the_straight_run_bitwise(results: list) -> None:
    for result in results:
        straight, resumed = result["pair"]["after"], result["pair"]["resumed"]
        assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_muon_with_adamw_through_fabric_equals_one_process(results: list) -> None:
    reference = _one_process(pair=False)
    for result in results:
        _assert_close(result["combined"]["after"], reference, EXACT)
    muon, rest = split_for_muon(_model())
    assert results[0]["combined"]["muon"] == [n for n, _ in muon]
    assert results[0]["combined"]["adamw"] == [n for n, _ in rest]


def test_muon_with_adamw_in_the_trainer_with_clipping_repeats_fabric_bitwise_and_one_process_closely(
    results: list,
) -> None:
    """The Trainer's ``gradient_clip_val`` clips through the strategy as ``fabric.clip_gradients`` does: the same
    params to the bit. Against one process the clip coefficient is summed in another order (two ranks' shards against
    torch's norm of norms), and torch's bf16 Newton-Schulz turns its last bit into flips of the orthogonalised update
    on some CPUs (one 2-core machine: 3e-4 after 3 steps, another 0): the one-process bound is what a 1e-7 relative
    change of the coefficient moves (3.1e-4), against 1.6e-3 without the clip."""
    reference = _one_process(pair=False, clip=0.5)
    unclipped = _one_process(pair=False)
    for result in results:
        trainer, fabric = result["trainer"]["after"], result["fabric_clipped"]["after"]
        assert all(torch.equal(trainer[name], fabric[name]) for name in fabric)
        _assert_close(trainer, reference, BF16_FLIPS)
        assert max((trainer[n] - unclipped[n]).abs().max().item() for n in unclipped) > 2 * BF16_FLIPS


def test_bf16_true_hf_llama_trains_with_its_norms_fp32(results: list) -> None:
    for result in results:
        out = result["hf_bf16"]
        assert out["losses"][2] < out["losses"][0] and out["losses"][3] < out["losses"][1]
        norms = [n for n in out["dtypes"] if "norm" in n]
        assert norms and all(out["dtypes"][n] == torch.float32 for n in norms)
        assert all(out["dtypes"][n] == torch.bfloat16 for n in out["muon"])
        assert "model.layers.0.self_attn.q_proj.weight" in out["muon"]
        assert not any("norm" in n or "embed" in n or "lm_head" in n for n in out["muon"])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "one_d",
            r"'layers.0.attention_norm.weight' \(32,\) is 1-D: Muon orthogonalises 2-D weights; give it to AdamW",
        ),
        ("two_groups", r"'layers.0.feed_forward.w1.weight' is in param groups 0 and 1; give each param one group"),
        ("foreign_option", r"a Muon param group sets amsgrad=True, which Muon does not have; remove it"),
        ("bf16_updates", r"dtypes.bf16_updates='stochastic' writes AdamW's, Adam's and SGD's updates, not Muon's"),
    ],
)
def test_what_muon_cannot_take_is_refused_on_every_rank(results: list, case: str, message: str) -> None:
    import re

    for result in results:
        error = result["refusals"][case]
        assert error.startswith("MixedFSDP2Strategy: torch.optim.") or error.startswith("MixedFSDP2Strategy: lightning")
        assert re.search(message, error), error


# -- in one process


def test_rows_split_as_fsdp2_splits_them_and_owners_balance_the_work() -> None:
    assert row_counts(67, 2) == [34, 33]
    assert row_counts(3, 4) == [1, 1, 1, 0]
    assert row_counts(5, 4) == [2, 2, 1, 0]
    shapes = [(64, 64), (64, 64), (128, 64), (32, 32)]
    assert owners(shapes, 2) == [1, 1, 0, 0]  # the largest first, each to the least loaded (ties: the lowest)


def test_muon_with_adamw_in_one_process_equals_torchs_muon_beside_adamw_bitwise() -> None:
    combined, pair = _one_process(pair=False), _one_process(pair=True)
    assert all(torch.equal(combined[n], pair[n]) for n in pair)


def test_the_split_gives_muon_the_blocks_matrices_and_adamw_the_rest() -> None:
    muon, rest = split_for_muon(_model())
    assert [n for n, _ in muon] == [
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                  "feed_forward.w3", "feed_forward.w2")
    ]  # fmt: skip
    assert {n for n, _ in rest} == {"tok_embeddings.weight", "norm.weight", "output.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(2) for n in ("attention_norm", "ffn_norm")
    }


def test_muon_with_adamw_reports_its_split() -> None:
    from lightning_mixedfsdp.apply.muon import split_summary

    optimizer = muon_with_adamw(_model())
    assert isinstance(optimizer, MuonWithAdamW)
    assert split_summary(optimizer) == "Muon: 14 matrices, 0.0M params; AdamW: 7 tensors, 0.0M params"
