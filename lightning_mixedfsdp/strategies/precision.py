"""The precision plugin: a Lightning precision flag as bulk dtypes, and the casts of inputs and outputs.

What it pins: the bulk dtypes (storage, compute, reduce) that every tensor the plan does not pin takes, and the
model's floating inputs to the compute dtype. What it leaves to the plan: frozen modules (stored and computed in the
compute dtype) and keep-fp32 modules (stored and computed in fp32, handing the compute dtype back) are pinned where
every tensor's dtype is decided, once, by the pure dtype plan (``planning/planner.py``'s ``param_key``), and enforced
at setup by ``apply/applier.py`` (each group's ``MixedPrecisionPolicy``) and ``apply/boundaries.py``, so
initialisation, loading, export and the dry run read the same decision."""

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional, Tuple, Type, TypeVar

import torch
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn
from typing_extensions import override

from lightning_mixedfsdp.config import BulkDtypes, MixedFSDPConfig, PrecisionFlag
from lightning_mixedfsdp.model.tensors import cast_floating


class MixedFSDPPrecision(Precision):
    """Lightning precision flags mapped onto mixed-dtype sharding.

    ``"bf16-mixed"``: fp32 storage, bf16 compute. ``"bf16-true"``: bf16 storage and compute. ``"32-true"``: the model
    keeps the dtypes it arrives with and each group computes in its own dtype. The strategy hands the plugin the bulk
    dtypes it resolved from its config (:meth:`MixedFSDPConfig.bulk_dtypes`), so a plugin passed by the user cannot
    disagree with the plan; keep-fp32 params and buffers stay fp32 whatever the flag.
    """

    def __init__(self, precision: PrecisionFlag = "32-true", bulk: Optional[BulkDtypes] = None) -> None:
        # the flag is checked where the bulk dtypes are resolved from it (``MixedFSDPConfig.bulk_dtypes``)
        self.bulk = bulk if bulk is not None else MixedFSDPConfig().bulk_dtypes(precision, type(self).__name__)
        self.precision = precision
        self._autocast_device: Optional[str] = None

    def follow_lightning(self, device_type: str) -> None:
        """For a model the user sharded with FSDP themselves (no dtype plan applied): Lightning's own semantics,
        i.e. ``torch.autocast`` under ``bf16-mixed`` (its params stay fp32)."""
        if self.bulk.storage == torch.float32 and self.bulk.compute == torch.bfloat16:
            self._autocast_device = device_type

    @override
    def tensor_init_context(self) -> ContextManager:
        init_dtype = self.bulk.init_dtype
        return _default_dtype(init_dtype) if init_dtype is not None else nullcontext()

    @override
    def module_init_context(self) -> ContextManager:
        return self.tensor_init_context()

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """No cast here: the strategy applies the dtype plan, after taking a meta model's template in the dtypes it was
        built with (random draws depend on the dtype)."""
        return module

    @override
    def forward_context(self) -> ContextManager:
        if self._autocast_device is not None:
            return torch.autocast(self._autocast_device, dtype=torch.bfloat16)
        # like Lightning's bf16-true: tensors created inside forward default to bf16
        if self.bulk.storage == torch.bfloat16 and self.bulk.compute == torch.bfloat16:
            return _default_dtype(torch.bfloat16)
        return nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        return data if self.bulk.compute is None else cast_floating(data, self.bulk.compute)

    @override
    def convert_output(self, data: Any) -> Any:
        return data if self.bulk.compute is None else cast_floating(data, torch.get_default_dtype())


TPlugin = TypeVar("TPlugin", bound=MixedFSDPPrecision)


def adopt_precision(
    plugin: Any,
    config: MixedFSDPConfig,
    owner: str,
    plugin_class: Type[TPlugin],
    translatable: Tuple[type, ...],
) -> Optional[TPlugin]:
    """``plugin_class`` for the plugin's precision flag, with the bulk dtypes resolved from ``config``.

    Lightning's plugins built from a flag (exactly the ``translatable`` classes) are translated, and a
    :class:`MixedFSDPPrecision` passed by the user is rebuilt, so plugin and plan can never disagree; any other
    plugin is refused. The flag is checked once, where the bulk dtypes are resolved.
    """
    if plugin is None:
        return None
    flag = getattr(plugin, "precision", None)
    if not isinstance(plugin, MixedFSDPPrecision) and type(plugin) not in translatable:
        raise ValueError(
            f"{owner} does not support the precision plugin {type(plugin).__name__} (precision={flag!r}). Pass a"
            " precision flag instead of a custom plugin."
        )
    bulk = config.bulk_dtypes(str(flag), owner)
    problem = config.bf16_updates_problem(str(flag))
    if problem is not None:
        raise ValueError(f"{owner}: {problem}")
    return plugin_class(flag, bulk)  # type: ignore[arg-type]


def plugin_or_default(
    plugin: Optional[MixedFSDPPrecision], config: MixedFSDPConfig, plugin_class: Type[TPlugin]
) -> TPlugin:
    """The adopted plugin; Lightning's default flag, ``"32-true"``, before the connector hands one over."""
    if plugin is None:
        return plugin_class("32-true", config.bulk_dtypes("32-true"))
    assert isinstance(plugin, plugin_class)  # the precision setter adopted it
    return plugin


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
