"""What the planner reads of a config: its option groups, taken whole, so a new option in a group reaches the
planner without another signature changing."""

from dataclasses import dataclass, field
from typing import Optional

from lightning_mixedfsdp.config import Dtypes, Float8, Memory, MixedFSDPConfig, Parallelism, Sharding


@dataclass(frozen=True)
class PlanOptions:
    """The option groups the plan depends on, and the fault-tolerant replica groups it records."""

    dtypes: Dtypes = field(default_factory=Dtypes)
    sharding: Sharding = field(default_factory=Sharding)
    float8: Float8 = field(default_factory=Float8)
    memory: Memory = field(default_factory=Memory)
    parallelism: Parallelism = field(default_factory=Parallelism)
    replica_groups: Optional[int] = None
    """Fault-tolerant replica groups every gradient is also averaged across (None: no fault tolerance)."""

    @classmethod
    def of(cls, config: MixedFSDPConfig) -> "PlanOptions":
        """A validated config's groups."""
        groups = config.fault_tolerance.num_replica_groups if config.fault_tolerance is not None else None
        return cls(config.dtypes, config.sharding, config.float8, config.memory, config.parallelism, groups)
