"""Every function of ``_torch_compat.py`` on the installed torch: the compat subset CI runs on the oldest and the newest
torch of the range (the distributed ones on one real FSDP2 module, with its real state)."""

import math
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.compat import torch as compat
from lightning_mixedfsdp.testing import run_distributed

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends


def test_foreach_norm_and_mul_match_the_plain_ops() -> None:
    tensors = [torch.randn(5, dtype=torch.bfloat16), torch.randn(3, 2)]
    norms = compat.foreach_norm(tensors, 2.0)
    assert [n.dtype for n in norms] == [torch.float32, torch.float32]
    for norm, tensor in zip(norms, tensors, strict=True):
        torch.testing.assert_close(norm, tensor.float().norm())
    scaled = [t.clone() for t in tensors]
    compat.foreach_mul_(scaled, torch.tensor(0.5))
    for got, tensor in zip(scaled, tensors, strict=True):
        assert torch.equal(got, tensor * 0.5)


def test_assert_on_device_raises_on_the_cpu_with_the_message() -> None:
    compat.assert_on_device(torch.tensor(True), "never")
    with pytest.raises(RuntimeError, match="norm is not finite"):
        compat.assert_on_device(torch.tensor(False), "norm is not finite")


def test_module_internals_replace_and_read_own_tensors() -> None:
    module = nn.Linear(2, 2)
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    replacement = nn.Parameter(torch.ones(2, 2))
    compat.replace_parameter(module, "weight", replacement)
    compat.replace_buffer(module, "scratch", torch.ones(1))
    assert compat.own_parameters(module)["weight"] is replacement and module.weight is replacement
    assert torch.equal(compat.own_buffers(module)["scratch"], torch.ones(1))
    assert compat.non_persistent_buffer_names(module) == frozenset({"scratch"})


def test_the_engine_runs_a_queued_callback_after_backward_and_reports_being_inside_it() -> None:
    seen: List[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: compat.queue_after_backward(lambda: seen.append(compat.inside_backward())))
    assert not compat.inside_backward()
    y.sum().backward()
    assert seen == [True]


def test_checkpoint_wrapper_recomputes_with_the_same_grads() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    wrapped = compat.checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    wrapped.load_state_dict(plain.state_dict())  # the wrapper's state dict hooks strip its prefix
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    assert torch.equal(plain[0].weight.grad, wrapped._checkpoint_wrapped_module[0].weight.grad)


def _fsdp_state(rank: int, world_size: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    flat = compat.flatten_mesh(mesh, "data_parallel")

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        fully_shard(model[0], mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        model[0].set_gradient_divide_factor(4.0)
        model[0].set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model

    model, reference = build(), build()
    groups = compat.fsdp_param_groups(model[0])
    torch.manual_seed(rank)
    x = torch.randn(2, 4)

    # fail mid-backward: the root's own Linear already has its grad, the inner unit's backward never comes
    def fail_in_backward(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")))

    handle = model[0].register_forward_hook(fail_in_backward)
    failing = model(x)
    handle.remove()
    with pytest.raises(RuntimeError, match="injected"):
        failing.sum().backward()
    compat.reset_fsdp_iter_state(model)  # after a backward that raised, the next step must run cleanly
    model(x).sum().backward()
    reference(x).sum().backward()
    return {
        "groups": len(groups),
        "divide_factor": compat.gradient_divide_factor(model[0]),
        "flat": (flat.ndim, flat.size(), flat.mesh_dim_names),
        "grads": [p.grad.full_tensor() for p in model.parameters()],
        "reference_grads": [p.grad.full_tensor() for p in reference.parameters()],
    }


def test_fsdp_state_accessors_and_the_reset_after_a_failed_backward() -> None:
    for result in run_distributed(_fsdp_state, 2):
        assert (result["groups"], result["divide_factor"], result["flat"]) == (1, 4.0, (1, 2, ("data_parallel",)))
        # the recovered step's grads are a clean step's: nothing of the failed backward was added to them
        assert len(result["grads"]) == 4
        for got, expected in zip(result["grads"], result["reference_grads"], strict=True):
            assert torch.equal(got, expected)


def _held_gathered(rank: int, world_size: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_mixedfsdp.apply.gathered import gathered_params
    from lightning_mixedfsdp.diagnostics.collectives import count_collectives

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    for layer in (model[0], model[1]):
        fully_shard(layer)
    fully_shard(model)  # not run yet: gathered_params runs FSDP's lazy init itself
    before = [compat.fsdp_post_forward_mesh_infos(m) for m in (model[0], model[1], model)]
    x = torch.randn(2, 4)
    with torch.no_grad(), gathered_params(model, model):
        with count_collectives() as counts:
            held = [model(x) for _ in range(3)]
    after = [compat.fsdp_post_forward_mesh_infos(m) for m in (model[0], model[1], model)]
    with count_collectives() as training:
        model(x).sum().backward()
    return {
        "inner_resharded": [info is not None for infos in before[:2] for info in infos],
        "restored": [a == b for a, b in zip(after[:2], before[:2], strict=True)],
        "root_not_resharded": after[2] == [None],
        "held_collectives": counts.by_kind(),
        "training_collectives": training.by_kind(),
        "equal": all(torch.equal(out, held[0]) for out in held),
        "sharded_after": all(p.to_local().shape[0] < p.shape[0] for p in model.parameters() if p.shape[0] > 1),
    }


def test_params_held_gathered_run_forwards_without_collectives_and_restore_resharding() -> None:
    """``apply/gathered.py`` over ``fsdp_lazy_init`` and the post-forward mesh infos: three forwards inside issue no
    collective; after it, each unit reshards after forward again and a training step all-gathers and reduces."""
    for result in run_distributed(_held_gathered, 2):
        assert result["inner_resharded"] == [True, True] and result["restored"] == [True, True]
        assert result["root_not_resharded"] and result["equal"] and result["sharded_after"]
        assert result["held_collectives"] == {}
        assert result["training_collectives"].get("all_gather", 0) >= 3
        assert result["training_collectives"].get("reduce_scatter", 0) == 3


def test_muons_orthogonalisation_and_lr_adjustment_are_torchs() -> None:
    from lightning_mixedfsdp.compat.torch import muon_adjusted_lr, muon_orthogonalise

    torch.manual_seed(0)
    update = torch.randn(67, 32)
    orthogonal = muon_orthogonalise(update, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert orthogonal.shape == (67, 32) and orthogonal.dtype == torch.bfloat16
    singular = torch.linalg.svdvals(orthogonal.float())
    assert 0.5 < singular.min() and singular.max() < 1.5  # about orthogonal: US'V^T with S' in (0.5, 1.5)
    assert muon_adjusted_lr(0.02, None, (67, 32)) == 0.02 * math.sqrt(67 / 32)
    assert muon_adjusted_lr(0.02, "original", (32, 67)) == 0.02
    assert muon_adjusted_lr(0.02, "match_rms_adamw", (67, 32)) == 0.02 * 0.2 * math.sqrt(67)
    # a plain torch.optim.Muon step on one matrix is exactly these pieces
    param = torch.nn.Parameter(torch.randn(67, 32))
    buffer = torch.zeros_like(update).lerp_(update, 1 - 0.95)
    expected = param.detach().clone().mul_(1 - 0.02 * 0.1)
    adjusted = muon_adjusted_lr(0.02, None, (67, 32))
    expected.add_(muon_orthogonalise(update.lerp(buffer, 0.95), (3.4445, -4.775, 2.0315), 5, 1e-7), alpha=-adjusted)
    param.grad = update.clone()
    torch.optim.Muon([param], lr=0.02, weight_decay=0.1, momentum=0.95).step()
    assert torch.equal(param.detach(), expected)
