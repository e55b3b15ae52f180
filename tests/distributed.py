"""The multi-process harness lives in the package (benchmarks use it too)."""

from lightning_mixedfsdp.recipes.launch import run_distributed

__all__ = ["run_distributed"]
