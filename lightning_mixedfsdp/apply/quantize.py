"""The 4-bit frozen base: each weight the plan quantizes becomes torchao's ``NF4Tensor`` before sharding, as
torchtitan converts a model before parallelising it. ``fully_shard`` then splits it by rows like any param and
all-gathers its 4-bit parts (torchao implements FSDP2's all-gather extension). A model on the meta device gets meta
NF4 weights, filled when it is materialised or loaded (``model/quantized.py`` quantizes each rank's rows)."""

from typing import Any, Collection, Dict, List

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.compat.torch import own_parameters, replace_parameter
from lightning_mixedfsdp.compat.torchao import check_torchao, nf4_of_meta, to_nf4
from lightning_mixedfsdp.model.names import canonical_name, join_name


@torch.no_grad()
def apply_quantization(
    model: nn.Module, quantized: Collection[str], tensor_parallel_ranks: int, device: torch.device
) -> None:
    """Replace each param named in ``quantized`` (canonical names) by its frozen NF4 quantization; a meta param by an
    NF4 meta weight whose scaler mean and lookup table wait on ``device`` to be filled."""
    if not quantized:
        return
    check_torchao()
    if tensor_parallel_ranks > 1:
        raise ValueError(
            f"mixed_fsdp2: quantize_base='nf4' with tensor_parallel_size={tensor_parallel_ranks} is not supported:"
            " tensor parallelism splits the weights NF4 stores by rows of whole blocks. Use tensor_parallel_size=1"
            " (shard the 4-bit base with FSDP alone), or quantize_base=None."
        )
    wanted = set(quantized)
    for module_name, module in model.named_modules():
        for param_name, param in own_parameters(module).items():
            if param is not None and canonical_name(join_name(module_name, param_name)) in wanted:
                weight = nf4_of_meta(param, device) if param.is_meta else to_nf4(param.detach())
                replace_parameter(module, param_name, nn.Parameter(weight, requires_grad=False))


def apply_checkpoint_exclusion(model: nn.Module, quantized: Collection[str]) -> List[RemovableHandle]:
    """Leave the 4-bit weights out of every state dict of ``model`` and accept their absence on load (strict loads
    included): a checkpoint holds the adapters and every other tensor, never the frozen base, which comes from its own
    source (the pretrained folder, or the seed of a model built from config) every time the model is set up."""
    names = set(quantized)
    if not names:
        return []

    def drop_saved(_module: nn.Module, state_dict: Dict[str, Any], prefix: str, _metadata: Any) -> None:
        # the keys under the prefix are the model's own names: one set lookup each, at every save
        for key in [k for k in state_dict if k.startswith(prefix) and canonical_name(k[len(prefix) :]) in names]:
            del state_dict[key]

    def accept_missing(_module: nn.Module, incompatible_keys: Any) -> None:
        # the keys are relative to the module the load was called on, the model or one that holds it
        def quantized(key: str) -> bool:
            canonical = canonical_name(key)
            return canonical in names or any(canonical.endswith("." + name) for name in names)

        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if not quantized(key)]

    return [model.register_state_dict_post_hook(drop_saved), model.register_load_state_dict_post_hook(accept_missing)]
