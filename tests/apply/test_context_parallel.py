"""Context parallelism against one process on the full sequence, same seed: HF Llama and Qwen3 (qk-norms) from small
configs with their fp32 norms, ``32-true`` and ``bf16-true``, on CP 2 (2 ranks) and shard 2 x CP 2 (4 ranks); three
AdamW steps on batches whose first third is labelled -100. Losses and every param's grad (full tensors) equal within
fp32 rounding under ``32-true``, within bf16's own distance from fp32 under ``bf16-true``. Attention left local fails
the comparison (the check can fail). Composed with activation checkpointing, HSDP and emulated float8; a checkpoint
saved with CP 2 loads without it and the reverse; every refusal.

A user's own model, as people write it: attention through a name bound at import (``from torch.nn.functional import
scaled_dot_product_attention``) reaches the ring and equals one process; attention written out (``q @ k.T``, a mask,
softmax) is refused on every rank, never trained on each rank's part of the sequence alone."""

import importlib.util
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.testing import run_distributed
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import full_grads, full_params, make_fabric

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

SEQ, ROWS, VOCAB, STEPS = 32, 2, 64, 3
FLOAT8 = dict(float8="tensorwise", float8_emulate=True, float8_skip_small=False)
FLOAT8_AVAILABLE = importlib.util.find_spec("torchao") is not None
MODELS, FLAGS = ("llama", "qwen3"), ("32-true", "bf16-true")


def batch(step: int, rows: int) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = ids.clone()
    labels[:, : SEQ // 3] = -100
    return {"input_ids": ids, "labels": labels}


def _train(fabric: Any, model: torch.nn.Module, data_rank: int, data_ranks: int) -> Dict[str, Any]:
    """``STEPS`` AdamW steps; this rank's rows of every global batch (context-parallel ranks share theirs)."""
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out: Dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        rows = batch(step, ROWS * data_ranks)
        mine = {k: v.chunk(data_ranks)[data_rank] for k, v in rows.items()}
        loss = model(**mine).loss
        fabric.backward(loss)
        if step == 0:
            out["grads"] = {canonical_name(name): grad for name, grad in full_grads(model).items()}
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = full_params(model)
    return out


class UserAttention(nn.Module):
    """Causal self-attention as a user writes it: through the name bound at import, or written out."""

    def __init__(self, dim: int, heads: int, written_out: bool) -> None:
        super().__init__()
        self.heads, self.written_out = heads, written_out
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, dim = x.shape
        q, k, v = self.qkv(x).view(rows, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if self.written_out:
            scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
            future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        else:
            attended = scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(rows, length, dim))


class UserModel(nn.Module):
    """A user's own causal LM: pre-norm blocks of ``UserAttention`` and an MLP; ``written_out`` lists the layers
    whose attention is written out."""

    def __init__(self, written_out: tuple = (), layers: int = 2, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attentions = nn.ModuleList(UserAttention(dim, 4, i in written_out) for i in range(layers))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for norm, attention, mlp in zip(self.norms, self.attentions, self.mlps, strict=True):
            x = x + attention(norm(x))
            x = x + mlp(x)
        return self.head(x)


class SelfAttn(UserAttention):
    """Written-out attention under a class name the strategy cannot count as attention."""


def _user_model(written_out: tuple = (), unnamed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = UserModel(written_out)
    if unnamed:
        for layer, attention in enumerate(model.attentions):
            attention.__class__ = SelfAttn if layer in written_out else UserAttention
    return model


def _train_user_model(world: int, model: nn.Module, context_parallel_size: int) -> Dict[str, Any]:
    """The documented loop for a model that is not an HF causal LM: ``split`` the ids and the labels shifted over the
    whole sequence, ``loss`` the whole sequence's mean from this rank's part."""
    from lightning_mixedfsdp.apply.context_parallel import shifted_labels
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world, "32-true", MixedFSDP2Strategy(context_parallel_size=context_parallel_size))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    context = fabric.strategy.context_parallel
    out: Dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        rows = batch(step, ROWS)
        labels = shifted_labels(rows["labels"])
        ids, local_labels = context.split(rows["input_ids"], labels)
        summed = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), local_labels.flatten(), reduction="sum")
        loss = context.loss(summed, (labels != -100).sum())
        fabric.backward(loss)
        if step == 0:
            out["grads"] = {canonical_name(name): grad for name, grad in full_grads(model).items()}
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    return out


def _user_models(world: int) -> Dict[str, Any]:
    """The user's model with attention through a bound name trains; written-out attention is refused, counted
    (class names ending in Attention) or not."""

    def error(action: Any) -> str:
        try:
            action()
        except ValueError as failure:
            return str(failure)
        return "no error"

    out: Dict[str, Any] = {"bound": _train_user_model(world, _user_model(), 2)}
    out["written_out_one_layer"] = error(lambda: _train_user_model(world, _user_model(written_out=(1,)), 2))
    out["written_out_unnamed"] = error(lambda: _train_user_model(world, _user_model((0, 1), unnamed=True), 2))
    return out


def _rotate_methods(world: int) -> List[str]:
    """Two runs in one process with different rotate methods: each pass runs with its own run's."""
    from lightning_mixedfsdp.compat.torch import ring_rotate_method
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    seen = []
    for rotate in ("alltoall", "allgather", "alltoall"):
        fabric = make_fabric(
            world, "32-true", MixedFSDP2Strategy(context_parallel_size=2, context_parallel_rotate=rotate)
        )
        model = fabric.setup(tiny_model("llama"))
        model(**batch(0, ROWS)).loss.backward()
        seen.append(ring_rotate_method())
    return seen


def _run(world: int, flag: str, model_type: str, data_ranks: int, **options: Any) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world, flag, MixedFSDP2Strategy(**options))
    model = fabric.setup(tiny_model(model_type))
    mesh = fabric.strategy.meshes.data_parallel
    return _train(fabric, model, mesh.get_local_rank(), data_ranks)


def _two_ranks(rank: int, world: int, folder: str) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    out: Dict[str, Any] = {}
    for model in MODELS:
        for flag in FLAGS:
            out[model, flag] = _run(world, flag, model, 1, context_parallel_size=2)
    out["ac"] = _run(world, "32-true", "llama", 1, context_parallel_size=2, activation_checkpointing="full")
    if FLOAT8_AVAILABLE:
        out["float8"] = _run(world, "bf16-true", "llama", 1, context_parallel_size=2, **FLOAT8)
    out["user"] = _user_models(world)
    out["rotate"] = _rotate_methods(world)
    out["checkpoints"] = _checkpoint_round_trips(world, Path(folder))
    out["refusals"] = _refusals(world, MixedFSDP2Strategy)
    return out


def _checkpoint_round_trips(world: int, folder: Path) -> Dict[str, bool]:
    """A DCP checkpoint saved with CP 2 loads into CP 1 (shard 2), and one saved with CP 1 into CP 2, to equal
    params."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    equal = {}
    for saved, loaded in ((2, 1), (1, 2)):
        fabric = make_fabric(world, "bf16-true", MixedFSDP2Strategy(context_parallel_size=saved))
        model = fabric.setup(tiny_model("qwen3", seed=saved))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        fabric.save(folder / f"cp{saved}", {"model": model, "optimizer": optimizer})
        expected = full_params(model)
        target = make_fabric(world, "bf16-true", MixedFSDP2Strategy(context_parallel_size=loaded))
        other = target.setup(tiny_model("qwen3", seed=7))
        other_optimizer = target.setup_optimizers(torch.optim.AdamW(other.parameters(), lr=1e-2))
        target.load(folder / f"cp{saved}", {"model": other, "optimizer": other_optimizer})
        got = full_params(other)
        equal[f"{saved}->{loaded}"] = all(torch.equal(got[n], expected[n]) for n in expected)
    return equal


def _refusals(world: int, strategy: Any) -> Dict[str, str]:
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    def error(action: Any) -> str:
        try:
            action()
        except ValueError as failure:
            return str(failure)
        return "no error"

    fabric = make_fabric(world, "32-true", strategy(context_parallel_size=2))
    mixer = TinyLlama(TinyLlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2, hidden_dim=32, mixer_layers=[1]))
    out = {"mixer": error(lambda: fabric.setup(mixer))}
    out["eager"] = error(lambda: fabric.setup(tiny_model("llama", attn_implementation="eager")))
    out["sliding"] = error(lambda: fabric.setup(tiny_model("qwen3", use_sliding_window=True, sliding_window=8)))
    model = fabric.setup(tiny_model("llama"))
    ids = batch(0, ROWS)["input_ids"]
    padded = torch.ones_like(ids)
    padded[:, -3:] = 0
    out["padding"] = error(lambda: model(input_ids=ids, attention_mask=padded))
    out["length"] = error(lambda: model(input_ids=ids[:, :30]))
    out["embeds"] = error(lambda: model(inputs_embeds=torch.zeros(ROWS, SEQ, 16)))
    query = torch.randn(ROWS, 2, SEQ // 2, 8)
    fabric.strategy.context_parallel.activate()  # as split(...) does before a forward
    out["not_causal"] = error(lambda: torch.nn.functional.scaled_dot_product_attention(query, query, query))
    # the refused pass ended: attention is local again (plain causal attention, written out here), and the model
    # trains on
    local = torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
    future = torch.ones(SEQ // 2, SEQ // 2, dtype=torch.bool).triu(1)
    written = (query @ query.transpose(-2, -1) / math.sqrt(8)).masked_fill(future, float("-inf")).softmax(-1) @ query
    out["local_after"] = str(torch.allclose(local, written, atol=1e-6))
    model(**batch(0, ROWS)).loss.backward()
    return out


def _four_ranks(rank: int, world: int) -> Dict[str, Any]:
    return {
        "shard_cp": _run(world, "32-true", "llama", 2, context_parallel_size=2),
        "shard_cp_bf16": _run(world, "bf16-true", "qwen3", 2, context_parallel_size=2),
        "hsdp_cp": _run(world, "32-true", "qwen3", 2, context_parallel_size=2, data_parallel_replicate_size=2),
    }


LAUNCH = Launch(_two_ranks, 2, timeout=300)


@pytest.fixture(scope="module")
def reference() -> Dict[Any, Any]:
    """One process on the full sequences of the 2-rank runs' batches."""
    return run_distributed(_reference_one, 1, timeout=200)[0]


def _reference_one(rank: int, world: int) -> Dict[Any, Any]:
    out = {(model, flag): _run(1, flag, model, 1) for model in MODELS for flag in FLAGS}
    out["user"] = _train_user_model(1, _user_model(), 1)
    if FLOAT8_AVAILABLE:
        out["llama", "float8"] = _run(1, "bf16-true", "llama", 1, **FLOAT8)
    return out


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((got.double() - expected).norm() / expected.norm().clamp_min(1e-12))


def _assert_close(got: Dict[str, Any], expected: Dict[str, Any], tolerance: float) -> None:
    assert got["losses"] == pytest.approx(expected["losses"], rel=tolerance)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        assert _relative(got["grads"][name], grad) < tolerance, name


def _assert_within_bf16(got: Dict[str, Any], bf16: Dict[str, Any], fp32: Dict[str, Any]) -> None:
    """As far from the fp32 run as one bf16 process is (a bound of 3x its distance, at least 2 %)."""
    for index, loss in enumerate(got["losses"]):
        own = abs(bf16["losses"][index] - fp32["losses"][index])
        assert abs(loss - fp32["losses"][index]) <= max(3 * own, 0.02 * abs(fp32["losses"][index])), index
    for name, grad in fp32["grads"].items():
        own = _relative(bf16["grads"][name], grad)
        assert _relative(got["grads"][name], grad) <= max(3 * own, 0.02), name


@pytest.mark.parametrize("model", MODELS)
def test_cp2_equals_one_process_within_fp32_rounding(results: list, reference: Dict, model: str) -> None:
    for result in results:
        _assert_close(result[model, "32-true"], reference[model, "32-true"], 1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_cp2_in_bf16_is_within_bf16s_own_distance_from_fp32(results: list, reference: Dict, model: str) -> None:
    for result in results:
        _assert_within_bf16(result[model, "bf16-true"], reference[model, "bf16-true"], reference[model, "32-true"])
        assert result[model, "bf16-true"]["params"]["model.norm.weight"].dtype == torch.float32


def test_the_loss_is_the_whole_sequences_on_every_rank(results: list) -> None:
    assert results[0]["llama", "32-true"]["losses"] == results[1]["llama", "32-true"]["losses"]


def test_a_users_model_with_attention_bound_at_import_equals_one_process(results: list, reference: Dict) -> None:
    for result in results:
        _assert_close(result["user"]["bound"], reference["user"], 1e-5)


def test_written_out_attention_is_refused_on_every_rank(results: list) -> None:
    for result in results:
        counted = result["user"]["written_out_one_layer"]
        assert "reached ring attention 1 times, but the model has 2 attention modules (attentions.0, attentions.1)" in (
            counted
        )
        assert "scaled_dot_product_attention(q, k, v, is_causal=True)" in counted
        unnamed = result["user"]["written_out_unnamed"]
        assert "reached ring attention 0 times, but the model must reach it at least once" in unnamed
    for key in ("written_out_one_layer", "written_out_unnamed"):  # every rank refuses the same
        assert results[0]["user"][key] == results[1]["user"][key]


def test_each_run_rings_with_its_own_rotate_method(results: list) -> None:
    for result in results:
        assert result["rotate"] == ["alltoall", "allgather", "alltoall"]


@pytest.mark.skipif(not FLOAT8_AVAILABLE, reason="float8 needs torchao (pip install 'lightning-mixedfsdp[float8]')")
def test_cp_composes_with_float8(results: list, reference: Dict) -> None:
    """Emulated float8 scales activations over the tokens a rank holds: within 3x float8's own distance from bf16."""
    for result in results:
        _assert_within_bf16(result["float8"], reference["llama", "float8"], reference["llama", "bf16-true"])
        assert result["float8"]["losses"] != result["llama", "bf16-true"]["losses"]  # float8 scaling really ran


def test_cp_composes_with_activation_checkpointing(results: list, reference: Dict) -> None:
    _assert_close(results[0]["ac"], reference["llama", "32-true"], 1e-5)


def test_a_checkpoint_saved_with_cp_loads_without_it_and_the_reverse(results: list) -> None:
    for result in results:
        assert result["checkpoints"] == {"2->1": True, "1->2": True}


def test_what_cp_cannot_run_is_refused_with_the_reason(results: list) -> None:
    refusals = results[0]["refusals"]
    assert "only attention can run on split sequences" in refusals["mixer"]
    assert "sequence mixers" in refusals["mixer"] and "layers.1.attention (Mixer)" in refusals["mixer"]
    assert "attn_implementation='eager'" in refusals["eager"] and "attn_implementation='sdpa'" in refusals["eager"]
    assert "sliding-window attention" in refusals["sliding"]
    assert "no padding mask" in refusals["padding"]
    assert "30 tokens, which do not divide into 2 x 2 = 4 chunks" in refusals["length"]
    assert "call the model with input_ids= (not inputs_embeds)" in refusals["embeds"]
    assert "this attention call is not causal" in refusals["not_causal"] and "no mask" in refusals["not_causal"]
    assert refusals["local_after"] == "True"
    assert results[1]["refusals"] == refusals  # every rank refuses the same


@pytest.fixture(scope="module")
def four() -> List[Dict[str, Any]]:
    return run_distributed(_four_ranks, 4, timeout=300)


@pytest.fixture(scope="module")
def reference_four() -> Dict[Any, Any]:
    return run_distributed(_reference_four_rows, 1, timeout=200)[0]


def _reference_four_rows(rank: int, world: int) -> Dict[Any, Any]:
    """One process on both data-parallel ranks' rows: FSDP averages the two ranks' losses, which have as many trained
    tokens each, so the mean over all rows is the same."""
    return {
        (model, flag): _run_rows(flag, model)
        for model, flag in (("llama", "32-true"), ("qwen3", "bf16-true"), ("qwen3", "32-true"))
    }


def _run_rows(flag: str, model_type: str) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(1, flag, MixedFSDP2Strategy())
    model = fabric.setup(tiny_model(model_type))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out: Dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        rows = batch(step, ROWS * 2)
        losses = [model(**{k: v.chunk(2)[half] for k, v in rows.items()}).loss for half in (0, 1)]
        loss = (losses[0] + losses[1]) / 2
        fabric.backward(loss)
        if step == 0:
            out["grads"] = full_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append([value.item() for value in losses])
    return out


def test_shard2_x_cp2_on_four_ranks_equals_one_process(four: list, reference_four: Dict) -> None:
    expected = reference_four["llama", "32-true"]
    for rank, result in enumerate(four):
        got = result["shard_cp"]
        # each data-parallel rank's loss is its own rows' (ranks 0-1 hold rows 0-1, ranks 2-3 rows 2-3)
        assert got["losses"] == pytest.approx([pair[rank // 2] for pair in expected["losses"]], rel=1e-5)
        for name, grad in expected["grads"].items():
            assert _relative(got["grads"][name], grad) < 1e-5, name


def test_hsdp_x_cp_on_four_ranks_equals_one_process(four: list, reference_four: Dict) -> None:
    expected = reference_four["qwen3", "32-true"]
    for result in four:
        for name, grad in expected["grads"].items():
            assert _relative(result["hsdp_cp"]["grads"][name], grad) < 1e-5, name


def test_shard2_x_cp2_in_bf16_is_within_bf16s_own_distance(four: list, reference_four: Dict) -> None:
    fp32, bf16 = reference_four["qwen3", "32-true"], reference_four["qwen3", "bf16-true"]
    for result in four:
        for name, grad in fp32["grads"].items():
            own = _relative(bf16["grads"][name], grad)
            assert _relative(result["shard_cp_bf16"]["grads"][name], grad) <= max(3 * own, 0.02), name
