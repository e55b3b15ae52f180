"""Fine-tuning steps on 2 ranks with the Trainer, as the runner builds them (``ChatCorpus``, ``ChatLM``, the
strategy), one optimizer step on conversations of different lengths, one per row: 4 micro-batches of 1 row per
rank accumulated give the gradient of 1 micro-batch of 4 rows, within fp32 rounding, for the reference model and an
HF Llama (``num_items_in_batch``); averaging each micro-batch's mean loss, as a plain loop does, does not; and
context parallelism (2 ranks splitting 8 rows) gives the same gradient too."""

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from tests.conftest import Launch

WORLD = 2
HF_LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}  # fmt: skip


def _write_conversations(path: Path) -> None:
    """24 conversations whose answers run from 2 to 48 bytes: rows train very different token counts."""
    with path.open("w") as lines:
        for index in range(24):
            answer = "".join(chr(97 + (index * 7 + k) % 26) for k in range(2 + 2 * index))
            messages = [{"role": "user", "content": f"Q{index}?"}, {"role": "assistant", "content": answer}]
            lines.write(json.dumps({"messages": messages}) + "\n")


def _fit(folder: Path, hf: bool, batch: int, accumulate: int, context_parallel: int = 1, naive: bool = False) -> Any:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.data.chat_corpus import ChatCorpus
    from lightning_mixedfsdp.recipes.objectives.objective import Schedule
    from lightning_mixedfsdp.recipes.objectives.sft import ChatLM
    from lightning_mixedfsdp.recipes.settings.schema import DataSection, ModelSection
    from tests.scenarios import full_grads

    class FirstGrads(pl.Callback):
        grads: Dict[str, torch.Tensor] = {}

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.grads = full_grads(module.model)

    class MeanPerMicroBatch(ChatLM):
        """What a plain loop does: each micro-batch's mean token loss (Lightning then averages them)."""

        def _loss(self, batch: Dict[str, torch.Tensor], num_items: torch.Tensor) -> torch.Tensor:
            trained = (batch["labels"][:, 1:] != -100).sum()
            return super()._loss(batch, trained.float())

    data = DataSection(
        files=[str(folder / "chat.jsonl")], format="chat", seq_len=64, batch_size=batch, held_out_every=12,
        val_windows=2, packing=False,
    )  # fmt: skip
    model = ModelSection(dim=32, n_layers=2, hidden_dim=64, mixer_layers=[], hf_config=HF_LLAMA if hf else None)
    pl.seed_everything(0, verbose=False)
    module = (MeanPerMicroBatch if naive else ChatLM)(model, Schedule(1e-3, 0.0, (0.9, 0.95), 1, 1))
    recorder = FirstGrads()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=MixedFSDP2Strategy(context_parallel_size=context_parallel),
        precision="32-true", max_steps=1, max_epochs=1, accumulate_grad_batches=accumulate, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(module, datamodule=ChatCorpus(data, 0, accumulate, accumulate, packed=False))
    return recorder.grads


def _steps(rank: int, world: int, folder: str) -> Dict[str, Any]:
    root = Path(folder) / f"rank{rank}"  # the same file on each rank, written by each (no process group yet)
    root.mkdir()
    _write_conversations(root / "chat.jsonl")
    out: Dict[str, Any] = {}
    for name, hf in (("reference", False), ("hf", True)):
        out[name, "1x4"] = _fit(root, hf, batch=4, accumulate=1)
        out[name, "4x1"] = _fit(root, hf, batch=1, accumulate=4)
        out[name, "cp"] = _fit(root, hf, batch=8, accumulate=1, context_parallel=2)
    out["reference", "naive"] = _fit(root, False, batch=1, accumulate=4, naive=True)
    return out


LAUNCH = Launch(_steps, WORLD, timeout=300)


def _relative(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys() and expected
    worst = 0.0
    for name, value in expected.items():
        worst = max(worst, float((got[name].double() - value.double()).norm() / value.double().norm().clamp_min(1e-12)))
    return worst


@pytest.mark.parametrize("model", ["reference", "hf"])
def test_four_accumulated_micro_batches_of_one_equal_one_of_four(results: list, model: str) -> None:
    for result in results:
        assert _relative(result[model, "4x1"], result[model, "1x4"]) < 1e-5


def test_averaging_each_micro_batchs_mean_loss_does_not(results: list) -> None:
    assert _relative(results[0]["reference", "naive"], results[0]["reference", "1x4"]) > 1e-2


@pytest.mark.parametrize("model", ["reference", "hf"])
def test_context_parallel_ranks_splitting_the_rows_give_the_same_gradient(results: list, model: str) -> None:
    for result in results:
        assert _relative(result[model, "cp"], result[model, "1x4"]) < 1e-4
