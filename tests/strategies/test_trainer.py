"""Trainer(strategy="mixed_fsdp2") on 2 ranks: dtypes, gradient accumulation syncing once, clipping, resume."""

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from lightning_mixedfsdp.testing import accelerator_for
from tests.conftest import Launch
from tests.scenarios import (
    A_LOG,
    MIXER,
    BufferedLlama,
    describe_params,
    full_grads,
    full_params,
    global_batch,
    rank_slice,
)

WORLD = 2


class _DeviceProbe(torch.nn.Module):
    """A param-less child with a buffer that records every move: the strategy must move it, after sharding."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(3))
        self.moves: List[str] = []

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.moves.append("moved")
        return super()._apply(fn, recurse)


def _module(build_in_configure_model: bool = False, seed: int = 0, batches_by_step: bool = False) -> Any:
    import lightning.pytorch as pl
    from torchmetrics import MeanMetric

    from lightning_mixedfsdp.recipes.models.tiny_llama import causal_lm_loss

    class LlamaModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.model: Optional[torch.nn.Module] = None if build_in_configure_model else BufferedLlama(MIXER)
            self.probe = _DeviceProbe()
            self.mean_loss = MeanMetric()

        def configure_model(self) -> None:
            if self.model is None:  # builds layers only; the strategy shards them
                torch.manual_seed(seed)
                self.model = BufferedLlama(MIXER)

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            if batches_by_step:
                # a pure function of the step: resume then depends on model and optimizer state alone, not on
                # where Lightning restarts a non-stateful dataloader
                batch = rank_slice(global_batch(WORLD, self.global_step), self.global_rank, WORLD)
            loss = causal_lm_loss(self.model(batch), batch)
            self.mean_loss.update(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return LlamaModule()


class _Tokens(torch.utils.data.Dataset):
    """Sample i is row i of the global batches used everywhere in the tests."""

    def __init__(self, samples: int) -> None:
        self.rows = torch.cat([global_batch(WORLD, step) for step in range(samples // 4 + 1)])[:samples]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def _recorder() -> Any:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_mixedfsdp.diagnostics.collectives import count_collectives

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: List[float] = []
            self.counts: List[Dict[str, int]] = []
            self.first_grads: Dict[str, torch.Tensor] = {}
            self._stack: Optional[ExitStack] = None

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if self._stack is None:
                self._stack = ExitStack()
                self._counts = self._stack.enter_context(count_collectives())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.counts.append(self._counts.by_kind())
            self._stack.close()
            self._stack = None
            if not self.first_grads:
                self.first_grads = full_grads(pl_module.model)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
            self.losses.append(outputs["loss"].item())  # averaged over ranks after fit: no collective counted here

        def global_losses(self) -> List[float]:
            losses = torch.tensor(self.losses, dtype=torch.float64)
            dist.all_reduce(losses, op=dist.ReduceOp.AVG)
            return losses.tolist()

    return Recorder()


def _fit(
    samples: int,
    batch_size: int,
    max_steps: int,
    accumulate: int = 1,
    folder: Optional[Path] = None,
    ckpt_path: Optional[str] = None,
    build_in_configure_model: bool = False,
    seed: int = 0,
    batches_by_step: bool = False,
    strategy_fields: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy

    recorder = _recorder()
    callbacks = [recorder]
    if folder is not None:
        callbacks.append(ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(
        accelerator=accelerator_for(WORLD),
        devices=WORLD,
        strategy=MixedFSDP2Strategy(keep_fp32_params=A_LOG, **(strategy_fields or {})),
        precision="bf16-true",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=folder is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _module(build_in_configure_model, seed, batches_by_step)
    loader = torch.utils.data.DataLoader(_Tokens(samples), batch_size=batch_size, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    plan = trainer.strategy.plan_of(module.model)
    optimizer = trainer.optimizers[0]
    states = {
        name: optimizer.state[p]["exp_avg"].dtype for name, p in module.model.named_parameters() if p in optimizer.state
    }
    root_device = trainer.strategy.root_device
    return {
        "placement": {
            "module": module.device == root_device,
            "metric": all(t.device == root_device for t in module.mean_loss.metric_state.values()),
            "probe_moved_after_sharding": module.probe.moves == ["moved"] and module.probe.state.device == root_device,
        },
        "after": full_params(module.model),
        "losses": recorder.global_losses(),
        "counts": recorder.counts,
        "grads": recorder.first_grads,
        "params": describe_params(module.model),
        "exp_avg_dtypes": states,
        "predicted": plan.predicted_collectives(),
    }


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    checkpoints = Path(folder)
    uninterrupted = _fit(samples=12, batch_size=2, max_steps=6, folder=checkpoints, batches_by_step=True)
    first_epoch = sorted(checkpoints.glob("epoch=0-*"))
    resumed = _fit(samples=12, batch_size=2, max_steps=6, ckpt_path=str(first_epoch[0]), seed=5, batches_by_step=True)
    composed = {
        name: _fit(samples=12, batch_size=2, max_steps=3, strategy_fields=fields)
        for name, fields in (
            ("eager", {}),
            ("ac", {"activation_checkpointing": "full"}),
            ("ac_compile", {"activation_checkpointing": "full", "compile": True}),
        )
    }
    return {
        **composed,
        "accumulated": _fit(samples=16, batch_size=2, max_steps=1, accumulate=4, build_in_configure_model=True),
        "single": _fit(samples=16, batch_size=8, max_steps=1, build_in_configure_model=True),
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "checkpoints": [p.name for p in first_epoch],
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=240)


def test_dtypes_after_fit_are_the_planned_ones(results: list) -> None:
    for scenario in ("single", "uninterrupted", "accumulated"):
        out = results[0][scenario]
        for name, info in out["params"].items():
            pinned = "norm" in name or name.endswith("A_log")
            assert info["dtype"] == (torch.float32 if pinned else torch.bfloat16), (scenario, name)
            assert out["exp_avg_dtypes"][name] == info["dtype"], (scenario, name)


def test_accumulating_four_micro_batches_syncs_gradients_once(results: list) -> None:
    accumulated, single = results[0]["accumulated"], results[0]["single"]
    assert accumulated["counts"][0]["reduce_scatter"] == single["counts"][0]["reduce_scatter"]
    assert accumulated["counts"][0]["reduce_scatter"] == accumulated["predicted"]["reduce_scatter"]
    assert accumulated["counts"][0]["all_reduce"] == single["counts"][0]["all_reduce"] == 1
    # forwards and backwards still all-gather for every micro-batch
    assert accumulated["counts"][0]["all_gather"] == 4 * single["counts"][0]["all_gather"]


def test_accumulated_grads_match_the_single_batch_grads(results: list) -> None:
    accumulated, single = results[0]["accumulated"]["grads"], results[0]["single"]["grads"]
    assert set(accumulated) == set(single)
    for name, grad in single.items():
        # fp32 replicated grads: summation order only; bf16 grads accumulate 4 bf16 partial sums instead of 1
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if name.endswith("A_log") else {"rtol": 3e-2, "atol": 2e-3}
        torch.testing.assert_close(accumulated[name], grad, **tolerance, msg=name)


def test_resume_from_a_model_checkpoint_continues_with_identical_losses(results: list) -> None:
    assert results[0]["checkpoints"] == ["epoch=0-step=3.ckpt"]
    uninterrupted, resumed = results[0]["uninterrupted"]["losses"], results[0]["resumed"]["losses"]
    assert len(uninterrupted) == 6 and len(resumed) == 3
    assert resumed == uninterrupted[3:]


def test_every_buffer_and_metric_state_ends_up_on_the_root_device_after_sharding(results: list) -> None:
    for result in results:
        assert result["single"]["placement"] == {"module": True, "metric": True, "probe_moved_after_sharding": True}


def test_trainer_activation_checkpointing_is_bit_equal_and_compile_within_bf16_rounding(results: list) -> None:
    from tests.composed.test_compose import COMPILE_LOSS_TOLERANCE, COMPILE_MAX_PARAM_DIFF, COMPILE_MEAN_PARAM_DIFF

    eager, checkpointed, compiled = (results[0][k] for k in ("eager", "ac", "ac_compile"))
    assert checkpointed["losses"] == eager["losses"]
    torch.testing.assert_close(compiled["losses"], eager["losses"], **COMPILE_LOSS_TOLERANCE)
    for name, value in eager["after"].items():
        assert torch.equal(checkpointed["after"][name], value), name
        difference = (compiled["after"][name].float() - value.float()).abs()
        assert difference.max() <= COMPILE_MAX_PARAM_DIFF and difference.mean() <= COMPILE_MEAN_PARAM_DIFF, name
