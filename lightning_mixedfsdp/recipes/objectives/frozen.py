"""A frozen second model beside the trained one (distillation's teacher, preference tuning's reference): built from a
folder (an HF model directory or one of this project's exports), every param frozen so the strategy plans it as
frozen (its storage dtype, no grads, no optimizer state), read from its folder at every launch, and left out of
checkpoints under its attribute (the checkpoint's fingerprint of the frozen tensors is checked against it)."""

from typing import Any, Dict, List

from torch import nn

from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.recipes.objectives.objective import build_model
from lightning_mixedfsdp.recipes.settings.inputs import checkpoint_fp32_patterns
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection

QUANTIZE = ("none", "nf4")
OFFLOAD = ("none", "cpu")


def frozen_model(folder: str) -> nn.Module:
    """The model in ``folder``, every param frozen: the reference model (an export of one) on the current device, an
    HF model on the meta device (the strategy allocates it; :func:`~lightning_mixedfsdp.load_full_weights` fills
    it)."""
    return build_model(ModelSection(pretrained=folder), PeftSection()).requires_grad_(False)


def leave_out_of_checkpoints(owner: nn.Module, attribute: str) -> None:
    """``owner``'s state dicts leave out its ``attribute`` child, and its loads do not expect it (strict included)."""
    prefix = f"{attribute}."

    def drop(_module: nn.Module, state_dict: Dict[str, Any], own_prefix: str, _metadata: Any) -> None:
        for key in [k for k in state_dict if k.startswith(own_prefix + prefix)]:
            del state_dict[key]

    def not_expected(_module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if not key.startswith(prefix)]

    owner.register_state_dict_post_hook(drop)
    owner.register_load_state_dict_post_hook(not_expected)


def frozen_model_needs(config: MixedFSDPConfig, folder: str, quantize: str, offload: str) -> None:
    """In the strategy's ``config``: the folder's fp32 tensors kept fp32; ``quantize="nf4"``: the frozen Linear
    weights in 4 bits; ``offload="cpu"``: the frozen units' shards on the host. The trained model trains all of its
    params, so the frozen model's are the only frozen ones."""
    config.dtypes.keep_fp32_params = [*config.dtypes.keep_fp32_params, *checkpoint_fp32_patterns(folder)]
    if quantize == "nf4":
        config.memory.quantize_base = "nf4"
    if offload == "cpu":
        config.memory.offload_frozen = "cpu"


def storage_problems(section: str, quantize: str, offload: str) -> List[str]:
    """``<section>.quantize`` and ``<section>.offload`` out of their choices."""
    problems = []
    if quantize not in QUANTIZE:
        problems.append(f"{section}quantize={quantize!r}: use one of {', '.join(QUANTIZE)}")
    if offload not in OFFLOAD:
        problems.append(f"{section}offload={offload!r}: use one of {', '.join(OFFLOAD)}")
    return problems


def composition_problems(objective: str, context_parallel_size: int, fault_tolerant: bool, why: str) -> List[str]:
    """The compositions a second model does not take yet: context parallelism and fault-tolerant replica groups
    (``why``: what the objective would need; a heal transfers the trained model's state, not a frozen one)."""
    problems = []
    if context_parallel_size != 1:
        problems.append(
            f"{objective} with strategy.parallelism.context_parallel_size={context_parallel_size} is not supported"
            f" yet ({why}); set it to 1"
        )
    if fault_tolerant:
        problems.append(
            f"{objective} with strategy.fault_tolerance is not supported yet (a healing group would also need the"
            " frozen model, which no heal transfers); remove strategy.fault_tolerance"
        )
    return problems
