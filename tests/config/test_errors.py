"""One test per error message: each names the class, quotes the bad value and gives the fix."""

import re

import pytest
import torch
from torch import nn

from lightning_mixedfsdp import MixedFSDPConfig, MixedFSDPConfigError, MixedFSDPPrecision, plan_sharding
from lightning_mixedfsdp.apply.applier import apply_dtypes
from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
from lightning_mixedfsdp.mesh import ParallelDims, build_parallel_meshes


def test_unknown_storage() -> None:
    with pytest.raises(MixedFSDPConfigError, match=r"storage='fp64' is not supported; use one of \['auto', 'keep'"):
        MixedFSDPConfig(storage="fp64").validate()


@pytest.mark.parametrize(("field", "option"), [("compute_dtype", "compute"), ("reduce_dtype", "reduce")])
def test_unknown_dtype(field: str, option: str) -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=rf"dtypes\.{option}='half' is not supported; use one of \['auto', 'bf16'"
    ):
        MixedFSDPConfig(**{field: "half"}).validate()


def test_unknown_buffer_sync() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"buffers\.sync='all' is not supported; use one of \['none', 'broad"
    ):
        MixedFSDPConfig(buffer_sync="all").validate()  # type: ignore[arg-type]


PATTERN_FIELDS = {
    "keep_fp32_modules": "dtypes.keep_fp32_modules",
    "keep_fp32_params": "dtypes.keep_fp32_params",
    "wrap_units": "sharding.wrap_units",
    "buffer_sync_names": "buffers.names",
}


@pytest.mark.parametrize("field", list(PATTERN_FIELDS))
def test_empty_pattern(field: str) -> None:
    nested = re.escape(PATTERN_FIELDS[field])
    with pytest.raises(MixedFSDPConfigError, match=rf"{nested}\[1\]='  ' is empty; remove it or give a name"):
        MixedFSDPConfig(**{field: ["Block", "  "]}).validate()


@pytest.mark.parametrize("field", ["keep_fp32_params", "buffer_sync_names"])
def test_bad_regex(field: str) -> None:
    nested = re.escape(PATTERN_FIELDS[field])
    with pytest.raises(MixedFSDPConfigError, match=rf"{nested}\[0\]='A_log\(' is not a valid regex .*fix or escape"):
        MixedFSDPConfig(**{field: ["A_log("]}).validate()


def test_empty_wrap_units() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"sharding\.wrap_units=\[\] names no unit; use None for automatic units"
    ):
        MixedFSDPConfig(wrap_units=[]).validate()


def test_negative_replicate_threshold() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"sharding\.replicate_below_bytes=-1 must be an int >= 0; use 0 to shard"
    ):
        MixedFSDPConfig(replicate_below_bytes=-1).validate()


def test_conflicting_bf16_storage_with_fp32_compute() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"dtypes\.storage='bf16' with compute='fp32' conflict: .*use storage='fp32'"
    ):
        MixedFSDPConfig(storage="bf16", compute_dtype="fp32").validate()


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(MixedFSDPConfigError, match=r"MixedFSDPConfig has 3 problem\(s\)") as error:
        MixedFSDPConfig(storage="x", reduce_dtype="y", keep_fp32_params=["("]).validate()
    assert len(re.findall(r"^  - ", str(error.value), re.MULTILINE)) == 3


def test_unknown_field() -> None:
    with pytest.raises(MixedFSDPConfigError, match=r"unknown option\(s\) \['keep_fp32_module'\]. Valid options: "):
        MixedFSDPConfig(keep_fp32_module=["RMSNorm"])


def test_strategy_rejects_unknown_keyword() -> None:
    with pytest.raises(MixedFSDPConfigError, match=r"unknown option\(s\) \['reshard'\]"):
        MixedFSDP2Strategy(reshard=True)


def test_strategy_rejects_a_config_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"MixedFSDP2Strategy\(config=42\) must be a MixedFSDPConfig or a mapping"):
        MixedFSDP2Strategy(config=42)


def test_strategy_accepts_a_mapping_and_keyword_overrides() -> None:
    strategy = MixedFSDP2Strategy(config={"keep_fp32_params": ["A_log$"]}, replicate_below_bytes=0, wrap_units="auto")
    assert strategy.config == MixedFSDPConfig(keep_fp32_params=["A_log$"], replicate_below_bytes=0)


def test_strategy_rejects_bad_mesh_sizes() -> None:
    with pytest.raises(ValueError, match=r"parallelism.data_parallel_replicate_size=0 must be an int >= 1; use 1 for"):
        MixedFSDP2Strategy(data_parallel_replicate_size=0)


def test_mesh_sizes_must_multiply_to_the_world_size() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"`data_parallel_replicate_size=2`, `data_parallel_size=3` and `tensor_parallel_size=1` multiplied should"
        r" equal the world size \(4\)",
    ):
        build_parallel_meshes("cpu", 2, 3, 1, 4)


def test_fp16_precision_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"MixedFSDPPrecision: precision='16-true' is not supported; .*use 'bf16-mixed' or 'bf16-true'"
    ):
        MixedFSDPPrecision("16-true")


def test_fabric_with_fp16_flag_is_refused_by_the_strategy() -> None:
    from lightning.fabric import Fabric

    import lightning_mixedfsdp  # noqa: F401

    with pytest.raises(
        ValueError, match=r"MixedFSDP2Strategy: precision='16-true' is not supported; .*use 'bf16-mixed' or 'bf16-true'"
    ):
        Fabric(accelerator="cpu", devices=1, strategy="mixed_fsdp2", precision="16-true")


def test_fabric_translates_lightning_precision_flags_to_the_mixed_plugin() -> None:
    from lightning.fabric import Fabric

    import lightning_mixedfsdp  # noqa: F401

    fabric = Fabric(accelerator="cpu", devices=1, strategy="mixed_fsdp2", precision="bf16-true")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, MixedFSDPPrecision) and plugin.precision == "bf16-true"
    assert (plugin.bulk.storage, plugin.bulk.compute) == (torch.bfloat16, torch.bfloat16)


def test_bf16_true_conversion_keeps_norms_and_pinned_params_fp32() -> None:
    model = nn.Module()
    model.norm = nn.LayerNorm(4)
    model.proj = nn.Linear(4, 4)
    model.A_log = nn.Parameter(torch.randn(4))
    apply_dtypes(model, plan_sharding(model, MixedFSDPConfig(keep_fp32_params=["A_log"]), "bf16-true"))
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        "A_log": torch.float32,
        "norm.weight": torch.float32,
        "norm.bias": torch.float32,
        "proj.weight": torch.bfloat16,
        "proj.bias": torch.bfloat16,
    }


def test_a_non_finite_grad_norm_raises_with_the_fix_when_asked() -> None:
    from lightning_mixedfsdp import clip_grad_norm_

    param = nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1.0, float("inf"), 0.0])
    with pytest.raises(RuntimeError, match=r"non-finite \(inf\), so it cannot be clipped. Set `error_if_nonfinite=Fa"):
        clip_grad_norm_([param], 1.0, error_if_nonfinite=True)
    assert torch.equal(param.grad, torch.tensor([1.0, float("inf"), 0.0]))  # nothing scaled


def test_the_sync_free_non_finite_check_raises_on_the_cpu_too() -> None:
    from lightning_mixedfsdp import clip_grad_norm_

    param = nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1.0, float("nan"), 0.0])
    with pytest.raises(
        RuntimeError, match=r"non-finite \(nan\), so it cannot be clipped. Set `error_if_nonfinite=False`"
    ):
        clip_grad_norm_([param], 1.0, error_if_nonfinite=True, nonfinite_check="device_assert")


def test_an_unknown_non_finite_check() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"nonfinite_check='sync' is not supported; use one of \['raise', 'device_assert'\]"
    ):
        MixedFSDPConfig(nonfinite_check="sync").validate()  # type: ignore[arg-type]


def test_expert_parallel_size_below_one() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"expert_parallel_size=0 must be an int >= 1; use 1 to leave expert"
    ):
        MixedFSDPConfig(expert_parallel_size=0).validate()


def test_expert_parallel_plan_with_an_unknown_style() -> None:
    with pytest.raises(
        MixedFSDPConfigError,
        match=r"expert_parallel_plan\['layers.\*.mlp.experts'\]='colwise' is not supported; use one of"
        r" \['ep_dispatch_experts', 'grouped_gemm'\]",
    ):
        MixedFSDPConfig(expert_parallel_plan={"layers.*.mlp.experts": "colwise"}).validate()


def test_expert_parallelism_needs_a_model_with_an_ep_plan() -> None:
    from lightning_mixedfsdp.planning.experts import ExpertParallelError
    from tests.hf_models import tiny_model

    with pytest.raises(
        ExpertParallelError,
        match=r"expert_parallel_size=2: LlamaForCausalLM declares no expert-parallel plan .* Pass your own as"
        r" expert_parallel_plan=.*, or leave expert_parallel_size=1",
    ):
        plan_sharding(tiny_model("llama"), MixedFSDPConfig(expert_parallel_size=2), "bf16-true")


def test_expert_parallel_plan_that_names_no_module() -> None:
    from lightning_mixedfsdp.planning.experts import ExpertParallelError
    from tests.hf_models import tiny_model

    with pytest.raises(
        ExpertParallelError,
        match=r"the expert-parallel plan of Qwen3MoeForCausalLM names no module of it with the 'ep_dispatch_experts'"
        r" style .* Fix the names \(relative to Qwen3MoeForCausalLM",
    ):
        config = MixedFSDPConfig(expert_parallel_size=2, expert_parallel_plan={"layers.*.moe": "ep_dispatch_experts"})
        plan_sharding(tiny_model("qwen3_moe"), config, "bf16-true")


def test_expert_parallel_size_must_divide_the_experts() -> None:
    from lightning_mixedfsdp.planning.experts import ExpertParallelError
    from tests.hf_models import tiny_model

    with pytest.raises(
        ExpertParallelError,
        match=r"expert_parallel_size=3 cannot shard Qwen3MoeForCausalLM: model.layers.0.mlp.experts holds 4 experts,"
        r" which 3 ranks cannot split evenly.*Choose an expert_parallel_size that divides the number of experts",
    ):
        plan_sharding(tiny_model("qwen3_moe"), MixedFSDPConfig(expert_parallel_size=3), "bf16-true")


def test_every_param_of_an_experts_module_must_be_split() -> None:
    from lightning_mixedfsdp.planning.experts import ExpertParallelError
    from tests.hf_models import tiny_model

    plan = {"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.experts.down_proj": "grouped_gemm"}
    with pytest.raises(
        ExpertParallelError,
        match=r"cannot shard Qwen3MoeForCausalLM: model.layers.0.mlp.experts.gate_up_proj lies in"
        r" model.layers.0.mlp.experts but is not split \(give it 'grouped_gemm'\).*or fix expert_parallel_plan",
    ):
        config = MixedFSDPConfig(expert_parallel_size=2, expert_parallel_plan=plan)
        plan_sharding(tiny_model("qwen3_moe"), config, "bf16-true")


def test_expert_params_must_share_one_dtype() -> None:
    from lightning_mixedfsdp.planning.experts import ExpertParallelError
    from tests.hf_models import tiny_model

    with pytest.raises(
        ExpertParallelError,
        match=r"the params of model.layers.1.mlp.experts in Qwen3MoeForCausalLM would have more than one dtype .*"
        r" narrow keep_fp32_modules / keep_fp32_params so they skip the experts",
    ):
        config = MixedFSDPConfig(expert_parallel_size=2, keep_fp32_params=[r"experts\.down_proj$"])
        plan_sharding(tiny_model("qwen3_moe"), config, "bf16-true")


def test_expert_parallel_size_must_divide_the_data_parallel_ranks() -> None:
    with pytest.raises(
        ValueError,
        match=r"MixedFSDP2Strategy: expert_parallel_size=2 must divide the data-parallel shard ranks"
        r" \(data_parallel_size=3\).*use a divisor of it",
    ):
        ParallelDims(replicate=1, shard=3, tensor_parallel=1, expert_parallel=2).validate(3, "MixedFSDP2Strategy")


def test_expert_parallelism_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"MixedFSDP2Strategy: expert_parallel_size=2 with tensor_parallel_size=2 is not supported; use"
        r" tensor_parallel_size=1 with expert parallelism",
    ):
        ParallelDims(replicate=1, shard=2, tensor_parallel=2, expert_parallel=2).validate(4, "MixedFSDP2Strategy")


def test_a_plan_with_experts_needs_an_expert_mesh() -> None:
    from lightning_mixedfsdp.apply.applier import apply_plan
    from lightning_mixedfsdp.mesh import ParallelMeshes
    from tests.hf_models import tiny_model

    model = tiny_model("qwen3_moe")
    plan = plan_sharding(model, MixedFSDPConfig(expert_parallel_size=2), "bf16-true")
    meshes = ParallelMeshes(root=None, fsdp=None, data_parallel=None)  # no processes needed: refused before any use
    with pytest.raises(
        ValueError,
        match=r"mixed_fsdp2: the plan splits experts over 2 ranks, but the meshes hold no expert mesh. Pass"
        r" `shard_model` the meshes of `ParallelDims\(..., expert_parallel=E\).build_meshes\(...\)`",
    ):
        apply_plan(model, plan, meshes, torch.device("cpu"), lambda module, _: module)


@pytest.mark.parametrize(("field", "choices"), [("quantize_base", r"\['nf4'\]"), ("offload", r"\['cpu'\]")])
def test_unknown_quantize_base_or_offload(field: str, choices: str) -> None:
    with pytest.raises(MixedFSDPConfigError, match=rf"{field}='int4' is not supported; use one of {choices} or None"):
        MixedFSDPConfig(**{field: "int4"}).validate()


def test_quantize_base_without_torchao_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lightning_mixedfsdp.apply.quantize import apply_quantization

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(
        ImportError, match=r"quantize_base='nf4' needs torchao.*pip install 'lightning-mixedfsdp\[qlora\]'"
    ):
        apply_quantization(nn.Linear(64, 256), ["weight"], tensor_parallel_ranks=1, device=torch.device("cpu"))


def test_quantize_base_under_tensor_parallelism() -> None:
    pytest.importorskip("torchao")
    from lightning_mixedfsdp.apply.quantize import apply_quantization

    with pytest.raises(ValueError, match=r"quantize_base='nf4' with tensor_parallel_size=2 is not supported.*Use"):
        apply_quantization(nn.Linear(256, 256), ["weight"], tensor_parallel_ranks=2, device=torch.device("cpu"))


def test_unknown_float8_recipe() -> None:
    with pytest.raises(
        MixedFSDPConfigError,
        match=r"float8\.recipe='mxfp4' is not supported; use one of \['tensorwise', 'rowwise'\] or None",
    ):
        MixedFSDPConfig(float8="mxfp4").validate()  # type: ignore[arg-type]


def test_float8_options_without_a_float8_recipe() -> None:
    with pytest.raises(
        MixedFSDPConfigError,
        match=r"float8\.include, exclude and emulate need a float8 recipe; set float8\.recipe='tensorwise'",
    ):
        MixedFSDPConfig(float8_emulate=True).validate()


def test_float8_on_a_cpu_is_refused_when_fabric_is_constructed() -> None:
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match=r"MixedFSDP2Strategy: float8.recipe='tensorwise' needs float8 matmuls, which"):
        Fabric(accelerator="cpu", devices=2, strategy=MixedFSDP2Strategy(float8="tensorwise"))
    # emulated float8 runs anywhere
    Fabric(accelerator="cpu", devices=2, strategy=MixedFSDP2Strategy(float8={"recipe": "rowwise", "emulate": True}))


def test_float8_on_a_cpu_is_refused_when_the_trainer_is_constructed() -> None:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy as TrainerStrategy

    with pytest.raises(ValueError, match=r"float8.recipe='rowwise' needs float8 matmuls, which the CPU lacks"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=TrainerStrategy(float8="rowwise"), logger=False)


def test_float8_on_a_cpu_recipe_is_refused_before_launch() -> None:
    from lightning_mixedfsdp.recipes.run.loader import load_recipe
    from lightning_mixedfsdp.recipes.settings.schema import RecipeError

    with pytest.raises(
        RecipeError,
        match=r"strategy.float8.recipe='tensorwise' needs float8 matmuls.*Set strategy\.float8\.emulate=true to",
    ):
        load_recipe("conf/stdlib_llama.yaml", ["strategy.float8=tensorwise"])


@pytest.mark.parametrize(
    ("options", "install"),
    [({"float8": {"recipe": "tensorwise", "emulate": True}}, r"\[float8\]"), ({"quantize_base": "nf4"}, r"\[qlora\]")],
)
def test_a_missing_torchao_is_refused_at_construction_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch, options: dict, install: str
) -> None:
    import lightning_mixedfsdp.compat.torchao as torchao_compat

    monkeypatch.setattr(torchao_compat, "torchao_installed", lambda: False)
    with pytest.raises(
        ImportError, match=rf"MixedFSDP2Strategy: .* needs torchao.*not installed: pip install .*{install}"
    ):
        MixedFSDP2Strategy(**options)


def test_context_parallelism_with_compile_is_refused() -> None:
    with pytest.raises(
        MixedFSDPConfigError,
        match=r"context_parallel_size=2 with sharding.compile=True.*\(or parallelism.context_parallel_size=1\)",
    ):
        MixedFSDPConfig(context_parallel_size=2, compile=True).validate()


def test_context_parallel_size_must_divide_the_world() -> None:
    with pytest.raises(
        ValueError,
        match=r"^MixedFSDP2Strategy: .*; context_parallel_size=3 must divide the world size \(4\); use a divisor",
    ):
        ParallelDims.resolve(world_size=4, devices_per_node=4, context_parallel=3, owner="MixedFSDP2Strategy")


def test_context_parallelism_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"MixedFSDP2Strategy: context_parallel_size=2 with tensor_parallel_size=2 is not supported: both split"
        r" each sequence's activations.*use one of them",
    ):
        ParallelDims(replicate=1, shard=1, tensor_parallel=2, context_parallel=2).validate(4, "MixedFSDP2Strategy")


def test_context_parallelism_with_expert_parallelism_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"MixedFSDP2Strategy: context_parallel_size=2 with expert_parallel_size=2 is not supported: expert"
        r" parallelism splits the data-parallel shard ranks.*use one of them",
    ):
        ParallelDims(replicate=1, shard=2, expert_parallel=2, context_parallel=2).validate(4, "MixedFSDP2Strategy")


def test_context_parallel_sizes_must_multiply_to_the_world_size() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"`data_parallel_size=1`, `context_parallel_size=2` and `tensor_parallel_size=1` multiplied should equal"
        r" the world size \(4\)",
    ):
        ParallelDims(replicate=1, shard=1, context_parallel=2).validate(4, "MixedFSDP2Strategy")
