"""What the applier reads of a config: its option groups, taken whole, so a new option in a group reaches the
``apply_*`` leaves without another signature changing."""

from dataclasses import dataclass, field

from lightning_mixedfsdp.config import Float8, Memory, MixedFSDPConfig, Parallelism, Sharding


@dataclass(frozen=True)
class ApplyOptions:
    """The option groups that change how a plan is applied (the plan itself holds every dtype decision)."""

    sharding: Sharding = field(default_factory=Sharding)
    """Resharding after forward, activation checkpointing, per-unit compile, recomputed dtype boundaries."""
    memory: Memory = field(default_factory=Memory)
    """CPU offload of the sharded state."""
    float8: Float8 = field(default_factory=Float8)
    """Emulated float8 matmuls."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    """Context parallelism's ring attention."""

    @classmethod
    def of(cls, config: MixedFSDPConfig) -> "ApplyOptions":
        """A validated config's groups."""
        return cls(config.sharding, config.memory, config.float8, config.parallelism)
