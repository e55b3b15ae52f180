"""Mixed-dtype FSDP2 for Lightning: ``Fabric(strategy="mixed_fsdp2")``."""

from lightning_mixedfsdp.checkpoint import load_full_weights, load_weights
from lightning_mixedfsdp.config import MixedFSDPConfig, MixedFSDPConfigError
from lightning_mixedfsdp.precision import MixedFSDPPrecision
from lightning_mixedfsdp.sharding.clip import clip_grad_norm_, total_grad_norm
from lightning_mixedfsdp.sharding.matching import find_keep_fp32_params
from lightning_mixedfsdp.sharding.plan import DtypeKey, ShardGroup, ShardPlan, plan_sharding


def _register() -> None:
    # launchers re-import this package in every child process; registration is guarded against doubles
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mixedfsdp.strategies import fabric, trainer

    fabric.MixedFSDP2Strategy.register_strategies(STRATEGY_REGISTRY)
    trainer.MixedFSDP2Strategy.register_strategies(StrategyRegistry)


_register()

__all__ = [
    "DtypeKey",
    "MixedFSDPConfig",
    "MixedFSDPConfigError",
    "MixedFSDPPrecision",
    "ShardGroup",
    "ShardPlan",
    "clip_grad_norm_",
    "find_keep_fp32_params",
    "load_full_weights",
    "load_weights",
    "plan_sharding",
    "total_grad_norm",
]
