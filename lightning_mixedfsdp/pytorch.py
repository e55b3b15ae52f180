"""Public entry point: ``lightning_mixedfsdp.pytorch.MixedFSDP2Strategy`` (lives in ``strategies/trainer.py``)."""

from lightning_mixedfsdp.strategies.trainer import MixedFSDP2Strategy, MixedFSDPTrainerPrecision

__all__ = ["MixedFSDP2Strategy", "MixedFSDPTrainerPrecision"]
