"""The planner in one process: no collectives, no process group."""

import pytest
import torch
from torch import nn

from lightning_mixedfsdp import MixedFSDPConfig, find_keep_fp32_params, plan_sharding
from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.recipes.models.tiny_llama import RMSNorm, TinyLlama, TinyLlamaConfig

SMALL = TinyLlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=32)


class GatedNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class InnerBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)


class OuterBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.inner = nn.ModuleList(InnerBlock(dim) for _ in range(2))
        self.proj = nn.Linear(dim, dim)


class Nested(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OuterBlock(dim) for _ in range(2))


def test_planning_changes_nothing_and_needs_no_process_group() -> None:
    import torch.distributed as dist

    model = TinyLlama(SMALL)
    before = {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    plan = plan_sharding(model, MixedFSDPConfig(), precision="bf16-true")
    assert not dist.is_initialized()
    for name, param in model.named_parameters():
        assert param.dtype == before[name][0] and torch.equal(param, before[name][1]), name
    assert plan.params["layers.0.attention.wq.weight"].key.storage == torch.bfloat16
    assert plan.params["layers.0.attention_norm.weight"].key.storage == torch.float32


def test_norms_of_a_block_form_one_group_not_one_per_norm() -> None:
    plan = plan_sharding(TinyLlama(SMALL), MixedFSDPConfig(replicate_below_bytes=0), precision="bf16-true")
    norm_groups = [g for g in plan.groups if "norm" in g.name]
    assert [g.name for g in norm_groups] == [
        "layers.1[attention_norm,ffn_norm]",
        "layers.0[attention_norm,ffn_norm]",
        "<root>[norm]",
    ]
    assert all(not g.replicated and g.key.output == torch.bfloat16 for g in norm_groups)
    assert [g.name for g in plan.sharded_groups][-1] == "<root>" and plan.sharded_groups[-1].is_root


def test_nested_wrap_units_are_planned_children_first() -> None:
    plan = plan_sharding(
        Nested(), MixedFSDPConfig(wrap_units=["OuterBlock", "InnerBlock"], replicate_below_bytes=0), "bf16-true"
    )
    names = [g.name for g in plan.sharded_groups]
    assert names.index("blocks.0.inner.1") < names.index("blocks.0.inner.0") < names.index("blocks.0")
    assert "blocks.0.inner.0[norm]" in names and "blocks.0[norm]" in names
    # the outer block's group holds only its own params, not the inner units'
    assert set(next(g for g in plan.groups if g.name == "blocks.0").params) == {
        "blocks.0.proj.weight",
        "blocks.0.proj.bias",
    }


def test_auto_units_are_the_outermost_module_list_children() -> None:
    plan = plan_sharding(Nested(), MixedFSDPConfig(replicate_below_bytes=0), "bf16-true")
    assert {g.unit for g in plan.groups} == {"blocks.0", "blocks.1", ""}
    # the inner blocks' norms are a minority inside the outer unit: one group for all of them
    assert "blocks.0[inner.0.norm,inner.1.norm,norm]" in [g.name for g in plan.groups]


def test_two_minority_keys_get_one_group_each() -> None:
    model = TinyLlama(SMALL).to(torch.bfloat16)
    for layer in model.layers:
        layer.feed_forward.w2.float()  # arrives fp32 and is not pinned: a second minority key
    config = MixedFSDPConfig(storage="keep", compute_dtype="bf16", replicate_below_bytes=0)
    plan = plan_sharding(model, config, precision="32-true")
    layer_groups = [g for g in plan.groups if g.unit == "layers.0"]
    assert sorted((g.name, str(g.key)) for g in layer_groups) == [
        ("layers.0", "bf16/bf16/bf16"),
        ("layers.0[attention_norm,ffn_norm]", "fp32/fp32/fp32->bf16"),
        ("layers.0[feed_forward.w2]", "fp32/bf16/bf16"),
    ]


def test_frozen_params_of_another_dtype_do_not_break_uniformity() -> None:
    model = TinyLlama(SMALL).to(torch.bfloat16)
    for layer in model.layers:
        layer.attention.requires_grad_(False)
        layer.attention.float()  # a frozen fp32 tower inside a bf16 block
    plan = plan_sharding(model, MixedFSDPConfig(storage="keep", keep_fp32_modules=[]), precision="32-true")
    assert [g.name for g in plan.groups] == ["layers.1", "layers.0", "<root>"]
    frozen = plan.params["layers.0.attention.wq.weight"]
    assert (frozen.requires_grad, frozen.key.storage, frozen.key.compute) == (False, torch.float32, torch.bfloat16)
    assert "(frozen)" in format_plan(plan)


def test_inseparable_params_are_replicated_whatever_the_threshold() -> None:
    config = MixedFSDPConfig(keep_fp32_params=[r"A_log$"], replicate_below_bytes=0)
    model = TinyLlama(TinyLlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, hidden_dim=32, mixer_layers=(0,)))
    plan = plan_sharding(model, config, precision="bf16-true")
    group = next(g for g in plan.replicated_groups)
    assert (group.params, group.reason, group.modules) == (("layers.0.attention.A_log",), "inseparable", ())
    assert plan.params["layers.0.attention.dt_bias"].group == "layers.0"


def test_small_minority_groups_are_replicated_below_the_threshold() -> None:
    plan = plan_sharding(TinyLlama(SMALL), MixedFSDPConfig(), precision="bf16-true")
    assert {g.reason for g in plan.replicated_groups} == {"small"}
    assert len(plan.replicated_params) == 2 * SMALL.n_layers + 1
    assert plan.predicted_collectives() == {"all_gather": 2 * 3 - 1, "reduce_scatter": 3, "all_reduce": 1}
    assert plan.predicted_collectives(reshard_after_forward=False)["all_gather"] == 3


class HFLikeMoE(nn.Module):
    _no_split_modules = ["HFLikeLayer"]
    _keep_in_fp32_modules = ["router"]
    _keep_in_fp32_modules_strict = ["A_log"]

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(HFLikeLayer() for _ in range(2))


class HFLikeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.routers_extra = nn.Linear(8, 4, bias=False)  # "router" is a substring but not a dotted component
        self.A_log = nn.Parameter(torch.zeros(8))
        self.mlp = nn.Linear(8, 8)


def test_hf_keep_in_fp32_attributes_follow_the_installed_transformers_5_rule() -> None:
    # transformers 5 searches each listed name as an unanchored regex: "router" also matches "routers_extra"
    pinned = find_keep_fp32_params(HFLikeMoE(), module_rules=[], param_patterns=[])
    expected = {f"model.layers.{i}.{n}" for i in (0, 1) for n in ("router.weight", "routers_extra.weight", "A_log")}
    assert set(pinned.rule_of) == expected
    assert pinned.strict == {"model.layers.0.A_log", "model.layers.1.A_log"}
    assert str(pinned.rule_of["model.layers.0.router.weight"]) == "hf:_keep_in_fp32_modules[router]"
    # honor_hf=False drops the non-strict list only: HF keeps strict names fp32 under every dtype
    assert set(find_keep_fp32_params(HFLikeMoE(), honor_hf=False).rule_of) == {
        "model.layers.0.A_log",
        "model.layers.1.A_log",
    }


NAMES = ["model.layers.0.router.weight", "model.layers.0.routers_extra.weight", "model.norm.weight", "lm_head.weight"]


def test_transformers_4_matched_whole_dotted_components() -> None:
    from lightning_mixedfsdp.planning.matching import hf_name_matcher

    matches = hf_name_matcher(["router", "norm"], transformers_version="4.57.1")
    assert [n for n in NAMES if matches(n)] == ["model.layers.0.router.weight", "model.norm.weight"]


def test_transformers_5_rule_equals_transformers_own_glob_alternation() -> None:
    from transformers.core_model_loading import build_glob_alternation

    from lightning_mixedfsdp.planning.matching import hf_name_matcher

    for listed in (["router"], ["norm", "lm_*"], ["layers.*.router"], ["e_score_correction_bias"]):
        theirs, _, _ = build_glob_alternation(listed)
        ours = hf_name_matcher(listed, transformers_version="5.23.0")
        assert [n for n in NAMES if ours(n)] == [n for n in NAMES if theirs.search(n)], listed


def test_hf_no_split_modules_are_the_units() -> None:
    plan = plan_sharding(HFLikeMoE(), MixedFSDPConfig(replicate_below_bytes=0), precision="bf16-true")
    assert {g.unit for g in plan.groups} == {"model.layers.0", "model.layers.1", ""}
    assert plan.params["model.layers.0.router.weight"].key.storage == torch.float32
    assert plan.params["model.layers.0.mlp.weight"].key.storage == torch.bfloat16


def test_suffix_rules_match_class_name_endings_and_qualified_rules_match_exactly() -> None:
    model = nn.Module()
    model.a = GatedNorm(4)
    model.b = RMSNorm(4)
    by_suffix = find_keep_fp32_params(model, module_rules=["Norm"])
    assert set(by_suffix.rule_of) == {"a.weight", "b.weight"}
    by_path = find_keep_fp32_params(model, module_rules=[f"{__name__}.GatedNorm"])
    assert set(by_path.rule_of) == {"a.weight"}
    wrong_path = find_keep_fp32_params(model, module_rules=["elsewhere.GatedNorm"])
    assert not wrong_path.rule_of and tuple(map(str, wrong_path.unmatched_rules)) == ("module:elsewhere.GatedNorm",)


def test_report_lists_every_param_collapsed_per_block_with_dtypes_groups_and_rules() -> None:
    config = MixedFSDPConfig(keep_fp32_params=[r"A_log$", "no_such_param"])
    model = TinyLlama(TinyLlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, hidden_dim=32, mixer_layers=(1,)))
    report = format_plan(plan_sharding(model, config, precision="bf16-mixed"))
    lines = report.splitlines()
    assert lines[0].startswith("mixed_fsdp2 dtype plan: 30 params")
    assert "bulk: storage fp32, compute bf16, reduce bf16" in report
    header = next(line for line in lines if line.startswith("parameter"))
    assert header.split() == [
        "parameter",
        "shape",
        "storage",
        "compute",
        "reduce",
        "placement",
        "group",
        "keep-fp32",
        "rule",
    ]
    row = next(line for line in lines if line.startswith("layers.*.ffn_norm.weight x3"))
    assert row.split()[2:] == [
        "16",
        "fp32",
        "fp32",
        "fp32",
        "replicated",
        "layers.*[attention_norm,ffn_norm]",
        "module:RMSNorm",
    ]
    row = next(line for line in lines if line.startswith("layers.*.feed_forward.w1.weight x3"))
    assert row.split()[2:] == ["32x16", "fp32", "bf16", "bf16", "sharded", "layers.*", "-"]
    assert any(line.startswith("layers.*.attention.A_log") and "inseparable" in line for line in lines)
    assert lines[-1] == "warning: keep-fp32 rule 'param:no_such_param' matched no parameter"


def test_default_norm_rules_warn_once_when_no_norm_matches() -> None:
    plan = plan_sharding(nn.Sequential(nn.Linear(2, 2)), MixedFSDPConfig())
    assert len(plan.warnings) == 1 and "no module class ends with RMSNorm or LayerNorm" in plan.warnings[0]
    assert not plan_sharding(TinyLlama(SMALL), MixedFSDPConfig()).warnings


def test_empty_keep_fp32_list_pins_nothing() -> None:
    plan = plan_sharding(TinyLlama(SMALL), MixedFSDPConfig(keep_fp32_modules=[]), precision="bf16-true")
    assert all(p.key.storage == torch.bfloat16 for p in plan.params.values())
    assert not plan.replicated_groups


def test_expert_parallel_plan_makes_each_experts_module_its_own_unit_and_finds_nested_hf_plans() -> None:
    from tests.hf_models import tiny_model

    class Holder(nn.Module):  # a LightningModule-like holder: the HF model's plan is found and prefixed
        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny_model("gpt_oss")

    routers = [r"mlp\.router\.(weight|bias)$"]
    plan = plan_sharding(Holder(), MixedFSDPConfig(expert_parallel_size=2, keep_fp32_params=routers), "bf16-true")
    experts = plan.experts
    assert experts is not None and experts.size == 2
    assert experts.modules == ("lm.model.layers.0.mlp.experts", "lm.model.layers.1.mlp.experts")
    assert experts.num_experts == dict.fromkeys(experts.modules, 4)
    assert set(experts.params) == {
        f"lm.model.layers.{i}.mlp.experts.{p}"
        for i in (0, 1)
        for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    }
    expert_groups = [g for g in plan.groups if g.expert]
    assert [g.modules for g in expert_groups] == [(m,) for m in reversed(experts.modules)]  # children first
    order = [g.name for g in plan.groups]
    for group in expert_groups:  # sharded before the block holding it
        assert order.index(group.name) < order.index(group.unit.rsplit(".mlp", 1)[0])
    assert all(plan.params[p].key.storage == torch.bfloat16 for p in experts.params)
    assert plan.params["lm.model.layers.0.mlp.router.weight"].key.storage == torch.float32
    # the outermost units (AC, compile) stay the blocks
    assert plan.outermost_units == ("lm.model.layers.1", "lm.model.layers.0")
    # a user plan with the same names gives the same expert plan
    user = {"lm.model.layers.*.mlp.experts": "ep_dispatch_experts"}
    user.update({f"lm.model.layers.*.mlp.experts.{p}": "grouped_gemm" for p in ("gate_up_proj", "down_proj")})
    user.update({f"lm.model.layers.*.mlp.experts.{p}_bias": "grouped_gemm" for p in ("gate_up_proj", "down_proj")})
    own = plan_sharding(Holder(), MixedFSDPConfig(expert_parallel_size=2, expert_parallel_plan=user), "bf16-true")
    assert own.experts == experts
    # E=1 plans no experts and keeps the experts in their block's group
    assert plan_sharding(Holder(), MixedFSDPConfig(), "bf16-true").experts is None


def _plans_both_ways(model: nn.Module, config: MixedFSDPConfig, precision: str) -> tuple:
    from lightning_mixedfsdp.planning.options import PlanOptions
    from lightning_mixedfsdp.planning.planner import plan_model

    bulk, options = config.bulk_dtypes(precision), PlanOptions.of(config)
    return tuple(plan_model(model, bulk, options, mixed_dtype_groups=native) for native in (False, True))


def test_native_mixed_dtype_groups_change_only_the_groups_never_a_dtype_or_the_checkpoint_layout() -> None:
    """The switch point for a torch whose fully_shard groups mixed dtypes: each unit becomes one group, every
    tensor keeps its dtypes, so checkpoints keep their layout. No installed torch has the feature yet."""
    from peft import LoraConfig, get_peft_model

    from lightning_mixedfsdp.apply.applier import check_groups_supported
    from lightning_mixedfsdp.model.names import canonical_name
    from lightning_mixedfsdp.planning.planner import fsdp_groups_can_mix_dtypes
    from tests.hf_models import tiny_model
    from tests.scenarios import A_LOG, MIXER, BufferedLlama

    assert fsdp_groups_can_mix_dtypes() is False  # torch 2.11 to 2.15: one original dtype per fully_shard group
    lora = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cases = {
        "llama": (tiny_model("llama"), MixedFSDPConfig(), "bf16-true"),
        "qwen3_moe": (tiny_model("qwen3_moe"), MixedFSDPConfig(), "bf16-mixed"),
        "lora": (lora, MixedFSDPConfig(), "bf16-true"),
        "inseparable A_log": (BufferedLlama(MIXER), MixedFSDPConfig(keep_fp32_params=A_LOG), "bf16-true"),
    }
    for case, (model, config, precision) in cases.items():
        per_dtype, native = _plans_both_ways(model, config, precision)
        assert per_dtype.checkpoint_layout == native.checkpoint_layout, case
        saved = {canonical_name(n) for n, tensor in model.state_dict().items() if tensor.is_floating_point()}
        assert set(per_dtype.checkpoint_layout) == saved, case
        for name, planned in per_dtype.params.items():
            other = native.params[name]
            assert (planned.key, planned.requires_grad, planned.rule) == (other.key, other.requires_grad, other.rule)
        assert per_dtype.buffers == native.buffers and per_dtype.fp32_names == native.fp32_names, case
        # fewer groups: one per unit and the root, nothing replicated
        assert len(native.groups) == len(per_dtype.units) + 1 < len(per_dtype.groups), case
        assert not native.replicated_groups and not per_dtype.mixed_dtype_groups, case
        check_groups_supported(per_dtype)
        if case == "lora":  # only the adapters train: the fp32 norms are frozen, so no group reduces two dtypes
            assert not native.mixed_dtype_groups
            continue
        assert native.mixed_dtype_groups, case
        with pytest.raises(ValueError, match=r"cannot hold \(one original dtype per group\).*mixed_dtype_groups=False"):
            check_groups_supported(native)
