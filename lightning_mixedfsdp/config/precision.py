"""Lightning precision flags and the bulk dtypes they resolve to: the one check of a flag, and dtype names."""

from typing import Any, Dict, Literal, NamedTuple, Optional, get_args

import torch

from lightning_mixedfsdp.config.groups import DtypeChoice, StorageChoice

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true"]

SUPPORTED_PRECISIONS: tuple = get_args(PrecisionFlag)
DTYPES: Dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The dtypes a config or recipe names, by the short names it uses."""
_SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# Lightning precision flag -> (storage, compute) for the non-pinned bulk; None means "as the model arrives"
_PRECISION_TO_BULK = {
    "32-true": (None, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}


def precision_problem(precision: Any) -> Optional[str]:
    """Why ``precision`` cannot be used with mixed_fsdp2, with the fix; None when it can."""
    if precision in SUPPORTED_PRECISIONS:
        return None
    return (
        f"precision={precision!r} is not supported; use one of {list(SUPPORTED_PRECISIONS)}. fp16 needs a sharded"
        " gradient scaler that FSDP2 does not provide; use 'bf16-mixed' or 'bf16-true' instead."
    )


def check_precision(precision: Any, owner: str) -> PrecisionFlag:
    """``precision`` when supported, else a ValueError naming ``owner`` (the class that was given it)."""
    problem = precision_problem(precision)
    if problem is not None:
        raise ValueError(f"{owner}: {problem}")
    return precision


class BulkDtypes(NamedTuple):
    """Resolved dtypes of the non-pinned params; ``None`` means "each param's own dtype"."""

    storage: Optional[torch.dtype]
    compute: Optional[torch.dtype]
    reduce: Optional[torch.dtype]

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> "BulkDtypes":
        """One dtype for storage, compute and reduce: a load or export in ``dtype``."""
        return cls(dtype, dtype, dtype)

    @property
    def init_dtype(self) -> Optional[torch.dtype]:
        """The default dtype ``init_module()`` builds params in: the bulk storage dtype when it is bf16, as
        Lightning's ``bf16-true`` does (keep-fp32 params are then cast up by the plan, as HF's
        ``from_config(dtype=bf16)`` does); None keeps torch's default."""
        return self.storage if self.storage == torch.bfloat16 else None


def resolve_bulk_dtypes(
    storage: StorageChoice, compute_dtype: DtypeChoice, reduce_dtype: DtypeChoice, precision: PrecisionFlag
) -> BulkDtypes:
    """Combine the config's dtype fields with a checked precision flag; explicit fields win over the flag."""
    flag_storage, flag_compute = _PRECISION_TO_BULK[precision]
    resolved_storage = flag_storage if storage == "auto" else None if storage == "keep" else DTYPES[storage]
    resolved_compute = flag_compute if compute_dtype == "auto" else DTYPES[compute_dtype]
    resolved_reduce = resolved_compute if reduce_dtype == "auto" else DTYPES[reduce_dtype]
    return BulkDtypes(resolved_storage, resolved_compute, resolved_reduce)


def short_dtype(dtype: Optional[torch.dtype]) -> str:
    """``fp32``, ``bf16``, ...: a dtype as configs and reports name it; ``-`` for none."""
    return _SHORT_NAMES.get(dtype, str(dtype).replace("torch.", "")) if dtype is not None else "-"
