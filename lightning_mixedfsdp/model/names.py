"""One canonical name per module, param and buffer, whatever wrappers users and Lightning put around a model.

Activation checkpointing (``checkpoint_wrapper``) and ``torch.compile`` insert ``_checkpoint_wrapped_module`` and
``_orig_mod`` into qualified names; torch's distributed state-dict helpers (``_get_fqns``) strip both, and so do we,
so plans, reports, exports and checkpoints all speak of ``layers.0.attention.A_log``.
"""

import sys
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Tuple

from torch import Tensor, nn
from typing_extensions import TypeGuard

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

WRAPPER_ATTRIBUTES = ("_checkpoint_wrapped_module", "_orig_mod")


def canonical_name(name: str) -> str:
    """``name`` without wrapper components (``layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``)."""
    if not any(attribute in name for attribute in WRAPPER_ATTRIBUTES):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


def join_name(prefix: str, name: str) -> str:
    """``name`` qualified under ``prefix`` (``""`` is the root)."""
    return f"{prefix}.{name}" if prefix else name


def is_within(name: str, outer: str) -> bool:
    """``name`` (a module or param) is ``outer`` or inside it; ``""`` is the root, which holds everything."""
    return outer == "" or name == outer or name.startswith(f"{outer}.")


Unwrapper = Callable[[nn.Module], Optional[nn.Module]]
_UNWRAPPERS: List[Unwrapper] = []


def register_unwrapper(unwrap: Unwrapper) -> None:
    """Teach :func:`unwrap_model` a framework's wrapper: ``unwrap(module)`` returns the module inside, or None. The
    strategies register Fabric's (``strategies/lightning_compat.py``), so nothing here needs to know Lightning."""
    if unwrap not in _UNWRAPPERS:
        _UNWRAPPERS.append(unwrap)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The user's model inside the registered framework wrappers (Fabric's) and a top-level ``torch.compile``."""
    for unwrap in _UNWRAPPERS:
        inner = unwrap(module)
        if inner is not None:
            module = inner
            break
    return getattr(module, "_orig_mod", module)


def user_class(module: nn.Module) -> type:
    """The model's own class, not FSDP's dynamic ``FSDP<Name>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def user_class_name(module: nn.Module) -> str:
    return user_class(module).__name__


class ModuleIndex:
    """Modules by canonical name: ``outer`` is the outermost module of that name (the wrapper, where FSDP and AC go,
    as in torchtitan), ``inner`` the innermost (the user's own module, whose class and hooks matter)."""

    def __init__(self, model: nn.Module) -> None:
        self.outer: Dict[str, nn.Module] = {}
        self.inner: Dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            canonical = canonical_name(name)
            self.outer.setdefault(canonical, module)
            self.inner[canonical] = module

    def named_modules(self) -> Iterator[Tuple[str, nn.Module]]:
        """(canonical name, the user's module) in ``named_modules`` order."""
        return iter(self.inner.items())


def named_tensors(module: nn.Module, prefix: str = "") -> Iterator[Tuple[str, Tensor]]:
    """Canonical (qualified under ``prefix``) names of ``module``'s params, then its buffers."""
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        yield canonical_name(f"{prefix}.{name}" if prefix else name), tensor


PEFT_PREFIX = "base_model.model."


def peft_base_name(name: str) -> Optional[str]:
    """The base model's name for a tensor of a PEFT model (``base_model.model.x.base_layer.weight`` ->
    ``x.weight``): what the base model's checkpoint and a merged export call it. None for adapter tensors
    (``lora_*``), which no base model holds; names outside the PEFT prefix are returned unchanged."""
    if not name.startswith(PEFT_PREFIX):
        return name
    if "lora_" in name:
        return None
    return name[len(PEFT_PREFIX) :].replace(".base_layer.", ".")


def is_hf_model(module: nn.Module) -> "TypeGuard[PreTrainedModel]":
    """A transformers ``PreTrainedModel``; transformers is imported only if the model's code already did (a model
    built from transformers has), so other models cost no import (seconds)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def is_peft_model(module: nn.Module) -> "TypeGuard[PeftModel]":
    """A peft ``PeftModel``; peft is imported only if the model's code already did."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def output_head(model: nn.Module) -> Optional[nn.Module]:
    """The module producing an HF model's logits (``get_output_embeddings()``; through a peft wrapper, the head's base
    layer); None for a model without one."""
    get_head = getattr(model, "get_output_embeddings", None)
    try:
        head = get_head() if callable(get_head) else None
    except (AttributeError, NotImplementedError):  # HF raises for models without a head
        return None
    return getattr(head, "base_layer", head) if head is not None else None
