"""What the Fabric and Trainer strategies share: config intake, precision translation, sharding a module."""

import logging
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Any, Callable, Dict, Mapping, Optional, Union
from weakref import WeakKeyDictionary

from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_mixedfsdp.apply import AppliedPlan, apply_plan, sync_replicas
from lightning_mixedfsdp.config import SUPPORTED_PRECISIONS, MixedFSDPConfig
from lightning_mixedfsdp.leaks import install_leak_check
from lightning_mixedfsdp.loading import has_meta_tensors, materialize_sharded, meta_template
from lightning_mixedfsdp.matching import class_matches
from lightning_mixedfsdp.mesh import ParallelMeshes
from lightning_mixedfsdp.plan import ShardPlan, plan_sharding
from lightning_mixedfsdp.precision import MixedFSDPPrecision

log = logging.getLogger(__name__)
STRATEGY_NAME = "mixed_fsdp2"

ConfigInput = Union[MixedFSDPConfig, Mapping[str, Any], None]


def make_config(config: ConfigInput, fields: Dict[str, Any], owner: str) -> MixedFSDPConfig:
    """Merge a config object (or mapping, e.g. an OmegaConf block) with keyword fields; validate once."""
    if config is not None and not isinstance(config, (MixedFSDPConfig, Mapping)):
        raise TypeError(f"{owner}(config={config!r}) must be a MixedFSDPConfig or a mapping of its fields.")
    base = dict(config) if isinstance(config, Mapping) else asdict(config or MixedFSDPConfig())
    if fields.get("wrap_units") == "auto":
        fields = {**fields, "wrap_units": None}
    return MixedFSDPConfig.from_kwargs(**{**base, **fields}).validate()


def adopt_precision(plugin: Optional[Precision], config: MixedFSDPConfig, owner: str) -> Optional[Precision]:
    """Translate Lightning's precision plugins (built from a precision flag) into ours."""
    if plugin is None or isinstance(plugin, MixedFSDPPrecision):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin).__name__ not in ("Precision", "HalfPrecision", "MixedPrecision") or flag not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"{owner} does not support the precision plugin {type(plugin).__name__} (precision={flag!r})."
            f" Use precision= one of {list(SUPPORTED_PRECISIONS)}; fp16 needs a sharded gradient scaler that"
            " FSDP2 does not provide."
        )
    return MixedFSDPPrecision(flag, config)


def validate_mesh_sizes(owner: str, data_parallel_size: Any, replicate_size: Any, tensor_parallel_size: Any) -> None:
    problems = []
    if data_parallel_size != "auto" and not (isinstance(data_parallel_size, int) and data_parallel_size >= 1):
        problems.append(f"data_parallel_size={data_parallel_size!r} must be 'auto' or an int >= 1")
    for name, value in (("data_parallel_replicate_size", replicate_size), ("tensor_parallel_size", tensor_parallel_size)):
        if not (isinstance(value, int) and value >= 1):
            problems.append(f"{name}={value!r} must be an int >= 1")
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems) + ".")


def shard_size(data_parallel_size: Any, replicate_size: int, tensor_parallel_size: int, world_size: int) -> int:
    if data_parallel_size != "auto":
        return data_parallel_size
    return max(world_size // (replicate_size * tensor_parallel_size), 1)


class ShardedModules:
    """Plans applied by one strategy, per module; also the gradient-sync switch for gradient accumulation."""

    def __init__(self) -> None:
        self._applied: "WeakKeyDictionary[nn.Module, AppliedPlan]" = WeakKeyDictionary()

    def shard(
        self,
        module: nn.Module,
        config: MixedFSDPConfig,
        precision: MixedFSDPPrecision,
        meshes: ParallelMeshes,
        device: Any,
        parallelize: Callable[[nn.Module, Any], nn.Module],
    ) -> nn.Module:
        """Meta template, storage casts, the user's parallelize_fn, then the dtype plan on the data-parallel mesh."""
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule

        on_meta = has_meta_tensors(module)
        # rank 0 alone initialises a meta model, on an unsharded copy in the dtypes it was built with, so values
        # match a single-process init (random draws depend on the dtype)
        template = meta_template(module) if on_meta and config.init_meta_params and dist.get_rank() == 0 else None
        precision.cast_to_storage(module)
        module = parallelize(module, meshes.root)
        if not isinstance(module, nn.Module):
            raise TypeError(f"The `parallelize_fn` must return an `nn.Module`, but got {type(module).__name__}.")
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            rank_zero_info(f"{STRATEGY_NAME}: the model is already sharded by the user; applying no dtype plan.")
            if on_meta:
                materialize_sharded(module, None, device, initialise=False)
            return module
        plan = plan_sharding(module, config, precision=precision.precision)
        for warning in plan.warnings:
            rank_zero_warn(f"{STRATEGY_NAME}: {warning}")
        if config.print_report:
            rank_zero_info(plan.report())
        applied = apply_plan(module, plan, meshes, device, config.reshard_after_forward)
        if on_meta:
            materialize_sharded(module, template, device, initialise=config.init_meta_params)
        else:
            sync_replicas(applied, meshes)
        if config.check_dtype_leaks and plan.bulk.compute is not None:
            keep_fp32 = [n for n, m in module.named_modules() if any(class_matches(m, r) for r in config.keep_fp32_modules)]
            install_leak_check(module, plan.bulk.compute, keep_fp32)
        self._applied[module] = applied
        return module

    def plan_of(self, module: nn.Module) -> ShardPlan:
        module = getattr(module, "_forward_module", module)
        if module not in self._applied:
            raise KeyError(f"{type(module).__name__} was not set up by the {STRATEGY_NAME} strategy.")
        return self._applied[module].plan

    def set_requires_gradient_sync(self, module: nn.Module, requires_sync: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.set_requires_gradient_sync(requires_sync, recurse=False)
        applied = self._applied.get(module)
        if applied is not None:
            applied.reducer.requires_gradient_sync = requires_sync


def default_timeout() -> Optional[timedelta]:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    return default_pg_timeout
