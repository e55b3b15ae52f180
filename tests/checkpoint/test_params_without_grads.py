"""Resuming when some params never got a grad, so their optimizer has no state for them: DeepSeek-V3.2's indexer, a
module the forward never calls, an expert no token reaches, and ranks whose optimizers hold state for different
params. On 2 ranks, through Fabric (DCP folder and single file) and the Trainer: after the load each param has state
exactly when it had at the save, and the next losses equal the uninterrupted run's."""

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.testing import accelerator_for
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import global_batch, make_fabric, rank_slice, train_hf_steps, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 2
SAVED_AT, STEPS = 3, 6


class WithUnusedHead(nn.Module):
    """An HF Llama beside a head the forward never calls (a value head kept for later, say)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lm = tiny_model("llama", seed=seed)
        self.value_head = nn.Linear(32, 1)

    def forward(self, **inputs: Any) -> Any:
        return self.lm(**inputs)


def _deepseek_v32(seed: int) -> nn.Module:
    return tiny_model("deepseek_v32", seed=seed)


def _unrouted_expert(seed: int) -> nn.Module:
    # DeepSeek-V3's selection bias: expert 3 never wins a top-k, so no token reaches it
    model = tiny_model("deepseek_v3", seed=seed)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[3] = -1e4
    return model


def _with_unused_head(seed: int) -> nn.Module:
    return WithUnusedHead(seed)


BUILDS: Dict[str, Callable[[int], nn.Module]] = {
    "deepseek_v32": _deepseek_v32,
    "unrouted_expert": _unrouted_expert,
    "unused_head": _with_unused_head,
}


def _state_steps(model: nn.Module, optimizer: Any) -> Dict[str, Optional[float]]:
    """Per param, AdamW's step count on this rank, ``None`` where it has no state."""
    state = optimizer.state
    return {n: float(state[p]["step"]) if p in state else None for n, p in unwrap(model).named_parameters()}


def _fabric_case(name: str, folder: Path, full_file: bool = False, rank_1_forgets: Optional[str] = None) -> Dict:
    """Train, save after ``SAVED_AT`` steps and go on; then a fresh, differently initialised setup loads and goes on.
    ``rank_1_forgets``: rank 1 drops its state for this param just before the save (ranks then differ)."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(save_distributed_checkpoint=not full_file))
    build = BUILDS[name]
    model = fabric.setup(build(0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train_hf_steps(fabric, model, optimizer, SAVED_AT)
    if rank_1_forgets is not None and fabric.global_rank == 1:
        optimizer.optimizer.state.pop(dict(unwrap(model).named_parameters())[rank_1_forgets])
    path = folder / (f"{name}.ckpt" if full_file else name)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    saved = _state_steps(model, optimizer.optimizer)
    uninterrupted = train_hf_steps(fabric, model, optimizer, STEPS, start=SAVED_AT)

    fresh = fabric.setup(build(1))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    fabric.load(path, {"model": fresh, "optimizer": fresh_optimizer})
    loaded = _state_steps(fresh, fresh_optimizer.optimizer)
    resumed = train_hf_steps(fabric, fresh, fresh_optimizer, STEPS, start=SAVED_AT)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed}


def _trainer_fit(folder: Path, ckpt_path: Optional[str], seed: int) -> List[float]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy

    losses: List[float] = []

    class IndexerModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _deepseek_v32(seed)

        def training_step(self, _batch: Any, _index: int) -> torch.Tensor:
            # a function of the step alone, so the resumed run sees the uninterrupted run's batches
            tokens = rank_slice(global_batch(WORLD, self.global_step), self.global_rank, WORLD)
            loss = self.model(input_ids=tokens, labels=tokens).loss
            losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(
        accelerator=accelerator_for(WORLD),
        devices=WORLD,
        strategy=MixedFSDP2Strategy(),
        precision="bf16-true",
        max_steps=STEPS,
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVED_AT, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(torch.zeros(STEPS * WORLD, 1), batch_size=1)
    trainer.fit(IndexerModule(), loader, ckpt_path=ckpt_path)
    return losses


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    root = Path(folder)
    results = {name: _fabric_case(name, root) for name in BUILDS}
    results["deepseek_v32/full_file"] = _fabric_case("deepseek_v32", root, full_file=True)
    results["ranks_differ"] = _fabric_case("unused_head", root / "differ", rank_1_forgets="lm.lm_head.weight")
    uninterrupted = _trainer_fit(root / "trainer", None, seed=0)
    checkpoint = sorted((root / "trainer").glob(f"*step={SAVED_AT}*"))[0]
    results["trainer"] = {
        "uninterrupted": uninterrupted[SAVED_AT:],
        "resumed": _trainer_fit(root / "trainer_resumed", str(checkpoint), seed=1),
    }
    return results


LAUNCH = Launch(_scenarios, WORLD, timeout=300)


CASES = ("deepseek_v32", "unrouted_expert", "unused_head", "deepseek_v32/full_file", "ranks_differ")


@pytest.mark.parametrize("case", CASES)
def test_resumed_losses_equal_the_uninterrupted_runs(results: list, case: str) -> None:
    for rank in range(WORLD):
        got = results[rank][case]
        assert len(got["resumed"]) == STEPS - SAVED_AT
        assert got["resumed"] == got["uninterrupted"], rank


@pytest.mark.parametrize("case", CASES)
def test_each_param_has_state_after_the_load_exactly_when_it_had_at_the_save(results: list, case: str) -> None:
    for rank in range(WORLD):
        assert results[rank][case]["loaded"] == results[rank][case]["saved"], rank


def test_params_that_never_got_a_grad_have_no_state_at_the_save(results: list) -> None:
    saved = results[0]["deepseek_v32"]["saved"]
    indexer = [n for n in saved if ".indexer." in n]
    assert indexer and all(saved[n] is None for n in indexer)
    assert all(step == SAVED_AT for n, step in saved.items() if ".indexer." not in n)
    assert results[0]["unused_head"]["saved"]["value_head.weight"] is None


def test_an_expert_no_token_reaches_resumes(results: list) -> None:
    # HF fuses the experts into one param per projection: it gets a grad (zero for expert 3) every step
    saved = results[0]["unrouted_expert"]["saved"]
    assert saved["model.layers.1.mlp.experts.gate_up_proj"] == SAVED_AT


def test_ranks_whose_optimizers_hold_state_for_different_params_each_get_their_own_back(results: list) -> None:
    head = "lm.lm_head.weight"
    assert results[0]["ranks_differ"]["saved"][head] == SAVED_AT
    assert results[1]["ranks_differ"]["saved"][head] is None
    for rank in range(WORLD):
        assert results[rank]["ranks_differ"]["loaded"][head] == results[rank]["ranks_differ"]["saved"][head]


def test_trainer_resume_of_deepseek_v32_continues_with_the_uninterrupted_losses(results: list) -> None:
    for rank in range(WORLD):
        trainer = results[rank]["trainer"]
        assert len(trainer["resumed"]) == STEPS - SAVED_AT
        assert trainer["resumed"] == trainer["uninterrupted"], rank
