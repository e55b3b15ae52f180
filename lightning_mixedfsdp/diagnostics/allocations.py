"""The peak of the bytes a block of code allocates on the host, from torch's profiler (``profile_memory``): every
allocation and free of torch's CPU allocator, summed in time order. An allocator's ledger, not RSS: a tiny
model's bucket is far below RSS's noise. Tensors the block allocates and keeps count until the end; what existed
before it is the zero."""

from types import TracebackType
from typing import Optional, Type

from lightning_mixedfsdp.compat.torch import profiled_host_memory_changes


class AllocationLedger:
    """``with AllocationLedger() as ledger: ...``, then ``ledger.peak_bytes`` (the most held at once beyond the
    start) and ``ledger.end_bytes`` (what is still held at the end)."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak_bytes = 0
        self.end_bytes = 0

    def __enter__(self) -> "AllocationLedger":
        self._profile.__enter__()
        return self

    def __exit__(
        self, kind: Optional[Type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType]
    ) -> None:
        self._profile.__exit__(kind, error, trace)
        if kind is not None:
            return
        live = 0
        for _, change in sorted(profiled_host_memory_changes(self._profile)):
            live += change
            self.peak_bytes = max(self.peak_bytes, live)
        self.end_bytes = live
