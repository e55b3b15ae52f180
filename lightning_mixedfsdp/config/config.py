"""``MixedFSDPConfig``: the option groups nested in one object, the flat names that still reach them, and the one
validation (every problem at once)."""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch

import lightning_mixedfsdp.config.groups as groups
from lightning_mixedfsdp.config.groups import (
    Buffers,
    Diagnostics,
    Dtypes,
    FaultTolerance,
    Float8,
    Memory,
    Parallelism,
    Sharding,
    Weights,
)
from lightning_mixedfsdp.config.options import MixedFSDPConfigError, OptionGroup
from lightning_mixedfsdp.config.precision import BulkDtypes, check_precision, precision_problem, resolve_bulk_dtypes

OPTIONAL_GROUPS = ("fault_tolerance",)
"""Groups that are ``None`` unless set (the feature is off)."""


@dataclass(init=False)
class MixedFSDPConfig:
    """How ``mixed_fsdp2`` decides dtypes and FSDP groups: one option group per concern (each a dataclass with a
    docstring per field). Usable as an OmegaConf structured config.

    Build it with groups or mappings of their fields (the canonical spelling), or with the flat names each group
    lists in ``FLAT_NAMES``: ``MixedFSDPConfig(float8={"recipe": "tensorwise", "emulate": True})``,
    ``MixedFSDPConfig(float8="tensorwise", keep_fp32_params=[r"A_log$"])``. Setting a flat name writes through to
    its group; read options through their group (``config.dtypes.keep_fp32_params``)."""

    dtypes: Dtypes = field(default_factory=Dtypes)
    """Storage, compute and reduce dtypes of the bulk, and the rules that keep params fp32."""
    sharding: Sharding = field(default_factory=Sharding)
    """Wrap units, activation checkpointing, compile, resharding, replication of small groups."""
    float8: Float8 = field(default_factory=Float8)
    """Float8 training of the bulk's Linear layers."""
    memory: Memory = field(default_factory=Memory)
    """The frozen base in 4 bits, CPU offload."""
    buffers: Buffers = field(default_factory=Buffers)
    """How buffers stay equal on the data-parallel ranks."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    """Context and expert parallelism."""
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    """The dtype report, the dtype-leak check, how a non-finite grad norm is reported."""
    weights: Weights = field(default_factory=Weights)
    """Initialising, loading and exporting weights."""
    fault_tolerance: Optional[FaultTolerance] = None
    """Fault-tolerant replica groups with torchft (:class:`FaultTolerance`, or a mapping of its fields): a dead
    group costs the others seconds, and it heals from a live one when it restarts. Needs torchft
    (``pip install 'lightning-mixedfsdp[ft]'``) and a lighthouse you start. ``None``: off."""

    def __init__(self, **options: Any) -> None:
        nested = nested_options(options)
        for name, group_class in group_classes().items():
            value = nested.get(name)
            if value is None and name in OPTIONAL_GROUPS:
                setattr(self, name, None)
            else:
                setattr(self, name, group_class() if value is None else value)

    def __setattr__(self, name: str, value: Any) -> None:
        classes = group_classes()
        if name in classes:
            if value is not None or name not in OPTIONAL_GROUPS:
                value = classes[name].from_input(value, name, optional=name in OPTIONAL_GROUPS)
            object.__setattr__(self, name, value)
        elif name in flat_names():
            group, option = flat_names()[name]
            setattr(getattr(self, group), option, value)
        else:
            object.__setattr__(self, name, value)

    def problems(self) -> List[str]:
        """Every problem of this config, each with its fix; empty when valid."""
        problems: List[str] = []
        for name, group_class in group_classes().items():
            group = getattr(self, name)
            if group is None:
                continue
            if not isinstance(group, group_class):
                problems.append(f"{name}={group!r} must be a {group_class.__name__} or a mapping of its fields.")
            else:
                problems.extend(group.problems(name))
        if self.parallelism.context_parallel_size > 1 and self.sharding.compile:
            problems.append(
                f"parallelism.context_parallel_size={self.parallelism.context_parallel_size} with sharding.compile=True"
                " is not supported: the ring attention's routing runs outside compiled code; set sharding.compile=False"
                " (or parallelism.context_parallel_size=1)."
            )
        parallelism = self.parallelism
        no_replicas = parallelism.data_parallel_replicate_size == 1 and self.fault_tolerance is None
        if parallelism.replicate_sync != "every_step" and no_replicas:
            problems.append(
                f"parallelism.replicate_sync={parallelism.replicate_sync!r} syncs HSDP replicas (or fault-tolerant"
                " replica groups) every sync_every steps, and data_parallel_replicate_size=1 without fault_tolerance"
                " has none; set data_parallel_replicate_size >= 2 (e.g. one replica per node), or"
                " replicate_sync='every_step'."
            )
        if self.fault_tolerance is not None and parallelism.pipeline_parallel_size != 1:
            problems.append(
                f"parallelism.pipeline_parallel_size={parallelism.pipeline_parallel_size} with fault_tolerance is not"
                " supported yet: a replica group's heal does not reach across pipeline stages; set fault_tolerance=None"
                " or pipeline_parallel_size=1."
            )
        if self.fault_tolerance is not None and self.buffers.sync == "average":
            problems.append(
                "buffers.sync='average' averages buffers within one replica group only, so under fault_tolerance the"
                " groups' buffers would drift apart; use buffers.sync='broadcast' (or 'none')."
            )
        return problems

    def validate(self) -> "MixedFSDPConfig":
        """Raise :class:`MixedFSDPConfigError` listing every problem at once; return ``self`` when valid."""
        problems = self.problems()
        if problems:
            listed = "\n".join(f"  - {p}" for p in problems)
            raise MixedFSDPConfigError(f"MixedFSDPConfig has {len(problems)} problem(s):\n{listed}")
        return self

    def bulk_dtypes(self, precision: str, owner: str = "mixed_fsdp2") -> BulkDtypes:
        """The bulk dtypes for a Lightning precision flag, which is checked here (``owner`` names who was given it):
        the one place flags are validated and dtypes resolved."""
        dtypes = self.dtypes
        return resolve_bulk_dtypes(dtypes.storage, dtypes.compute, dtypes.reduce, check_precision(precision, owner))

    def bf16_updates_problem(self, precision: str) -> Optional[str]:
        """Why ``dtypes.bf16_updates`` has nothing to write under ``precision`` (the trained params keep fp32
        masters), with the fix; None when it applies (or is ``"nearest"``)."""
        method = self.dtypes.bf16_updates
        if method == "nearest" or precision_problem(precision) is not None:
            return None
        if self.bulk_dtypes(precision).storage != torch.float32:
            return None
        return (
            f"dtypes.bf16_updates={method!r} writes updates into params stored in bf16, and precision={precision!r}"
            f" (dtypes.storage={self.dtypes.storage!r}) stores them in fp32, as masters: nothing to write. Train"
            " with precision='bf16-true', or leave bf16_updates='nearest'."
        )

    @classmethod
    def from_input(
        cls, config: "Optional[Union[MixedFSDPConfig, Mapping[str, Any]]]", options: Dict[str, Any], owner: str
    ) -> "MixedFSDPConfig":
        """A strategy's config: a config object (or a mapping of its options, e.g. an OmegaConf block) with keyword
        ``options`` over it (each a group, a mapping of a group's fields, or a flat name), validated once; ``owner``
        is the class that was given them."""
        if config is not None and not isinstance(config, (MixedFSDPConfig, Mapping)):
            raise TypeError(f"{owner}(config={config!r}) must be a MixedFSDPConfig or a mapping of its options.")
        base = nested_options(dict(config)) if isinstance(config, Mapping) else _as_nested(config or cls())
        if options.get("wrap_units") == "auto":
            options = {**options, "wrap_units": None}
        return cls(**_merged(base, nested_options(options))).validate()


def group_classes() -> Dict[str, Type[OptionGroup]]:
    """Each option group's name in the config -> its class, read from the config's own fields."""
    return {f.name: _group_class(f.type) for f in fields(MixedFSDPConfig)}


def flat_names() -> Dict[str, Tuple[str, str]]:
    """Every flat name -> (group, option), from the groups' ``FLAT_NAMES``."""
    return {
        flat: (group, option)
        for group, group_class in group_classes().items()
        for flat, option in group_class.FLAT_NAMES.items()
    }


def nested_options(options: Mapping[str, Any]) -> Dict[str, Any]:
    """``options`` with every flat name moved into its group (``{"float8_emulate": True}`` ->
    ``{"float8": {"emulate": True}}``) and a group given one value as its main field (``{"float8": "tensorwise"}``
    -> ``{"float8": {"recipe": "tensorwise"}}``). Unknown names are refused with the valid ones."""
    classes, flat = group_classes(), flat_names()
    unknown = sorted(str(name) for name in options if name not in classes and name not in flat)
    if unknown:
        valid = sorted({*classes, *flat})
        raise MixedFSDPConfigError(f"MixedFSDPConfig got unknown option(s) {unknown}. Valid options: {valid}.")
    nested: Dict[str, Any] = {}
    for name, value in options.items():
        if name in classes:
            nested[name] = _group_value(classes[name], value)
    for name, value in options.items():
        if name not in classes:
            group, option = flat[name]
            current = nested.get(group)
            if current is None or isinstance(current, Mapping):
                nested[group] = {**(current or {}), option: value}
            else:  # a group object and a flat name of it: the flat name wins, on a copy
                nested[group] = {**asdict(current), option: value}
    return nested


def _group_value(group_class: Type[OptionGroup], value: Any) -> Any:
    """A group's value as given, with a single value for its main field turned into a mapping."""
    if value is None or isinstance(value, (Mapping, OptionGroup)) or group_class.MAIN_FIELD is None:
        return dict(value) if isinstance(value, Mapping) else value
    return {group_class.MAIN_FIELD: value}


def _as_nested(config: MixedFSDPConfig) -> Dict[str, Any]:
    return {
        name: asdict(getattr(config, name)) if getattr(config, name) is not None else None for name in group_classes()
    }


def _merged(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """``over``'s options over ``base``'s, group by group (a mapping updates a group's fields, anything else replaces
    the group)."""
    merged = dict(base)
    for name, value in over.items():
        below = merged.get(name)
        merged[name] = {**below, **value} if isinstance(value, Mapping) and isinstance(below, Mapping) else value
    return merged


def _group_class(hint: Any) -> Type[OptionGroup]:
    from typing import get_args

    if isinstance(hint, str):  # annotations read as strings
        return getattr(groups, hint.replace("Optional[", "").rstrip("]"))
    if isinstance(hint, type):
        return hint
    return next(arg for arg in get_args(hint) if arg is not type(None))
