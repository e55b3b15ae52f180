"""Helpers for the tests and benchmarks of code that runs on several processes, as Lightning and torch ship theirs:
``run_distributed`` (a function on N local ranks, results back to the caller), ``accelerator_for`` (where a launch
runs), and ``replica_groups`` (torchft replica groups as separate launches, a lighthouse, their JSON-line reports).
Not imported by the library itself."""

from lightning_mixedfsdp.testing.launch import accelerator_for, free_port, run_distributed

__all__ = ["accelerator_for", "free_port", "run_distributed"]
