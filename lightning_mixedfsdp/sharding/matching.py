"""Which parameters must stay fp32: class-name rules, parameter-name regexes and HF keep-in-fp32 attributes."""

import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Sequence, Tuple

from torch import nn

from lightning_mixedfsdp.config import MixedFSDPConfig

_HF_ATTRIBUTES = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")


@dataclass(frozen=True)
class PinnedParams:
    """The outcome of matching: pinned parameter names with the rule that pinned each."""

    rule_of: Dict[str, str]
    """Qualified parameter name -> the first rule that matched it (e.g. ``"module:RMSNorm"``)."""
    strict: FrozenSet[str]
    """Names pinned by an HF ``_keep_in_fp32_modules_strict`` list (these stay fp32 even when frozen)."""
    unmatched_rules: Tuple[str, ...]
    """User rules that matched no parameter."""

    def __contains__(self, name: object) -> bool:
        return name in self.rule_of


def class_matches(module: nn.Module, rule: str) -> bool:
    """A dotted rule is a qualified class path matched exactly; a plain rule is a class-name suffix."""
    cls = type(module)
    if "." in rule:
        return f"{cls.__module__}.{cls.__qualname__}" == rule
    return cls.__name__.endswith(rule)


def find_keep_fp32_params(
    model: nn.Module,
    module_rules: Sequence[str] = (),
    param_patterns: Sequence[str] = (),
    honor_hf: bool = True,
) -> PinnedParams:
    """Match every rule against ``model``; the first matching rule is recorded per parameter."""
    param_names = [name for name, _ in model.named_parameters()]
    rule_of: Dict[str, str] = {}
    hits: Dict[str, int] = {}

    def pin(names: Iterable[str], rule: str) -> None:
        for name in names:
            rule_of.setdefault(name, rule)
            hits[rule] = hits.get(rule, 0) + 1

    for rule in module_rules:
        label = f"module:{rule}"
        hits.setdefault(label, 0)
        for prefix, module in model.named_modules():
            if class_matches(module, rule):
                pin((_join(prefix, n) for n, _ in module.named_parameters()), label)
    for pattern in param_patterns:
        label = f"param:{pattern}"
        hits.setdefault(label, 0)
        compiled = re.compile(pattern)
        pin((n for n in param_names if compiled.search(n)), label)

    strict: List[str] = []
    if honor_hf:
        for attribute in _HF_ATTRIBUTES:
            for name, rule in _hf_matches(model, attribute):
                pin([name], rule)
                if attribute.endswith("_strict"):
                    strict.append(name)

    unmatched = tuple(rule for rule, count in hits.items() if count == 0)
    return PinnedParams(rule_of=rule_of, strict=frozenset(strict), unmatched_rules=unmatched)


def keep_fp32_params_of(model: nn.Module, config: MixedFSDPConfig) -> PinnedParams:
    """:func:`find_keep_fp32_params` with the config's rules."""
    return find_keep_fp32_params(model, config.keep_fp32_modules, config.keep_fp32_params, config.honor_hf_keep_in_fp32)


def _hf_matches(model: nn.Module, attribute: str) -> List[Tuple[str, str]]:
    """transformers' own semantics: a listed name matches whole dotted components of the param name."""
    matches = []
    for prefix, module in model.named_modules():
        names = getattr(module, attribute, None)
        if not names:
            continue
        for listed in names:
            component = re.compile(rf"(^|\.){re.escape(listed)}($|\.)")
            for name, _ in module.named_parameters():
                if component.search(name):
                    matches.append((_join(prefix, name), f"hf:{attribute}[{listed}]"))
    return matches


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def keep_fp32_module_names(model: nn.Module, module_rules: Sequence[str]) -> List[str]:
    """Qualified names of the modules a keep-fp32 class rule matches (their buffers stay fp32 too)."""
    return [name for name, module in model.named_modules() if any(class_matches(module, r) for r in module_rules)]


def find_frozen_modules(model: nn.Module) -> List[str]:
    """Qualified names of the largest submodules whose params are all frozen (``requires_grad=False``)."""
    frozen: List[str] = []
    for name, module in model.named_modules():
        if any(is_within(name, outer) for outer in frozen):
            continue
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            frozen.append(name)
    return frozen


def is_within(name: str, outer: str) -> bool:
    """``name`` (a module or param) is ``outer`` or inside it; ``""`` is the root, which holds everything."""
    return outer == "" or name == outer or name.startswith(f"{outer}.")
