"""What a launch's loggers and progress bar leave: every logger of one launch in one ``logs/version_N``, and a bar
without the logger's version. A plain model on one CPU process (the runner's loggers and bar; no strategy needed)."""

import importlib.util
from pathlib import Path
from typing import Any, List

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mixedfsdp.recipes.run.console import progress_bar
from lightning_mixedfsdp.recipes.run.run_folder import RunFolder
from lightning_mixedfsdp.recipes.run.runner import build_loggers


class LoggingModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


def launch(folder: RunFolder, logger: str) -> pl.Trainer:
    """One short fit with the runner's loggers and bar, as one launch of a run."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        log_every_n_steps=1,
        limit_val_batches=0,
        logger=build_loggers(logger, folder),
        callbacks=[progress_bar()],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(LoggingModel())
    return trainer


def files(folder: Path) -> List[str]:
    return sorted(p.name.split(".")[0] if p.name.startswith("events.") else p.name for p in folder.iterdir())


def test_tensorboard_and_the_csv_log_of_a_launch_share_one_version_folder(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("trainer.logger=tensorboard needs tensorboard: pip install tensorboard")
    folder = RunFolder(tmp_path)
    launch(folder, "tensorboard")
    launch(folder, "tensorboard")  # a resumed or extended run: the next version, for both loggers
    assert sorted(p.name for p in folder.logs.iterdir()) == ["version_0", "version_1"]
    for version in ("version_0", "version_1"):
        assert files(folder.logs / version) == ["events", "hparams.yaml", "metrics.csv"]


def test_the_progress_bar_leaves_out_the_logger_version(tmp_path: Path) -> None:
    trainer = launch(RunFolder(tmp_path), "csv")
    assert get_standard_metrics(trainer) == {"v_num": 0}  # what Lightning's own bar adds
    bar = trainer.progress_bar_callback
    assert bar is not None and type(bar).__name__ in ("RichBar", "TQDMBar")
    assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)
