"""The precision plugin: storage dtypes before sharding, keep-fp32 params pinned, inputs/outputs cast."""

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, List, Optional

import torch
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn
from typing_extensions import override

from lightning_mixedfsdp.config import MixedFSDPConfig, check_precision, resolve_bulk_dtypes
from lightning_mixedfsdp.sharding.matching import (
    PinnedParams,
    find_frozen_modules,
    is_within,
    keep_fp32_module_names,
    keep_fp32_params_of,
)
from lightning_mixedfsdp.sharding.plan import param_key
from lightning_mixedfsdp.sharding.tensors import cast_floating


class MixedFSDPPrecision(Precision):
    """Lightning precision flags mapped onto mixed-dtype sharding.

    ``"bf16-mixed"``: fp32 storage, bf16 compute. ``"bf16-true"``: bf16 storage and compute. ``"32-true"``: the model
    keeps the dtypes it arrives with and each group computes in its own dtype. In every case keep-fp32 params are
    stored and computed in fp32 (unlike Lightning's own ``bf16-true``, which casts them to bf16), and their outputs
    are cast back to the compute dtype by the sharding plan.
    """

    def __init__(self, precision: str = "32-true", config: Optional[MixedFSDPConfig] = None) -> None:
        self.precision = check_precision(precision, type(self).__name__)  # type: ignore[assignment]
        self.config = (config or MixedFSDPConfig()).validate()
        self.bulk = resolve_bulk_dtypes(
            self.config.storage, self.config.compute_dtype, self.config.reduce_dtype, precision
        )

    def pinned_params(self, module: nn.Module) -> PinnedParams:
        return keep_fp32_params_of(module, self.config)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """No cast here: Fabric calls this before the strategy sees the model, and the strategy must first copy a meta
        model in its original dtypes (initialising in bf16 draws other random values than fp32 init then cast). The
        strategy calls :meth:`cast_to_storage` itself, on Fabric and Trainer alike."""
        return module

    def cast_to_storage(self, module: nn.Module) -> nn.Module:
        """Cast to storage dtypes, the same the planner gives: pinned params fp32, fully frozen modules in the compute
        dtype (buffers too), the rest in the bulk storage dtype when there is one. Idempotent."""
        pinned = self.pinned_params(module)
        frozen = find_frozen_modules(module) if self.config.pin_frozen_modules else []
        keep_fp32 = keep_fp32_module_names(module, self.config.keep_fp32_modules)
        with torch.no_grad():
            for name, param in module.named_parameters():
                in_frozen = any(is_within(name, f) for f in frozen)
                target = param_key(param, name in pinned, self.bulk, in_frozen).storage
                if param.dtype != target:
                    param.data = param.data.to(target)
            for prefix, submodule in module.named_modules():
                target = self._buffer_dtype(prefix, keep_fp32, frozen)
                for buffer_name, buffer in submodule.named_buffers(recurse=False):
                    if target is not None and buffer.is_floating_point() and buffer.dtype != target:
                        submodule._buffers[buffer_name] = buffer.to(target)
        return module

    def _buffer_dtype(self, module_name: str, keep_fp32: List[str], frozen: List[str]) -> Optional[torch.dtype]:
        if any(is_within(module_name, k) for k in keep_fp32):
            return torch.float32
        if self.bulk.compute is not None and any(is_within(module_name, f) for f in frozen):
            return self.bulk.compute
        return self.bulk.storage

    @override
    def forward_context(self) -> ContextManager:
        # like Lightning's bf16-true: tensors created inside forward default to bf16
        if self.bulk.storage == torch.bfloat16 and self.bulk.compute == torch.bfloat16:
            return _default_dtype(torch.bfloat16)
        return nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.bulk.compute is None:
            return data
        return cast_floating(data, self.bulk.compute)

    @override
    def convert_output(self, data: Any) -> Any:
        if self.bulk.compute is None:
            return data
        return cast_floating(data, torch.get_default_dtype())


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
