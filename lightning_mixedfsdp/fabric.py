"""Public entry point: ``lightning_mixedfsdp.fabric.MixedFSDP2Strategy`` (lives in ``strategies/fabric.py``)."""

from lightning_mixedfsdp.strategies.fabric import MixedFSDP2Strategy

__all__ = ["MixedFSDP2Strategy"]
