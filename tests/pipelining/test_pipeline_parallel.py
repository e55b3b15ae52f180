"""2 ranks, pipeline parallelism 2 (each rank one stage, or two under Interleaved1F1B): training equals one process
(32-true: losses, the clip norm and every param by name), bf16 stages keep their fp32 params and send bf16, DCP
checkpoints move between pipeline sizes, and every refusal is raised on every rank."""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import nn
from transformers import LlamaModel

from lightning_mixedfsdp import load_full_weights
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import A_LOG, full_params, make_fabric, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD, LAYERS, BATCH, SEQUENCE, STEPS, LR = 2, 4, 8, 12, 2, 1e-3
SCHEDULES = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2}
"""Each schedule built and tested, with its stages per rank."""


def llama(**overrides: Any) -> nn.Module:
    return tiny_model("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False, **overrides)


def batches() -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS + 1)]


def lm_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def strategy(**options: Any) -> Any:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    return MixedFSDP2Strategy(**options)


def pipelined(schedule: str = "1F1B", **options: Any) -> Any:
    per_rank = SCHEDULES[schedule]
    return strategy(
        pipeline_parallel_size=2,
        pipeline_schedule=schedule,
        pipeline_stages_per_rank=per_rank,
        pipeline_microbatches=4,
        **options,
    )


def packed(tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Two documents per row: positions restart halfway (HF's mask then keeps attention within each)."""
    half = torch.arange(SEQUENCE // 2)
    return {"input_ids": tokens, "position_ids": torch.cat([half, half]).expand(tokens.shape[0], -1)}


def _train(fabric: Any, model: nn.Module, optimizer: Any, as_documents: bool = False) -> Dict[str, Any]:
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        inputs = packed(batch) if as_documents else batch
        losses.append(fabric.strategy.pipeline_step(model, inputs, target=batch, loss_fn=lm_loss).item())
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1e9).item())
        optimizer.step()
        optimizer.zero_grad()
    held_out = batches()[STEPS]
    inputs = packed(held_out) if as_documents else held_out
    evaluated = fabric.strategy.pipeline_eval(model, inputs, target=held_out, loss_fn=lm_loss).item()
    return {"losses": losses, "norms": norms, "eval": evaluated, "training": unwrap(model).training}


def _schedules(rank: int) -> Dict[str, Any]:
    out = {}
    for schedule in [*SCHEDULES, "checkpointed", "packed"]:
        options = {"activation_checkpointing": "full"} if schedule == "checkpointed" else {}
        fabric = make_fabric(WORLD, "32-true", pipelined(schedule if schedule in SCHEDULES else "1F1B", **options))
        model = llama()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
        trained = _train(fabric, model, optimizer, as_documents=schedule == "packed")
        out[schedule] = {**trained, "params": full_params(model)}
    return out


def _bf16_stages(rank: int, folder: str) -> Dict[str, Any]:
    """A Llama (fp32 norms in every layer) and this project's TinyLlama with Mamba-style mixers (``A_log`` kept
    fp32: a replicated param inside its block's bf16 FSDP unit), each in two bf16 stages."""
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    out: Dict[str, Any] = {}
    fabric = make_fabric(WORLD, "bf16-true", pipelined())
    model = fabric.setup(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["llama"] = {n: p.dtype for n, p in unwrap(model).named_parameters()}
    out["llama_losses"] = [_step(fabric, model, optimizer, batch) for batch in batches()[:STEPS] * 2]
    fabric.strategy.export_safetensors(model, Path(folder) / "export")
    out["llama_params"] = full_params(model)
    runner = fabric.strategy._runner_of(model, "test")
    fresh = make_fabric(WORLD, "bf16-true", pipelined()).setup(llama(seed=3))
    load_full_weights(fresh, Path(folder) / "export")
    out["loaded_params"] = full_params(fresh)
    out["boundaries"] = {
        stage: (b.received.dtype, b.emitted.dtype) for _, bs in runner._schedules.values() for stage, b in bs.items()
    }
    mixers = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, hidden_dim=64, mixer_layers=(0, 1, 2, 3))
    fabric = make_fabric(WORLD, "bf16-true", pipelined(keep_fp32_params=A_LOG))
    torch.manual_seed(0)
    tiny = fabric.setup(TinyLlama(mixers))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(tiny.parameters(), lr=1e-2))
    before = {n: p.detach().clone() for n, p in full_params(tiny).items() if n.endswith("A_log")}
    out["tiny_losses"] = [_step(fabric, tiny, optimizer, batch) for batch in batches()[:STEPS] * 2]
    out["tiny"] = {n: p.dtype for n, p in unwrap(tiny).named_parameters()}
    after = full_params(tiny)
    out["a_log_moved"] = {n: not torch.equal(before[n], after[n]) for n in before}
    return out


def _step(fabric: Any, model: nn.Module, optimizer: Any, batch: torch.Tensor) -> float:
    loss = fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=lm_loss).item()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def sgd_in_one_process(model: nn.Module, lr: float) -> List[float]:
    """The reference: ``model`` trained in one process on the whole batches, SGD at ``lr``; its losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches()[:STEPS]:
        loss = lm_loss(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


DECODERS = {
    "mistral": {"sliding_window": 4},  # a window shorter than the rows
    "gemma3_text": {"sliding_window": 4, "final_logit_softcapping": 30.0},
    "qwen3_moe": {},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.5, "logits_scaling": 8.0},
}
"""HF decoders whose forward differs from Llama's, each in two stages through its own forward."""
SGD_LR = 0.5
"""Large enough that a gradient off by a factor (a micro-batch counted twice) moves params visibly off."""


def decoder(model_type: str) -> nn.Module:
    return tiny_model(model_type, num_hidden_layers=LAYERS, tie_word_embeddings=False, **DECODERS[model_type])


def _decoders(rank: int) -> Dict[str, Any]:
    out = {}
    for model_type in DECODERS:
        fabric = make_fabric(WORLD, "32-true", pipelined())
        model = fabric.setup(decoder(model_type))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=SGD_LR))
        losses = [_step(fabric, model, optimizer, batch) for batch in batches()[:STEPS]]
        out[model_type] = {"losses": losses, "params": full_params(model)}
    return out


def tied() -> nn.Module:
    return tiny_model("llama", num_hidden_layers=LAYERS, tie_word_embeddings=True)


def _tied_stages(rank: int, folder: str) -> Dict[str, Any]:
    """A Llama whose head is its embedding, in two stages (the embedding on rank 0, the head on rank 1): SGD at
    lr 0.5 with clipping, a save, a resume that repeats the next step, and an export."""
    out: Dict[str, Any] = {}

    def run(seed: int, offset: float = 0.0) -> Any:
        fabric = make_fabric(WORLD, "32-true", pipelined())
        model = tiny_model("llama", seed=seed, num_hidden_layers=LAYERS, tie_word_embeddings=True)
        with torch.no_grad():
            model.lm_head.weight.add_(offset)  # rank 1 keeps the head: it must start as rank 0's embedding
        model = fabric.setup(model)
        return fabric, model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9))

    fabric, model, optimizer = run(seed=0, offset=float(rank))
    out["initial"] = full_params(model)
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        losses.append(fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=lm_loss).item())
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    out.update(losses=losses, norms=norms, params=full_params(model))
    fabric.save(Path(folder) / "tied.ckpt", {"model": model, "optimizer": optimizer})
    fabric.strategy.export_safetensors(model, Path(folder) / "tied_export", dtype=torch.float32)
    nxt = batches()[STEPS]
    out["continued_loss"] = _step(fabric, model, optimizer, nxt)
    out["continued"] = full_params(model)
    fabric, model, optimizer = run(seed=9)
    fabric.load(Path(folder) / "tied.ckpt", {"model": model, "optimizer": optimizer})
    out["resumed_loss"] = _step(fabric, model, optimizer, nxt)
    out["resumed"] = full_params(model)
    fabric, model, optimizer = run(seed=5)
    load_full_weights(model, Path(folder) / "tied_export")  # the weight stored once, loaded into both copies
    out["loaded"] = full_params(model)
    fabric, model, optimizer = run(seed=0)
    for batch in batches()[:STEPS]:  # two steps' grads accumulated into one optimizer step
        fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=lm_loss)
    optimizer.step()
    out["accumulated"] = full_params(model)
    return out


def _checkpoints(rank: int, folder: str) -> Dict[str, Any]:
    """Save at PP 2, resume at PP 2 (bitwise, and the next step equal) and load at PP 1 x FSDP 2; save at PP 1 x
    FSDP 2 and load at PP 2."""
    out: Dict[str, Any] = {}
    path = Path(folder) / "pp2.ckpt"
    fabric = make_fabric(WORLD, "32-true", pipelined())
    model = llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    for batch in batches()[:STEPS]:
        _step(fabric, model, optimizer, batch)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    out["saved"] = full_params(model)
    nxt = batches()[STEPS]
    out["continued_loss"] = _step(fabric, model, optimizer, nxt)
    out["continued"] = full_params(model)

    fabric = make_fabric(WORLD, "32-true", pipelined())
    model = llama(seed=5)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    fabric.load(path, {"model": model, "optimizer": optimizer})
    out["resumed"] = full_params(model)
    out["resumed_loss"] = _step(fabric, model, optimizer, nxt)
    out["resumed_next"] = full_params(model)

    fabric = make_fabric(WORLD, "32-true", strategy())
    model = llama(seed=6)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    fabric.load(path, {"model": model, "optimizer": optimizer})
    out["at_pp1"] = full_params(model)
    flat = Path(folder) / "pp1.ckpt"
    fabric.save(flat, {"model": model, "optimizer": optimizer})

    fabric = make_fabric(WORLD, "32-true", pipelined())
    model = llama(seed=7)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    fabric.load(flat, {"model": model, "optimizer": optimizer})
    out["back_at_pp2"] = full_params(model)
    return out


def _refusals(rank: int) -> Dict[str, str]:
    out = {}

    def refused(name: str, action: Any) -> None:
        try:
            action()
        except (ValueError, RuntimeError, TypeError) as error:
            out[name] = f"{type(error).__name__}: {error}"
        else:
            out[name] = "no error"

    fabric = make_fabric(WORLD, "32-true", pipelined())
    model = fabric.setup(llama())
    odd = torch.randint(0, 64, (6, SEQUENCE))
    refused("batch", lambda: fabric.strategy.pipeline_step(model, odd, target=odd, loss_fn=lm_loss))
    refused("direct_call", lambda: model(odd))
    split = pipelined(pipeline_split=["model.layers.0"])
    refused("empty_split", lambda: make_fabric(WORLD, "32-true", split).setup(llama()))
    own = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))
    refused("unsplittable", lambda: make_fabric(WORLD, "32-true", pipelined()).setup(own))
    flat = make_fabric(WORLD, "32-true", strategy())
    refused("unpipelined", lambda: flat.strategy.pipeline_step(model, odd, target=odd, loss_fn=lm_loss))
    batch = batches()[0]
    refused("reduction", lambda: fabric.strategy.pipeline_step(model, batch, target=batch, loss_fn=lm_loss,
                                                                loss_reduction="avg"))  # fmt: skip
    refused("eval_reduction", lambda: fabric.strategy.pipeline_eval(model, batch, target=batch, loss_fn=lm_loss,
                                                                     loss_reduction="avg"))  # fmt: skip
    shared = llama()  # block 3 (stage 1) reuses block 0's (stage 0) up projection
    shared.model.layers[3].mlp.up_proj.weight = shared.model.layers[0].mlp.up_proj.weight
    refused("shared_across_stages", lambda: make_fabric(WORLD, "32-true", pipelined()).setup(shared))
    refused("scaled_forward", lambda: make_fabric(WORLD, "32-true", pipelined()).setup(ScaledBlocks()))
    capped = ScaledBlocks(scale=1.0, cap=30.0)  # Gemma 2's soft-cap: at a random init's logits of order 1, ~1e-4 off
    refused("soft_capped", lambda: make_fabric(WORLD, "32-true", pipelined()).setup(capped))
    stochastic = pipelined(bf16_updates="stochastic")
    refused("tied_stochastic", lambda: make_fabric(WORLD, "bf16-true", stochastic).setup(tied()))
    scaled_inputs = llama()
    scaled_inputs.model.__class__ = ScaledInputsLlama
    refused("scaled_inputs_embeds", lambda: make_fabric(WORLD, "32-true", pipelined()).setup(scaled_inputs))
    return out


def _modes(rank: int) -> Dict[str, bool]:
    """A module the user put in eval mode stays there through the setup's probe."""
    model = llama()
    model.model.layers[3].eval()
    model = make_fabric(WORLD, "32-true", pipelined()).setup(model)
    return {name: module.training for name, module in unwrap(model).named_modules() if name.endswith("layers.3")}


class ScaledBlocks(nn.Module):
    """A user's model that declares its block list and does more in its forward than run its children in order (a
    scaled embedding, as Gemma's)."""

    pipeline_blocks = "layers"

    def __init__(self, scale: float = 2.0, cap: Optional[float] = None) -> None:
        super().__init__()
        self.scale, self.cap = scale, cap
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(LAYERS))
        self.head = nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) * self.scale
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.head(hidden)
        return logits if self.cap is None else self.cap * torch.tanh(logits / self.cap)


class ScaledInputsLlama(LlamaModel):
    """A user's decoder that scales whatever ``inputs_embeds`` it gets, under a name transformers' own models do not
    use: a stage after the first would scale the hidden states it receives again."""

    def forward(self, input_ids: Any = None, inputs_embeds: Any = None, **kwargs: Any) -> Any:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return super().forward(inputs_embeds=inputs_embeds * 3.0, **kwargs)


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    return {
        "schedules": _schedules(rank),
        "decoders": _decoders(rank),
        "tied": _tied_stages(rank, folder),
        "bf16": _bf16_stages(rank, folder),
        "checkpoints": _checkpoints(rank, folder),
        "refusals": _refusals(rank),
        "modes": _modes(rank),
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=400)


def one_process(as_documents: bool) -> Dict[str, Any]:
    """One process, the whole batch, the same steps (rows of one document, or of two)."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        loss = lm_loss(model(**packed(batch), use_cache=False) if as_documents else model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
    held_out = batches()[STEPS]
    with torch.no_grad():
        held = model(**packed(held_out), use_cache=False) if as_documents else model(held_out)
        evaluated = lm_loss(held, held_out).item()
    return {"losses": losses, "norms": norms, "eval": evaluated, "params": dict(model.named_parameters())}


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return one_process(as_documents=False)


def merged(results: List[Dict[str, Any]], *keys: str) -> Dict[str, torch.Tensor]:
    """Every stage's params by name (each rank holds its stages')."""
    params: Dict[str, torch.Tensor] = {}
    for result in results:
        value = result
        for key in keys:
            value = value[key]
        assert not set(params) & set(value), "a param on two stages"
        params.update(value)
    return params


@pytest.mark.parametrize("schedule", [*SCHEDULES, "checkpointed"])
def test_each_schedule_trains_as_one_process_does(results: list, reference: Dict[str, Any], schedule: str) -> None:
    assert_equal_to_one_process(results, reference, schedule)


def test_a_dict_of_inputs_reaches_every_stage_split_per_micro_batch(results: list) -> None:
    """``position_ids`` restarting mid-row (two documents): every stage's mask and rotary embeddings follow them, as
    the model's own training forward (``use_cache=False``, as SFT calls it) keeps attention within each document."""
    assert_equal_to_one_process(results, one_process(as_documents=True), "packed")
    assert results[0]["schedules"]["packed"]["losses"] != results[0]["schedules"]["1F1B"]["losses"]


def assert_equal_to_one_process(results: list, reference: Dict[str, Any], schedule: str) -> None:
    for result in results:
        got = result["schedules"][schedule]
        assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert got["eval"] == pytest.approx(reference["eval"], abs=1e-5)
        assert got["training"], "pipeline_eval leaves the model in train mode"
    params = merged(results, "schedules", schedule, "params")
    assert set(params) == set(reference["params"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value.detach(), atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", list(DECODERS))
def test_a_decoder_unlike_llama_trains_in_two_stages_as_one_process(results: list, model_type: str) -> None:
    """Mistral's window shorter than the rows, Gemma 3's scaled embedding, sliding and global layers and soft-capped
    logits, Qwen3-MoE's routed experts, Granite's scaled embeddings, residuals and logits: each stage runs the model's
    own forward, so SGD steps at a large rate move every param as one process's do."""
    model = decoder(model_type)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    losses = sgd_in_one_process(model, SGD_LR)
    for result in results:
        assert result["decoders"][model_type]["losses"] == pytest.approx(losses, abs=1e-5)
    params = merged(results, "decoders", model_type, "params")
    assert set(params) == set(initial)
    for name, param in model.named_parameters():
        movement = (param.detach() - initial[name]).abs().max().item()
        torch.testing.assert_close(params[name], param.detach(), atol=max(1e-2 * movement, 1e-6), rtol=0, msg=name)


def test_tied_embeddings_train_in_two_stages_as_one_process_resume_and_export_one_tensor(
    results: list, folder: Path
) -> None:
    """The first stage's embedding and the last stage's head start equal (rank 1 built its head off by 1), their grads
    are summed over the two ranks before each step and the norm counts the weight once, so SGD with momentum and
    clipping moves both as one process moves the one tied weight; a resume repeats the next step; the export holds
    the weight once, `from_pretrained` ties it again and `load_full_weights` loads it into both copies; two steps
    accumulated before one optimizer step count each step's grads once."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    losses, norms = [], []
    for batch in batches()[:STEPS]:
        loss = lm_loss(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    embedding = model.model.embed_tokens.weight.detach()
    first, last = results[0]["tied"], results[1]["tied"]
    assert torch.equal(last["initial"]["lm_head.weight"], first["initial"]["model.embed_tokens.weight"])
    for result in (first, last):
        assert result["losses"] == pytest.approx(losses, abs=1e-5)
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
    for trained in (first["params"]["model.embed_tokens.weight"], last["params"]["lm_head.weight"]):
        torch.testing.assert_close(trained, embedding, atol=1e-5, rtol=0)
    for result in (first, last):
        assert result["resumed_loss"] == result["continued_loss"]
        assert all(torch.equal(result["resumed"][n], result["continued"][n]) for n in result["continued"])
    stored = {n: t for p in sorted((folder / "tied_export").glob("*.safetensors")) for n, t in load_file(p).items()}
    assert "lm_head.weight" not in stored and torch.equal(
        stored["model.embed_tokens.weight"], first["params"]["model.embed_tokens.weight"]
    )
    accumulated = tied()
    for batch in batches()[:STEPS]:
        lm_loss(accumulated(batch), batch).backward()
    torch.optim.SGD(accumulated.parameters(), lr=SGD_LR, momentum=0.9).step()
    for trained in (first["accumulated"]["model.embed_tokens.weight"], last["accumulated"]["lm_head.weight"]):
        torch.testing.assert_close(trained, accumulated.model.embed_tokens.weight.detach(), atol=1e-5, rtol=0)
    exported = first["params"]["model.embed_tokens.weight"]
    assert torch.equal(first["loaded"]["model.embed_tokens.weight"], exported)
    assert torch.equal(last["loaded"]["lm_head.weight"], exported)
    loaded = AutoModelForCausalLM.from_pretrained(folder / "tied_export", dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight.detach(), first["params"]["model.embed_tokens.weight"])


def test_each_rank_holds_its_stages_under_their_original_names(results: list) -> None:
    ranks = [set(result["schedules"]["1F1B"]["params"]) for result in results]
    assert "model.embed_tokens.weight" in ranks[0] and "model.layers.1.mlp.up_proj.weight" in ranks[0]
    assert "lm_head.weight" in ranks[1] and "model.layers.2.mlp.up_proj.weight" in ranks[1]
    interleaved = [set(result["schedules"]["Interleaved1F1B"]["params"]) for result in results]
    assert "model.layers.2.self_attn.q_proj.weight" in interleaved[0], "stages 0 and 2 on rank 0"
    assert "model.layers.1.self_attn.q_proj.weight" in interleaved[1], "stages 1 and 3 on rank 1"


def test_bf16_stages_keep_fp32_params_and_send_bf16(results: list) -> None:
    for result in results:
        bf16 = result["bf16"]
        for name, dtype in bf16["llama"].items():
            expected = torch.float32 if "norm" in name else torch.bfloat16
            assert dtype == expected, name
        assert any("norm" in name for name in bf16["llama"])
        for name, dtype in bf16["tiny"].items():
            expected = torch.float32 if name.endswith("A_log") or "norm" in name else torch.bfloat16
            assert dtype == expected, name
        for stage, (received, emitted) in bf16["boundaries"].items():
            assert received in (torch.int64, torch.bfloat16) and emitted == torch.bfloat16, stage
        for losses in (bf16["llama_losses"], bf16["tiny_losses"]):
            assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    a_logs = {name for result in results for name in result["bf16"]["a_log_moved"]}
    assert len(a_logs) == 4, "every mixer's A_log on its stage"
    assert all(moved for result in results for moved in result["bf16"]["a_log_moved"].values())


def test_the_export_from_pipeline_ranks_is_one_folder_from_pretrained_loads(results: list, folder: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trained = merged(results, "bf16", "llama_params")
    stored = {n: t for path in sorted((folder / "export").glob("*.safetensors")) for n, t in load_file(path).items()}
    assert set(stored) == set(trained)
    for name, value in trained.items():
        assert stored[name].dtype == value.dtype and torch.equal(stored[name], value), name
    assert json.loads((folder / "export" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(folder / "export", dtype=torch.float32)
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach(), trained[name].float()), name


def test_a_full_checkpoint_loads_into_pipeline_stages(results: list) -> None:
    trained, loaded = merged(results, "bf16", "llama_params"), merged(results, "bf16", "loaded_params")
    assert set(loaded) == set(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name


def test_a_checkpoint_moves_between_pipeline_sizes(results: list) -> None:
    saved = merged(results, "checkpoints", "saved")
    resumed = merged(results, "checkpoints", "resumed")
    for name in saved:
        assert torch.equal(resumed[name], saved[name]), name
    continued = merged(results, "checkpoints", "continued")
    resumed_next = merged(results, "checkpoints", "resumed_next")
    for name in continued:
        assert torch.equal(resumed_next[name], continued[name]), name
    for result in results:
        assert result["checkpoints"]["resumed_loss"] == result["checkpoints"]["continued_loss"]
        at_pp1 = result["checkpoints"]["at_pp1"]
        assert set(at_pp1) == set(saved)
        for name in saved:
            assert torch.equal(at_pp1[name], saved[name]), name
    back = merged(results, "checkpoints", "back_at_pp2")
    for name in saved:
        assert torch.equal(back[name], saved[name]), name


REFUSALS = {
    "batch": "ValueError: mixed_fsdp2: a batch of 6 does not split into pipeline_microbatches=4",
    "direct_call": "RuntimeError: MixedFSDP2Strategy: under pipeline parallelism this model holds stages [",
    "empty_split": "ValueError: MixedFSDP2Strategy (LlamaForCausalLM): pipeline_split=['model.layers.0'] leaves",
    "unsplittable": "ValueError: MixedFSDP2Strategy (Sequential): Sequential cannot be split into pipeline stages",
    "unpipelined": "RuntimeError: MixedFSDP2Strategy.pipeline_step: pipeline_parallel_size is 1",
    "reduction": "ValueError: MixedFSDP2Strategy.pipeline_step: loss_reduction='avg'; use 'mean'",
    "eval_reduction": "ValueError: MixedFSDP2Strategy.pipeline_eval: loss_reduction='avg'; use 'mean'",
    "shared_across_stages": "ValueError: MixedFSDP2Strategy (LlamaForCausalLM): LlamaForCausalLM uses a Parameter on"
    " more than one pipeline stage (model.layers.3.mlp.up_proj.weight (stage 1) is model.layers.0.mlp.up_proj.weight"
    " (stage 0))",
    "scaled_forward": "ValueError: MixedFSDP2Strategy (ScaledBlocks): ScaledBlocks's pipeline stages, run in order, do"
    " not compute what ScaledBlocks.forward computes",
    "soft_capped": "ValueError: MixedFSDP2Strategy (ScaledBlocks): ScaledBlocks's pipeline stages, run in order, do"
    " not compute what ScaledBlocks.forward computes",
    "tied_stochastic": "ValueError: MixedFSDP2Strategy (LlamaForCausalLM): bf16_updates='stochastic' with a head tied"
    " to the embedding under pipeline stages: each stage's copy of the tied weight would round its updates with its"
    " own random stream",
    "scaled_inputs_embeds": "ValueError: MixedFSDP2Strategy (LlamaForCausalLM): LlamaForCausalLM's pipeline stages,"
    " run in order, do not compute what LlamaForCausalLM.forward computes (on a probe their output is",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_is_raised_on_every_rank_with_its_fix(results: list, case: str) -> None:
    for result in results:
        assert result["refusals"][case].startswith(REFUSALS[case]), result["refusals"][case]


def test_the_setups_probe_leaves_each_modules_mode_as_the_user_set_it(results: list) -> None:
    held = {name: training for result in results for name, training in result["modes"].items()}
    assert held == {"model.layers.3": False}
