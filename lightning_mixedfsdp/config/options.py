"""What every option group shares: built from itself, a mapping of its fields or (for a group with a main field) one
value, and checked against its own type hints, so that an option is one typed field with a docstring and, at most,
one line of metadata or one semantic check."""

import re
import types
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple, Type, TypeVar, Union, get_args, get_origin

from typing_extensions import get_type_hints

TGroup = TypeVar("TGroup", bound="OptionGroup")

PATTERNS = "patterns"
"""Field metadata key: ``"names"`` (class names, each non-empty) or ``"regex"`` (each a valid regular expression)."""
MINIMUM = "minimum"
"""Field metadata key: the smallest number the field takes."""
ABOVE = "above"
"""Field metadata key: the number the field must exceed (a duration: ``0``)."""
FIX = "fix"
"""Field metadata key: how to fix a value below the minimum."""


class MixedFSDPConfigError(ValueError):
    """Raised with every problem of a :class:`~lightning_mixedfsdp.MixedFSDPConfig` at once."""


class OptionGroup:
    """Base of the option groups: a dataclass of one concern's options, each field typed and documented."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {}
    """The flat names that still reach this group's fields (``compute_dtype`` -> ``compute``): keywords of the
    strategies and of ``MixedFSDPConfig``, and recipe keys ``strategy.<flat name>``."""
    MAIN_FIELD: ClassVar[Optional[str]] = None
    """The field one value sets where the group used to be a single option (``float8="tensorwise"``)."""

    @classmethod
    def from_input(cls: Type[TGroup], value: Any, name: str, optional: bool = False) -> TGroup:
        """The group from itself, a mapping of its fields (unknown names refused with the valid ones), or one value
        for its main field; ``name`` is the group's name in the config, for the messages (``optional``: the group
        may be None, which the caller handles)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, OptionGroup) and issubclass(cls, type(value)):  # a group the configured one extends
            return cls(**{f.name: getattr(value, f.name) for f in fields(value)})  # type: ignore[arg-type]
        if isinstance(value, Mapping):
            known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
            unknown = sorted(str(key) for key in set(value) - set(known))
            if unknown:
                raise MixedFSDPConfigError(f"{name} got unknown field(s) {unknown}. Valid fields: {sorted(known)}.")
            return cls(**dict(value))
        if cls.MAIN_FIELD is not None and not isinstance(value, OptionGroup):
            return cls(**{cls.MAIN_FIELD: value})
        raise MixedFSDPConfigError(
            f"{name}={value!r} must be {'None, ' if optional else ''}a {cls.__name__} or a mapping of its fields"
            f" ({', '.join(f.name for f in fields(cls))})."  # type: ignore[arg-type]
        )

    def problems(self, name: str) -> List[str]:
        """Every problem of this group (its fields against their types, then its own checks), each with its fix;
        ``name`` prefixes each field (``float8.recipe``)."""
        hints = get_type_hints(type(self))
        found: List[str] = []
        for field in fields(self):  # type: ignore[arg-type]
            found.extend(value_problems(f"{name}.{field.name}", getattr(self, field.name), hints[field.name], field))
        return found + [f"{name}.{problem}" for problem in self.semantic_problems()]

    def semantic_problems(self) -> List[str]:
        """What the types cannot say (which options need which), each naming its field; empty when valid."""
        return []


def value_problems(name: str, value: Any, hint: Any, field: Any) -> List[str]:
    """The problems of one field's value against its type hint and metadata."""
    optional, hint = _unwrap_optional(hint)
    if value is None:
        return [] if optional else [f"{name}=None is not allowed; give a {_describe(hint)}."]
    origin = get_origin(hint)
    if origin in (Union, getattr(types, "UnionType", Union)):  # a word or a number: "auto" or an int >= 1
        members = get_args(hint)
        if any(not value_problems(name, value, member, field) for member in members):
            return []
        return [_either_problem(name, value, members, field.metadata)]
    if origin is Literal:
        choices = list(get_args(hint))
        if value not in choices:
            return [f"{name}={value!r} is not supported; use one of {choices}{' or None' if optional else ''}."]
        return []
    if hint is bool:
        return [] if isinstance(value, bool) else [f"{name}={value!r} must be True or False."]
    if hint in (int, float):
        return _number_problems(name, value, hint, field.metadata)
    if origin in (list, List):
        return _list_problems(name, value, field.metadata.get(PATTERNS))
    if origin in (dict, Dict):
        if not isinstance(value, Mapping) or not value:
            return [f"{name}={value!r} must be a non-empty mapping, or None."]
        return []
    if isinstance(hint, type) and issubclass(hint, OptionGroup):
        return value.problems(name) if isinstance(value, hint) else [f"{name}={value!r} must be a {hint.__name__}."]
    if hint is str:
        return [] if isinstance(value, str) else [f"{name}={value!r} must be a string."]
    return []


def _number_problems(name: str, value: Any, hint: type, metadata: Mapping[str, Any]) -> List[str]:
    minimum, above = metadata.get(MINIMUM), metadata.get(ABOVE)
    fix = metadata.get(FIX)
    valid_type = not isinstance(value, bool) and isinstance(value, (int,) if hint is int else (int, float))
    if valid_type and (minimum is None or value >= minimum) and (above is None or value > above):
        return []
    return [f"{name}={value!r} must be {_number_kind(hint, metadata)}{'; ' + fix if fix else ''}."]


def _number_kind(hint: Any, metadata: Mapping[str, Any]) -> str:
    """``an int >= 1``, ``a number > 0``: what a number field takes."""
    minimum, above = metadata.get(MINIMUM), metadata.get(ABOVE)
    bound = f" >= {minimum}" if minimum is not None else f" > {above}" if above is not None else ""
    return f"{'an int' if hint is int else 'a number'}{bound}"


def _either_problem(name: str, value: Any, members: Tuple[Any, ...], metadata: Mapping[str, Any]) -> str:
    """One problem for a value no member of a union takes: ``'auto' or an int >= 1``."""
    kinds = [
        " or ".join(repr(choice) for choice in get_args(member))
        if get_origin(member) is Literal
        else _number_kind(member, metadata)
        for member in members
    ]
    fix = metadata.get(FIX)
    return f"{name}={value!r} must be {' or '.join(kinds)}{'; ' + fix if fix else ''}."


def _list_problems(name: str, value: Any, patterns: Optional[str]) -> List[str]:
    if not isinstance(value, (list, tuple)):
        return [f"{name}={value!r} must be a list."]
    found = []
    for index, pattern in enumerate(value):
        if patterns is None:
            continue
        if not isinstance(pattern, str) or not pattern.strip():
            found.append(f"{name}[{index}]={pattern!r} is empty; remove it or give a name.")
        elif patterns == "regex":
            try:
                re.compile(pattern)
            except re.error as err:
                found.append(f"{name}[{index}]={pattern!r} is not a valid regex ({err}); fix or escape it.")
    return found


def _unwrap_optional(hint: Any) -> Tuple[bool, Any]:
    if get_origin(hint) in (Union, getattr(types, "UnionType", Union)):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(get_args(hint)) == 2:
            return True, args[0]
    return False, hint


def _describe(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return f"value of {list(get_args(hint))}"
    return getattr(hint, "__name__", str(hint))
