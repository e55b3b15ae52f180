"""Expert parallelism applied: transformers' EP styles on the experts modules a plan names (``planning/experts.py``),
and the gradient reduction their FSDP groups need."""

from typing import TYPE_CHECKING

from torch import nn

from lightning_mixedfsdp.compat.transformers import apply_expert_parallelism
from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.planning.experts import ExpertPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_expert_parallel(model: nn.Module, experts: ExpertPlan, ep_mesh: "DeviceMesh", tp_mesh: "DeviceMesh") -> None:
    """transformers' EP styles on ``model`` (names as they are now: wrappers from ``parallelize_fn`` allowed)."""
    actual = {canonical_name(n): n for n, _ in model.named_modules()}
    actual.update({canonical_name(n): n for n, _ in model.named_parameters()})
    apply_expert_parallelism(model, {actual[name]: style for name, style in experts.plan.items()}, ep_mesh, tp_mesh)


def set_expert_reduction(module: nn.Module, divide_factor: float, expert_shard_size: int) -> None:
    """Expert grads averaged over every data-parallel rank, like dense grads: ``divide_factor`` is
    ``ExpertMeshes.gradient_divide_factor``, not FSDP's default (its own group size).

    FSDP applies a custom factor with PREMUL_SUM, which gloo lacks and NCCL gets wrong in bf16 (pytorch#190745, fixed
    by #190747): sum and divide locally instead, but only when there is a reduce-scatter (``expert_shard_size > 1``);
    without one FSDP divides in its copy already, and a forced sum would divide twice.
    """
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule)
    module.set_gradient_divide_factor(divide_factor)
    if expert_shard_size > 1:
        module.set_force_sum_reduction_for_comms(True)
