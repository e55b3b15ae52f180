"""Ready for many GPUs, on 2 CPU ranks: recovery after a backward that raised, no host syncs in forward and backward,
and replicated grads under the same reduce contract as FSDP's sharded grads (reduce dtype, divide factor)."""

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import pytest
import torch

from tests.conftest import Launch
from tests.scenarios import A_LOG, MIXER, full_grads, full_params, global_batch, make_fabric, rank_slice, unwrap

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 2
STEPS, FAILED_STEP = 5, 1


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises while armed: a CUDA OOM or a NaN guard inside a block's backward."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailInBackward.armed:
            raise RuntimeError("injected failure inside backward")
        return grad


def _train_through_a_failure(rank: int, mode: str) -> Dict[str, Any]:
    """``fail``: step 1's backward raises on every rank, the loop catches it and trains on. ``skip``: the same run
    without step 1's backward. Replicated params see different data on each rank."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=A_LOG))
    torch.manual_seed(0)
    model = TinyLlama(MIXER)
    model.layers[1].register_forward_hook(lambda _m, _a, output: _FailInBackward.apply(output))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, caught = [], []
    for step in range(STEPS):
        tokens = rank_slice(global_batch(WORLD, step), rank, WORLD)
        loss = causal_lm_loss(model(tokens), tokens)
        if step == FAILED_STEP:
            if mode == "skip":
                continue
            _FailInBackward.armed = True
            try:
                fabric.backward(loss)
            except RuntimeError as error:
                caught.append(str(error))
                optimizer.zero_grad()
                continue
            finally:
                _FailInBackward.armed = False
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    tracker = fabric.strategy._sharded._applied[unwrap(model)].tracker
    return {"losses": losses, "after": full_params(model), "caught": caught, "resets": tracker.resets}


def _host_syncs(rank: int) -> Dict[str, int]:
    """Count every host sync a forward+backward could make through our code: ``Tensor.item``/``tolist``/``__bool__``
    and list-to-device ``torch.tensor`` calls, in a step where every replicated param gets a grad."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=A_LOG))
    torch.manual_seed(0)
    model = fabric.setup(TinyLlama(MIXER))
    tokens = rank_slice(global_batch(WORLD, 0), rank, WORLD)
    fabric.backward(causal_lm_loss(model(tokens), tokens))  # lazy init outside the count
    counts = {"item": 0, "tolist": 0, "__bool__": 0, "tensor_from_list": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__")}
    original_tensor = torch.tensor

    def counting(name: str) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return method

    def tensor_from_list(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(data, (list, tuple)):
            counts["tensor_from_list"] += 1
        return original_tensor(data, *args, **kwargs)

    for name in originals:
        setattr(torch.Tensor, name, counting(name))
    torch.tensor = tensor_from_list
    try:
        loss = causal_lm_loss(model(tokens), tokens)
        fabric.backward(loss)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = original_tensor
    return counts


@contextmanager
def _recorded_all_reduces() -> Iterator[List[Dict[str, Any]]]:
    import torch.distributed as dist

    records: List[Dict[str, Any]] = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        records.append({"dtype": tensor.dtype, "numel": tensor.numel()})
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        yield records
    finally:
        dist.all_reduce = original


def _replicated_reduce_dtype(rank: int) -> Dict[str, Any]:
    """pytorch#156784's model under 32-true with reduce_dtype='fp32': its small bf16 Linear is replicated with a
    bf16/bf16/fp32 key, so its grads are all-reduced in fp32."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import Issue156784Model

    fabric = make_fabric(WORLD, "32-true", MixedFSDP2Strategy(reduce_dtype="fp32"))
    torch.manual_seed(0)
    model = fabric.setup(Issue156784Model())
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    with _recorded_all_reduces() as records:
        fabric.backward(model(x).pow(2).mean())
    plan = fabric.strategy.plan_of(model)
    return {
        "keys": {n: str(p.key) for n, p in plan.params.items() if p.replicated},
        "all_reduces": records,
        # the param itself (a Replicate DTensor); `module.hidden.weight` reads its local view
        "grad_dtype": dict(unwrap(model).named_parameters())["hidden.weight"].grad.dtype,
    }


def _divide_factor(rank: int, factor: Any) -> Dict[str, Any]:
    """FSDP's divide factor set on every FSDP module (torchtitan's global-token loss scaling sets 1.0): sharded
    grads become sums over ranks, and replicated grads must too."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, causal_lm_loss

    fabric = make_fabric(WORLD, "bf16-true", MixedFSDP2Strategy(keep_fp32_params=A_LOG))
    torch.manual_seed(0)
    model = fabric.setup(TinyLlama(MIXER))
    if factor is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(factor)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    tokens = rank_slice(global_batch(WORLD, 0), rank, WORLD)
    fabric.backward(causal_lm_loss(model(tokens), tokens))
    return {"grads": full_grads(model), "replicated": fabric.strategy.plan_of(model).replicated_params}


def _second_setup(rank: int) -> str:
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama

    fabric = make_fabric(WORLD, "bf16-true")
    model = TinyLlama(MIXER)
    fabric.setup(model)
    try:
        fabric.setup(model)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _removable_hooks(rank: int) -> Dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama

    def hooks_on(model: torch.nn.Module) -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    from lightning_mixedfsdp.apply.adapt import adapted_modules

    fabric = make_fabric(WORLD, "bf16-true")
    model = fabric.setup(TinyLlama(MIXER))
    (applied,) = fabric.strategy._sharded._applied.values()
    kept, before, adapted = len(applied.handles), hooks_on(model), adapted_modules(model)
    applied.remove_hooks()
    # what is left must be FSDP's own: one pre- and one post-forward hook on each FSDP module, none elsewhere
    left_over = [
        name
        for name, m in model.named_modules()
        if (len(m._forward_pre_hooks), len(m._forward_hooks)) != ((1, 1) if isinstance(m, FSDPModule) else (0, 0))
    ]
    removed = before - hooks_on(model)
    return {
        "kept": kept,
        "removed": removed,
        "left": len(applied.handles),
        "left_over": left_over,
        "adapted": adapted,
        "adapted_after": adapted_modules(model),
    }


def _scenarios(rank: int, world_size: int) -> Dict[str, Any]:
    return {
        "second_setup": _second_setup(rank),
        "hooks": _removable_hooks(rank),
        "fail": _train_through_a_failure(rank, "fail"),
        "skip": _train_through_a_failure(rank, "skip"),
        "syncs": _host_syncs(rank),
        "reduce_dtype": _replicated_reduce_dtype(rank),
        "mean": _divide_factor(rank, None),
        "sum": _divide_factor(rank, 1.0),
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=300, with_folder=False)


def test_a_backward_that_raised_leaves_no_trace_in_the_next_steps(results: list) -> None:
    for result in results:
        fail, skip = result["fail"], result["skip"]
        assert fail["caught"] == ["injected failure inside backward"] and fail["resets"] == 1
        # the run that caught the failure equals the run that skipped that step, bit for bit
        assert fail["losses"] == skip["losses"]
        for name, value in skip["after"].items():
            assert torch.equal(fail["after"][name], value), name
    for name, value in results[0]["fail"]["after"].items():
        assert torch.equal(results[1]["fail"]["after"][name], value), name  # replicas (A_log, norms) agree


def test_a_step_with_every_grad_present_makes_no_host_sync(results: list) -> None:
    for result in results:
        assert result["syncs"] == {"item": 0, "tolist": 0, "__bool__": 0, "tensor_from_list": 0}


def test_replicated_grads_are_reduced_in_the_plans_reduce_dtype(results: list) -> None:
    out = results[0]["reduce_dtype"]
    assert out["keys"] == {"hidden.weight": "bf16/bf16/fp32", "hidden.bias": "bf16/bf16/fp32"}
    replicated = [r for r in out["all_reduces"] if r["numel"] == 32 * 32 + 32 + 2]  # weight, bias, 2 presence flags
    assert [r["dtype"] for r in replicated] == [torch.float32]
    assert out["grad_dtype"] == torch.bfloat16  # back in the storage dtype, as FSDP returns grads


def test_replicated_grads_follow_fsdps_gradient_divide_factor(results: list) -> None:
    mean, total = results[0]["mean"], results[0]["sum"]
    assert any(n.endswith("A_log") for n in mean["replicated"])
    for name, grad in mean["grads"].items():
        # factor 1.0: a sum over the 2 ranks instead of their mean, for sharded and replicated grads alike (a factor
        # of 2 is exact in bf16 and fp32)
        assert torch.equal(total["grads"][name], WORLD * grad), name


def test_every_installed_hook_is_kept_and_removable(results: list) -> None:
    for result in results:
        hooks = result["hooks"]
        # the step tracker's hooks; the replicated norms and A_log owners carry their class adaptations instead
        assert hooks["kept"] > 1
        assert hooks["removed"] == hooks["kept"] and hooks["left"] == 0
        assert hooks["left_over"] == []
        assert any(name.endswith("attention_norm") for name in hooks["adapted"])
        assert any(name.endswith("attention") for name in hooks["adapted"])  # the mixer owning the replicated A_log
        assert hooks["adapted_after"] == []


def test_setting_up_a_module_twice_is_refused_with_the_fix(results: list) -> None:
    message = results[0]["second_setup"]
    assert "this TinyLlama is already set up (sharded, with hooks installed)" in message
    assert "build a fresh model" in message
