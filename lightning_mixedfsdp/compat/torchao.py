"""Every torchao API the library uses, each behind one small function: the NF4 tensor (``quantize_base``) and float8
training (``float8``; public ``torchao.float8`` APIs).

torchao is optional (``pip install 'lightning-mixedfsdp[qlora]'``): nothing here imports it until called. Checked on
torchao 0.18.0, where the NF4 tensor lives in ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor`` (public:
``torchao.quantization.to_nf4`` and ``NF4Tensor``); releases up to 0.17 kept it in ``torchao.dtypes.nf4tensor``.
Private to that module, used here only: ``get_block_absmax``, ``construct_nf4_args`` and
``NF4Tensor.convert_to_norm_float_weight`` (0.18.0).
"""

from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.extras import installed, optional_import

NF4_BLOCK = 64
"""Weights per 4-bit block, each block with one int8 scaler (QLoRA's and torchao's default)."""
NF4_SCALER_BLOCK = 256
"""Scalers per double-quantization block, each with one quantization factor in the weight's dtype."""


def _nf4_module() -> ModuleType:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor  # torchao >= 0.18

        return nf4_tensor
    except ImportError:
        pass
    with optional_import("torchao", "quantize_base='nf4'", "qlora"):
        from torchao.dtypes import nf4tensor  # torchao <= 0.17
    return nf4tensor


def torchao_installed() -> bool:
    """Whether torchao can be imported (found on the path, without importing it)."""
    return installed("torchao")


def check_torchao() -> None:
    """Raise an ImportError with the install line when torchao's NF4 tensor cannot be imported."""
    _nf4_module()


def is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` is torchao's NF4Tensor (False without torchao, without importing it)."""
    return type(tensor).__name__ == "NF4Tensor" and type(tensor).__module__.startswith("torchao.")


def to_nf4(tensor: Tensor) -> Tensor:
    """torchao's own quantization of a whole tensor (its scaler mean is the tensor's own)."""
    return _nf4_module().to_nf4(tensor, NF4_BLOCK, NF4_SCALER_BLOCK)


def block_absmax(flat: Tensor) -> Tensor:
    """Each 64-weight block's absolute maximum: the scalers NF4 double-quantizes."""
    return _nf4_module().get_block_absmax(flat, NF4_BLOCK)


def nf4_with_scaler_mean(rows: Tensor, scaler_mean: Tensor) -> Tensor:
    """torchao's NF4 quantization of ``rows`` with the scalers centred on ``scaler_mean`` instead of their own mean.

    torchao centres the block scalers on their mean before quantizing them to int8 and stores that mean once per
    tensor; FSDP2 all-gathers the int8 scalers and takes the mean from the local shard. Shards quantized with their own
    means would therefore dequantize the other ranks' blocks wrongly; with the mean of the whole tensor they equal
    torchao's quantization of the whole tensor, chunked (``model/quantized.py``)."""
    module = _nf4_module()
    local = module.NF4Tensor.from_tensor(rows, NF4_BLOCK, NF4_SCALER_BLOCK)  # the 4-bit data ignores the mean
    centred = block_absmax(rows.flatten()) - scaler_mean.to(rows.dtype)
    scaler_blocks = centred.view(-1, NF4_SCALER_BLOCK)
    # torchao's second round (NF4Tensor.double_quantize_scalers, 0.18.0) with the given centre
    factor = 256 / (2 * scaler_blocks.abs().max(dim=1).values)
    quantized = (scaler_blocks * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    updated = {
        "quantized_scalers": quantized,
        "quantization_factor": factor.contiguous(),
        "scaler_mean": scaler_mean.to(rows.dtype).reshape(()),
    }
    return module.NF4Tensor(*module.construct_nf4_args(local, updated))


def nf4_of_meta(weight: Tensor, device: torch.device) -> Tensor:
    """An NF4 weight on the meta device whose per-tensor constants (``scaler_mean``, the ``nf4`` lookup table) live on
    ``device``. torchao's ``empty_like`` (``to_empty`` of a meta model) allocates only the sharded parts and keeps
    the constants as they are (0.18.0), and every view of the shard shares them: filled in place later, they reach
    the shard FSDP2 all-gathers."""
    module = _nf4_module()
    meta = module.NF4Tensor.from_tensor(weight, NF4_BLOCK, NF4_SCALER_BLOCK)
    one_block = torch.zeros(NF4_BLOCK * NF4_SCALER_BLOCK, dtype=weight.dtype)
    table = module.NF4Tensor.from_tensor(one_block, NF4_BLOCK, NF4_SCALER_BLOCK).nf4
    constants = {"scaler_mean": torch.zeros((), dtype=weight.dtype, device=device), "nf4": table.to(device)}
    return module.NF4Tensor(*module.construct_nf4_args(meta, constants))


def dequantize(tensor: Tensor) -> Tensor:
    """An NF4Tensor's weights in its nominal dtype."""
    return tensor.get_original_weight()  # type: ignore[attr-defined]


def float8_linear_config(recipe: str, emulate: bool, fsdp_float8_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of a recipe by name (``from_recipe_name``), with emulation and FSDP2's float8
    all-gather (tensorwise only; then each optimizer step is followed by :func:`precompute_float8_scales`)."""
    from dataclasses import replace

    with optional_import("torchao", "float8 training", "float8"):
        from torchao.float8 import Float8LinearConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def convert_to_float8(module: Any, config: Any, keep: Any) -> None:
    """``convert_to_float8_training`` of the Linear layers ``keep(module, fqn)`` accepts, in place."""
    with optional_import("torchao", "float8 training", "float8"):
        from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(module, config=config, module_filter_fn=keep)


def precompute_float8_scales(module: Any) -> None:
    """One all-reduce of every float8 weight's amax after an optimizer step, for FSDP2's float8 all-gather
    (``precompute_float8_dynamic_scale_for_fsdp``)."""
    with optional_import("torchao", "float8 training", "float8"):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
