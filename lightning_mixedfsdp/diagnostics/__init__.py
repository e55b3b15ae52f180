"""Looking at a sharded model: the dtype-leak check and collective counting."""

from lightning_mixedfsdp.diagnostics.collectives import CollectiveCounts, count_collectives
from lightning_mixedfsdp.diagnostics.leaks import DtypeLeakWarning, install_leak_check

__all__ = ["CollectiveCounts", "DtypeLeakWarning", "count_collectives", "install_leak_check"]
