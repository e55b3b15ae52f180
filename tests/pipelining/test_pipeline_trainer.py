"""2 ranks, the Trainer under pipeline parallelism 2: a LightningModule that opts in (manual optimization, its
training step calling ``pipeline_step``, clipping through ``self.clip_gradients``) trains as one process does, its
token-normalised loss exact with trained tokens spread unevenly over the micro-batches; automatic optimization and
gradient accumulation are refused with the fix, on every rank."""

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from tests.conftest import Launch
from tests.pipelining.test_pipeline_parallel import LR, STEPS, batches, llama
from tests.scenarios import full_params

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD, IGNORED = 2, -100


def labels_of(tokens: torch.Tensor) -> torch.Tensor:
    """Unshifted labels with most of the first rows' tokens left out: the micro-batches train unequal counts."""
    labels = tokens.clone()
    labels[: tokens.shape[0] // 2, : tokens.shape[1] - 2] = IGNORED
    return labels


def token_mean_loss(output: Any, labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The summed token loss of this (micro-)batch over the step's trained-token ``count``."""
    logits = output.logits if hasattr(output, "logits") else output
    flat = logits[:, :-1].float().flatten(0, 1)
    return nn.functional.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=IGNORED, reduction="sum") / count


def _trainer_module(automatic: bool) -> Any:
    import lightning.pytorch as pl

    class PipelinedLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()
            self.automatic_optimization = automatic
            self.losses: List[float] = []
            self.norms: List[float] = []

        def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
            optimizer: Any = self.optimizers()
            labels = labels_of(tokens)
            count = (labels[:, 1:] != IGNORED).sum()

            def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
                return token_mean_loss(output, target, count)

            strategy: Any = self.trainer.strategy
            loss = strategy.pipeline_step(self.model, tokens, target=labels, loss_fn=loss_fn, loss_reduction="sum")
            self.clip_gradients(optimizer, gradient_clip_val=1e9, gradient_clip_algorithm="norm")
            self.norms.append(self.trainer.strategy.precision_plugin.last_norm.item())
            optimizer.step()
            optimizer.zero_grad()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return PipelinedLM()


def _fit(automatic: bool = False, accumulate: int = 1) -> Any:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy

    module = _trainer_module(automatic)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=MixedFSDP2Strategy(pipeline_parallel_size=2, pipeline_microbatches=4),
        precision="32-true",
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches()[:STEPS], batch_size=None))
    return module


def _scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    module = _fit()
    out["losses"], out["norms"], out["params"] = module.losses, module.norms, full_params(module.model)
    # Lightning refuses accumulation under manual optimization itself; under automatic optimization the strategy
    # names both problems at once
    for case, kwargs in {"automatic": {"automatic": True}, "accumulate": {"automatic": True, "accumulate": 2}}.items():
        try:
            _fit(**kwargs)
            out[case] = "no error"
        except ValueError as error:
            out[case] = str(error)
    return out


LAUNCH = Launch(_scenarios, WORLD, with_folder=False, timeout=400)


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for tokens in batches()[:STEPS]:
        labels = labels_of(tokens)
        loss = token_mean_loss(model(tokens), labels, (labels[:, 1:] != IGNORED).sum())
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


def test_a_lightning_module_that_opts_in_trains_as_one_process(results: list, reference: Dict[str, Any]) -> None:
    params: Dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        params.update(result["params"])
    assert set(params) == set(reference["params"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value.detach(), atol=1e-5, rtol=0, msg=name)


def test_automatic_optimization_is_refused_with_the_fix(results: list) -> None:
    for result in results:
        assert (
            "PipelinedLM uses automatic optimization; set `self.automatic_optimization = False`" in result["automatic"]
        ), result["automatic"]


def test_gradient_accumulation_is_refused_with_the_fix(results: list) -> None:
    for result in results:
        assert (
            "accumulate_grad_batches=2 is not supported: raise pipeline_microbatches instead" in result["accumulate"]
        ), result["accumulate"]
