"""Mixed-dtype FSDP2 for Lightning: ``Fabric(strategy="mixed_fsdp2")``.

Importing the package registers ``"mixed_fsdp2"`` with Fabric's and the Trainer's strategy registries when Lightning
is installed. The torch-only layers (config, model, planning, mesh, apply, materialize, model_setup, pipelining,
checkpoint) import without it.
"""

import logging
from typing import Any

from lightning_mixedfsdp.apply.clip import clip_grad_norm_, total_grad_norm
from lightning_mixedfsdp.apply.muon import MuonWithAdamW, muon_with_adamw
from lightning_mixedfsdp.checkpoint import load_full_weights, load_weights
from lightning_mixedfsdp.config import FaultTolerance, MixedFSDPConfig, MixedFSDPConfigError
from lightning_mixedfsdp.planning.matching import find_keep_fp32_params
from lightning_mixedfsdp.planning.planner import plan_sharding
from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.planning.types import DtypeKey, ShardGroup, ShardPlan


def _log_to_stderr() -> None:
    # what the library tells users (the dtype report of print_report=True) goes through the "lightning_mixedfsdp"
    # logger; as Lightning does for its own, it prints at INFO unless the application configured logging itself
    logger = logging.getLogger(__name__)
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False


def _register() -> None:
    # launchers re-import this package in every child process; registration is guarded against doubles
    try:
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
    except ImportError:  # the torch-only layers work without Lightning; there is nothing to register with
        return

    from lightning_mixedfsdp.strategies import fabric, trainer

    fabric.MixedFSDP2Strategy.register_strategies(STRATEGY_REGISTRY)
    trainer.MixedFSDP2Strategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    # the precision plugin and the monitor are Lightning classes: imported on first use, so the package imports
    # without Lightning
    if name == "MixedFSDPPrecision":
        from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision

        return MixedFSDPPrecision
    if name == "stream_weights":  # finds the Lightning strategy that set the model up
        from lightning_mixedfsdp.strategies.weight_stream import stream_weights

        return stream_weights
    if name == "PrecisionMonitor":  # a Lightning callback, imported on first use as well
        from lightning_mixedfsdp.strategies.precision_monitor import PrecisionMonitor

        return PrecisionMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_log_to_stderr()
_register()

__all__ = [
    "DtypeKey",
    "FaultTolerance",
    "MixedFSDPConfig",
    "MixedFSDPConfigError",
    "MixedFSDPPrecision",
    "MuonWithAdamW",
    "PrecisionMonitor",
    "ShardGroup",
    "ShardPlan",
    "clip_grad_norm_",
    "find_keep_fp32_params",
    "format_plan",
    "load_full_weights",
    "load_weights",
    "muon_with_adamw",
    "plan_sharding",
    "total_grad_norm",
]
