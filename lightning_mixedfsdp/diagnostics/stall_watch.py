"""From stalled shares to a warning: a param whose share stays above a threshold over consecutive samples is named
once, with its value range, the update size, its dtype's spacing there, and the keep-fp32 rule that would keep it in
fp32."""

import re
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from lightning_mixedfsdp.diagnostics.stalled_updates import StalledShare


def keep_fp32_rule(name: str) -> str:
    """A ``keep_fp32_params`` regex for ``name`` and its siblings in the other repeated blocks."""
    return "^" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


@dataclass
class StallWatch:
    """Consecutive samples above ``threshold`` per param; a warning the first time one reaches ``patience``."""

    threshold: float = 0.5
    patience: int = 3
    latest: Dict[str, StalledShare] = field(default_factory=dict)
    """Each param's figures of the latest sample."""
    streaks: Dict[str, int] = field(default_factory=dict)
    named: Dict[str, str] = field(default_factory=dict)
    """The params warned about, with their suggested rule."""

    def add(self, shares: Sequence[StalledShare]) -> List[str]:
        """Take one sample's shares; the warnings of the params that reached ``patience`` now."""
        warnings = []
        for share in shares:
            self.latest[share.name] = share
            self.streaks[share.name] = self.streaks.get(share.name, 0) + 1 if share.share > self.threshold else 0
            if self.streaks[share.name] >= self.patience and share.name not in self.named:
                self.named[share.name] = keep_fp32_rule(share.name)
                warnings.append(self.warning(share))
        return warnings

    def warning(self, share: StalledShare) -> str:
        low, high = share.value_range
        dtype = str(share.dtype).removeprefix("torch.")
        update = f"about {share.mean_abs_update:.2g}" if share.mean_abs_update is not None else "unknown"
        return (
            f"{share.name} ({dtype}) stopped learning: {share.share:.0%} of its elements with a non-zero gradient did"
            f" not change in {self.patience} sampled steps in a row. Its |values| span {low:.3g} to {high:.3g} (mean"
            f" {share.mean_abs_value:.3g}), where {dtype} numbers are {share.spacing:.3g} apart, and the optimizer's"
            f" update is {update} per element: an update under half that spacing rounds away. Keep it in fp32:"
            f" keep_fp32_params=[{self.named[share.name]!r}] (a recipe: strategy.dtypes.keep_fp32_params); or keep"
            " it bf16 and write its updates back without losing them: bf16_updates='stochastic' (no extra bytes) or"
            " 'kahan' (2 bytes per element; a recipe: strategy.dtypes.bf16_updates); when many large weights stall,"
            " train with precision='bf16-mixed' (fp32 params, bf16 compute) instead."
        )
