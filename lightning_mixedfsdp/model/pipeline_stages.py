"""Which set-up models are pipeline stages, and the ranks that hold the same params as this rank's stage: what a
full load reads per stage (each stage's first data-parallel rank matches the checkpoint's names against its own)."""

from typing import Any, Dict, Optional
from weakref import WeakKeyDictionary

from torch import nn

_STAGES: "WeakKeyDictionary[nn.Module, Any]" = WeakKeyDictionary()


def mark_pipeline_stage(model: nn.Module, same_params_group: Any) -> None:
    """Record that ``model`` holds this rank's pipeline stages, whose params ``same_params_group``'s ranks share."""
    _STAGES[model] = same_params_group


def pipeline_stage_group(model: nn.Module) -> Optional[Any]:
    """The ranks holding the same params as ``model``'s stage, or None when ``model`` is no pipeline stage."""
    return _STAGES.get(model)


_TIED_COPIES: "WeakKeyDictionary[nn.Module, Dict[str, str]]" = WeakKeyDictionary()


def mark_tied_copies(model: nn.Module, copies: Dict[str, str]) -> None:
    """Record that ``model`` (the last pipeline stage) holds a copy of a weight tied to the first stage's:
    ``{"lm_head.weight": "model.embed_tokens.weight"}``; a checkpoint that stores the weight once loads it there."""
    _TIED_COPIES[model] = dict(copies)


def tied_copies(model: nn.Module) -> Dict[str, str]:
    """``model``'s tied copies (copy's name -> the first stage's name), empty when it holds none."""
    return dict(_TIED_COPIES.get(model, {}))
