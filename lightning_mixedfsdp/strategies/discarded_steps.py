"""The LR schedulers of a step torchft's vote discarded: those that step per optimizer step skip its batch, so the
schedule counts committed steps only. Lightning steps no scheduler of an interval it does not know, so their configs
carry another interval until the next batch begins."""

from dataclasses import replace
from typing import Any, List, Optional

SKIPPED_INTERVAL = "skipped: discarded step"
"""The interval a step-interval LR scheduler config has while the batch of a discarded step ends."""


class HeldSchedulers:
    """The Trainer's LR scheduler configs, held aside while a discarded step's batch ends."""

    def __init__(self) -> None:
        self._held: Optional[List[Any]] = None

    def hold(self, configs: List[Any]) -> List[Any]:
        """The configs to use until :meth:`release`: step-interval ones skip; the originals are kept (once per
        batch)."""
        if self._held is not None:
            return configs
        self._held = configs
        return [replace(c, interval=SKIPPED_INTERVAL) if c.interval == "step" else c for c in configs]

    def release(self, configs: List[Any]) -> List[Any]:
        """The original configs when some were held, else ``configs`` unchanged."""
        held, self._held = self._held, None
        return configs if held is None else held
