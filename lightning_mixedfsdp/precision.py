"""The precision plugin: a Lightning precision flag as bulk dtypes, and the casts of inputs and outputs. It decides no
tensor's storage: the dtype plan does (``sharding/plan.py``)."""

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional

import torch
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn
from typing_extensions import override

from lightning_mixedfsdp.config import BulkDtypes, MixedFSDPConfig, check_precision
from lightning_mixedfsdp.sharding.tensors import cast_floating


class MixedFSDPPrecision(Precision):
    """Lightning precision flags mapped onto mixed-dtype sharding.

    ``"bf16-mixed"``: fp32 storage, bf16 compute. ``"bf16-true"``: bf16 storage and compute. ``"32-true"``: the model
    keeps the dtypes it arrives with and each group computes in its own dtype. The strategy hands the plugin the bulk
    dtypes it resolved from its config (:meth:`MixedFSDPConfig.bulk_dtypes`), so a plugin passed by the user cannot
    disagree with the plan; keep-fp32 params and buffers stay fp32 whatever the flag.
    """

    def __init__(self, precision: str = "32-true", bulk: Optional[BulkDtypes] = None) -> None:
        self.precision = check_precision(precision, type(self).__name__)  # type: ignore[assignment]
        self.bulk = bulk if bulk is not None else MixedFSDPConfig().bulk_dtypes(precision)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """No cast here: the strategy applies the dtype plan, after taking a meta model's template in the dtypes it was
        built with (random draws depend on the dtype)."""
        return module

    @override
    def forward_context(self) -> ContextManager:
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


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
