"""The dtypes a model's own construction gives its buffers under the compute dtype: the buffer rule of the plan.

Under ``bf16-true`` and ``bf16-mixed`` a floating buffer takes the dtype its module's constructor makes it when the
default dtype is the compute dtype, which is what ``from_config(cfg, dtype=bf16)`` does for a Hugging Face model:
RoPE's ``inv_freq`` is computed in fp32 on purpose and stays fp32, MiniMax's lightning-attention decay buffers
follow the default dtype and become bf16, so the model's own forward can multiply them with bf16 activations. For an
HF model the twin is rebuilt from its config on the meta device (nothing allocated); another model's buffers keep
the dtype they were built in, which is the same rule when it was built under ``init_module()`` (that sets the
default dtype to the compute dtype, as HF's ``dtype=`` does).
"""

import copy
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name, is_hf_model, is_within, user_class


def constructed_buffer_dtypes(
    model: nn.Module, index: ModuleIndex, dtype: torch.dtype
) -> Tuple[Dict[str, torch.dtype], List[str]]:
    """Canonical buffer name -> the dtype an HF submodule's construction under ``dtype`` gives it, for every HF model
    inside ``model`` (the outermost ones); and the HF models that could not be rebuilt, described."""
    dtypes: Dict[str, torch.dtype] = {}
    failures: List[str] = []
    outermost: List[str] = []
    for name, module in index.named_modules():
        if not is_hf_model(module) or any(is_within(name, o) for o in outermost):
            continue
        outermost.append(name)
        try:
            with torch.device("meta"):
                model_class: Any = user_class(module)
                twin = model_class._from_config(copy.deepcopy(module.config), dtype=dtype)
        except Exception as error:  # noqa: BLE001 - the plan falls back to the built dtypes and says so
            failures.append(f"{name or '<root>'} ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            continue
        for buffer_name, buffer in twin.named_buffers():
            if buffer.is_floating_point():
                dtypes[canonical_name(f"{name}.{buffer_name}" if name else buffer_name)] = buffer.dtype
    return dtypes, failures
