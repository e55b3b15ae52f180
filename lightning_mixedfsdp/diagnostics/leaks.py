"""An opt-in check on the first forward: which modules return floating outputs not in the compute dtype."""

import warnings
from typing import Any, Dict, List, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.model.names import is_within, user_class_name
from lightning_mixedfsdp.model.tensors import tensors_in


class DtypeLeakWarning(UserWarning):
    """fp32 (or other) activations leak out of modules into the bf16 compute path."""


def install_leak_check(
    model: nn.Module, compute_dtype: torch.dtype, keep_fp32_modules: Sequence[str]
) -> List[RemovableHandle]:
    """Hook every module but the root and the insides of keep-fp32 modules (which compute in fp32 on purpose); after
    the first root forward, remove the hooks and warn once, listing every leaking module. Returns the handles."""
    leaks: Dict[str, str] = {}
    handles: List[RemovableHandle] = []

    def record(name: str) -> Any:
        def hook(module: nn.Module, _args: Any, output: Any) -> None:
            dtypes = {t.dtype for t in tensors_in(output) if t.is_floating_point()}
            wrong = sorted(str(d).replace("torch.", "") for d in dtypes if d != compute_dtype)
            if wrong and name not in leaks:
                leaks[name] = f"{name} ({user_class_name(module)}): {', '.join(wrong)}"

        return hook

    def report(*_: Any) -> None:
        for handle in handles:
            handle.remove()
        if leaks:
            expected = str(compute_dtype).replace("torch.", "")
            listed = "\n".join(f"  - {line}" for line in leaks.values())
            warnings.warn(
                f"mixed_fsdp2: {len(leaks)} module(s) return floating outputs that are not {expected}; the next"
                f" {expected} layer receives them (an fp32 buffer or param in a module the plan does not cast):\n"
                f"{listed}\nPin the module's params/buffers (keep_fp32_modules, pin_frozen_modules) or cast in"
                " its forward.",
                DtypeLeakWarning,
                stacklevel=2,
            )

    for name, module in model.named_modules():
        if name and not any(is_within(name, k) and name != k for k in keep_fp32_modules):
            handles.append(module.register_forward_hook(record(name)))
    handles.append(model.register_forward_hook(report))
    return handles
