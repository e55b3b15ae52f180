"""Which tensors must stay fp32: class-name rules, name regexes and HF keep-in-fp32 attributes, matched against
params and buffers in one pass."""

import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from lightning_mixedfsdp.config import Dtypes
from lightning_mixedfsdp.model.names import ModuleIndex, is_within, join_name, named_tensors

HF_NON_STRICT, HF_STRICT = "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"


class RuleKind(str, Enum):
    """Where a keep-fp32 rule comes from."""

    MODULE = "module"
    """``keep_fp32_modules``: a class-name suffix or a qualified class path."""
    PARAM = "param"
    """``keep_fp32_params``: a regex searched in qualified param and buffer names."""
    HF = "hf"
    """An HF ``_keep_in_fp32_modules[_strict]`` entry, as ``<attribute>[<entry>]``."""


@dataclass(frozen=True)
class KeepRule:
    """One keep-fp32 rule; printed as ``kind:pattern`` (``module:RMSNorm``, ``param:A_log$``)."""

    kind: RuleKind
    pattern: str

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.pattern}"


@dataclass(frozen=True)
class KeepFp32Rules:
    """The keep-fp32 rules of a config, as plain values."""

    modules: Tuple[str, ...] = ()
    """Class-name suffixes or exact qualified class paths; every param and buffer of a matched module stays fp32."""
    names: Tuple[str, ...] = ()
    """Regexes searched in qualified param and buffer names."""
    honor_hf: bool = True
    """Honour HF ``_keep_in_fp32_modules`` (the strict list is always honoured)."""

    @classmethod
    def of(cls, dtypes: Dtypes) -> "KeepFp32Rules":
        """The rules of a config's ``dtypes`` group."""
        return cls(tuple(dtypes.keep_fp32_modules), tuple(dtypes.keep_fp32_params), dtypes.honor_hf_keep_in_fp32)


@dataclass(frozen=True)
class KeepFp32Matches:
    """The outcome of matching: every param or buffer kept fp32, with the rule that kept it."""

    rule_of: Dict[str, KeepRule]
    """Qualified param or buffer name -> the first rule that matched it."""
    strict: FrozenSet[str]
    """Names kept by an HF ``_keep_in_fp32_modules_strict`` list."""
    modules: Tuple[str, ...]
    """Qualified names of the modules a class rule matched (they compute in fp32 on purpose)."""
    unmatched_rules: Tuple[KeepRule, ...]
    """User rules that matched no param and no buffer."""

    def __contains__(self, name: object) -> bool:
        return name in self.rule_of


def class_matches(module: nn.Module, rule: str) -> bool:
    """A dotted rule is a qualified class path matched exactly; a plain rule is a class-name suffix."""
    cls = type(module)
    if "." in rule:
        return f"{cls.__module__}.{cls.__qualname__}" == rule
    return cls.__name__.endswith(rule)


def match_keep_fp32(model: nn.Module, rules: KeepFp32Rules, index: Optional[ModuleIndex] = None) -> KeepFp32Matches:
    """Match every rule against ``model``'s params and buffers (canonical names); the first matching rule is
    recorded per tensor."""
    index = index or ModuleIndex(model)
    tensor_names = [name for name, _ in named_tensors(model)]
    rule_of: Dict[str, KeepRule] = {}
    hits: Dict[KeepRule, int] = {}

    def keep(names: Iterable[str], rule: KeepRule) -> None:
        hits.setdefault(rule, 0)
        for name in names:
            rule_of.setdefault(name, rule)
            hits[rule] += 1

    matched_modules: List[str] = []
    for class_rule in rules.modules:
        rule = KeepRule(RuleKind.MODULE, class_rule)
        keep((), rule)
        for prefix, module in index.named_modules():
            if class_matches(module, class_rule):
                matched_modules.append(prefix)
                keep((n for n, _ in named_tensors(module, prefix)), rule)
    for pattern in rules.names:
        compiled = re.compile(pattern)
        keep((n for n in tensor_names if compiled.search(n)), KeepRule(RuleKind.PARAM, pattern))

    strict: List[str] = []
    attributes = (HF_NON_STRICT, HF_STRICT) if rules.honor_hf else (HF_STRICT,)
    for attribute in attributes:
        for name, rule in _hf_matches(index, attribute):
            keep([name], rule)
            if attribute == HF_STRICT:
                strict.append(name)

    unmatched = tuple(rule for rule, count in hits.items() if count == 0)
    return KeepFp32Matches(rule_of, frozenset(strict), tuple(dict.fromkeys(matched_modules)), unmatched)


def find_keep_fp32_params(
    model: nn.Module,
    module_rules: Sequence[str] = (),
    param_patterns: Sequence[str] = (),
    honor_hf: bool = True,
) -> KeepFp32Matches:
    """:func:`match_keep_fp32` with the rules given one by one (param and buffer names alike)."""
    return match_keep_fp32(model, KeepFp32Rules(tuple(module_rules), tuple(param_patterns), honor_hf))


def hf_name_matcher(listed: Sequence[str], transformers_version: Optional[str] = None) -> Callable[[str], bool]:
    """How the installed transformers matches ``_keep_in_fp32_modules[_strict]`` entries against tensor names.

    transformers 5: one unanchored regex search over the full name, ``*`` meaning ``.*``
    (``core_model_loading.build_glob_alternation``), so ``"norm"`` also matches ``input_layernorm.weight``.
    transformers 4: an entry matches a whole dotted component of the name.
    """
    if _major(transformers_version or _installed_transformers()) >= 5:
        pattern = re.compile("|".join(f"(?:{entry.replace('*', '.*')})" for entry in listed))
        return lambda name: pattern.search(name) is not None
    entries = set(listed)
    return lambda name: any(part in entries for part in name.split("."))


def _hf_matches(index: ModuleIndex, attribute: str) -> List[Tuple[str, KeepRule]]:
    """(qualified name, rule) for the tensors a module's HF list names, relative to that module, as HF loads them."""
    matches = []
    for prefix, module in index.named_modules():
        listed = sorted(getattr(module, attribute, None) or [])
        if not listed:
            continue
        matchers = {entry: hf_name_matcher([entry]) for entry in listed}
        for name, _ in named_tensors(module):
            hit = next((entry for entry, matches_entry in matchers.items() if matches_entry(name)), None)
            if hit is not None:
                matches.append((join_name(prefix, name), KeepRule(RuleKind.HF, f"{attribute}[{hit}]")))
    return matches


@lru_cache(maxsize=1)
def _installed_transformers() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # not installed: a model declaring the HF attributes itself gets the current semantics
        return "5"


def _major(version: str) -> int:
    return int(version.split(".")[0])


def find_frozen_modules(model: nn.Module, index: Optional[ModuleIndex] = None) -> List[str]:
    """Canonical names of the largest submodules whose params are all frozen (``requires_grad=False``)."""
    frozen: List[str] = []
    for name, module in (index or ModuleIndex(model)).named_modules():
        if any(is_within(name, outer) for outer in frozen):
            continue
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            frozen.append(name)
    return frozen
