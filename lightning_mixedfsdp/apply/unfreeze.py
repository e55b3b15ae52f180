"""Frozen modules made trainable after setup, as Lightning's ``BaseFinetuning`` callbacks do (``requires_grad_(True)``
and ``add_param_group``).

Two things stand in the way, and both are checked before every forward of the model, before any collective, on every
rank alike:

- the plan holds a module frozen at setup in the compute dtype, with no fp32 master and its grads reduced in that
  dtype (``pin_frozen_modules``): under a precision whose trainable params get other dtypes (``bf16-mixed``) it would
  train without them, silently, so making it trainable is refused with the fix;
- FSDP2 fixes each group's original and reduce dtypes at its first forward from the params that require grad then: a
  group that had none gets them again once one of its params requires grad (``compat/torch.py``), so its grads are
  reduced and cast back as a trainable group's are."""

from typing import Any, List, Sequence, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.compat.torch import fsdp_group_params, fsdp_param_groups, refresh_fsdp_group_dtypes
from lightning_mixedfsdp.config import BulkDtypes, short_dtype
from lightning_mixedfsdp.model.names import canonical_name, user_class_name


def apply_unfreeze_check(model: nn.Module, frozen_pinned: Sequence[str], bulk: BulkDtypes) -> List[RemovableHandle]:
    """Before every forward of ``model``: raise when a param of ``frozen_pinned`` (the plan's) requires grad now, and
    give FSDP groups with no trainable param at setup their dtypes again once one of their params requires grad."""
    from torch.distributed.fsdp import FSDPModule

    wanted = set(frozen_pinned)
    pinned = [(name, p) for name, p in ((canonical_name(n), p) for n, p in model.named_parameters()) if name in wanted]
    frozen_groups: List[Tuple[Any, List[nn.Parameter]]] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module):
                params = fsdp_group_params(group)
                if not any(param.requires_grad for param in params):
                    frozen_groups.append((group, params))

    @torch.compiler.disable
    def before(module: nn.Module, args: Any) -> None:
        unfrozen = [name for name, param in pinned if param.requires_grad]
        if unfrozen:
            raise ValueError(unfrozen_message(user_class_name(model), unfrozen, bulk))
        for entry in list(frozen_groups):
            group, params = entry
            if any(param.requires_grad for param in params):
                refresh_fsdp_group_dtypes(group)
                frozen_groups.remove(entry)

    return [model.register_forward_pre_hook(before, prepend=True)] if pinned or frozen_groups else []


def unfrozen_message(owner: str, unfrozen: Sequence[str], bulk: BulkDtypes) -> str:
    modules = sorted({name.rpartition(".")[0] or name for name in unfrozen})
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    compute, storage, reduce = (short_dtype(dtype) for dtype in (bulk.compute, bulk.storage, bulk.reduce))
    return (
        f"mixed_fsdp2: modules frozen at setup are trainable now ({owner}: {shown}). The plan holds a frozen module's"
        f" params in the compute dtype ({compute}), with no {storage} master and grads reduced in {compute}, so they"
        f" would train without what this precision gives trainable params (storage {storage}, grads reduced in"
        f" {reduce}). Set pin_frozen_modules=False (frozen modules then get the trainable params' dtypes and can be"
        " unfrozen later, as Lightning's BaseFinetuning callbacks do), or make them trainable before setup."
    )
