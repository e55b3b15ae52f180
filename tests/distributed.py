"""The multi-process harness (`tests/launch.py`, which the benchmarks use too) and the device tests run on."""

import os

import torch

from tests.launch import run_distributed

ACCELERATOR_ENV = "MIXED_FSDP_TEST_ACCELERATOR"


def accelerator_for(world_size: int) -> str:
    """Where a test of ``world_size`` ranks runs: ``$MIXED_FSDP_TEST_ACCELERATOR`` (``cpu``, ``cuda`` or ``auto``, the
    default). ``auto`` takes CUDA (NCCL) when there is a GPU per rank, else the CPU (gloo): no test needs a GPU."""
    choice = os.environ.get(ACCELERATOR_ENV, "auto")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    return choice


__all__ = ["accelerator_for", "run_distributed"]
