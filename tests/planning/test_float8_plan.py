"""The float8 decision of every Linear layer in the plan, without processes: what is in, what is out and why, the
size thresholds, forcing layers in or out, the report; and the router correction biases the default rule keeps
fp32."""

import pytest
import torch
from torch import nn

from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.planning.float8 import too_small
from lightning_mixedfsdp.planning.report import format_plan
from tests.hf_models import tiny_model

FLOAT8 = dict(float8="tensorwise", float8_emulate=True)


class MoEBlock(nn.Module):
    """A block with Linear routers as older MoE code writes them (Mixtral 4.x, Qwen2-MoE's shared expert gate)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, 16, bias=False)
        self.shared_expert_gate = nn.Linear(dim, 16, bias=False)
        self.router = nn.Linear(dim, 16, bias=False)
        self.up_proj = nn.Linear(dim, 4 * dim)
        self.odd = nn.Linear(dim, 24)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MoEBlock() for _ in range(2)])
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)


def choices(model: nn.Module, **fields: object) -> dict:
    config = MixedFSDPConfig(**{**FLOAT8, "float8_skip_small": False, **fields})  # type: ignore[arg-type]
    plan = plan_sharding(model, config, "bf16-true")
    return {name: (choice.converted, choice.reason) for name, choice in plan.float8.items()}


def test_projections_train_in_float8_and_routers_gates_frozen_and_odd_dims_do_not() -> None:
    found = choices(Model())
    assert found["layers.0.q_proj"] == (True, "eligible") and found["layers.1.up_proj"] == (True, "eligible")
    assert found["layers.0.gate"] == (False, "router or gate")
    assert found["layers.0.shared_expert_gate"] == (False, "router or gate")
    assert found["layers.0.router"] == (False, "router or gate")
    assert found["layers.0.odd"] == (False, "dims 64->24 not divisible by 16")
    assert found["frozen"] == (False, "frozen")


def test_include_forces_a_router_in_but_never_odd_dims_and_exclude_forces_out() -> None:
    found = choices(Model(), float8_include=[r"layers\.0\.(gate|odd)$"], float8_exclude=[r"layers\.1\.up_proj$"])
    assert found["layers.0.gate"] == (True, "float8_include")
    assert found["layers.1.gate"] == (False, "router or gate")
    assert found["layers.0.odd"] == (False, "dims 64->24 not divisible by 16")
    assert found["layers.1.up_proj"] == (False, "float8_exclude")


def test_keep_fp32_layers_stay_out() -> None:
    found = choices(Model(), keep_fp32_params=[r"layers\.0\.q_proj\.weight$"])
    assert found["layers.0.q_proj"] == (False, "keep-fp32") and found["layers.1.q_proj"][0]


def test_the_output_head_stays_out_of_an_hf_model_and_small_layers_by_torchaos_thresholds() -> None:
    model = tiny_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16)
    found = choices(model)
    assert found["lm_head"] == (False, "output head")
    small = choices(model, float8_skip_small=True)
    assert small["model.layers.0.self_attn.q_proj"] == (
        False,
        "small: 64->64 below the tensorwise threshold (float8_skip_small)",
    )
    # Llama-3-8B's shapes: every projection gains under tensorwise; its small k/v projections not under rowwise
    assert not too_small("tensorwise", 4096, 4096) and not too_small("tensorwise", 4096, 14336)
    assert too_small("tensorwise", 4096, 1024) and too_small("rowwise", 4096, 1024)
    assert not too_small("rowwise", 4096, 14336) and not too_small("rowwise", 14336, 4096)


def test_the_report_shows_each_linears_decision_and_that_fused_experts_stay() -> None:
    model = tiny_model("qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16)
    plan = plan_sharding(model, MixedFSDPConfig(**FLOAT8, float8_skip_small=False), "bf16-true")  # type: ignore[arg-type]
    report = format_plan(plan)
    assert "float8 tensorwise: 8 of 9 Linear layers train in float8" in report
    rows = {line.split()[0]: line.split()[1:] for line in report.splitlines() if line.startswith("  ")}
    assert rows["model.layers.*.self_attn.q_proj"] == ["x2", "float8", "eligible"]
    assert rows["lm_head"] == ["-", "output", "head"]
    assert "experts stay in the compute dtype: model.layers.*.mlp.experts" in report


class Router(nn.Module):
    """A router whose correction bias its builder made bf16 (as LongCat-Flash's is under HF's bf16 build)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 64, dtype=torch.bfloat16))
        self.register_buffer("e_score_correction_bias", torch.zeros(8, dtype=torch.bfloat16))
        self.expert_bias = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)


def test_router_correction_biases_stay_fp32_by_default_whatever_the_model_builds() -> None:
    model = nn.ModuleDict({"router": Router()})
    plan = plan_sharding(model, MixedFSDPConfig(), "bf16-true")
    assert plan.storage_dtypes["router.e_score_correction_bias"] == torch.float32
    assert plan.storage_dtypes["router.expert_bias"] == torch.float32
    assert plan.storage_dtypes["router.weight"] == torch.bfloat16
    # without the default rule they stay bf16, where an aux-loss-free update of 1e-3 near 7 is lost entirely
    plain = plan_sharding(model, MixedFSDPConfig(keep_fp32_params=[]), "bf16-true")
    assert plain.storage_dtypes["router.e_score_correction_bias"] == torch.bfloat16
    assert (torch.tensor(7.0, dtype=torch.bfloat16) + 1e-3).item() == 7.0
    # DeepSeek-V3 from HF: the default rule names its biases, so they are fp32 by the rule, not by chance
    deepseek = plan_sharding(tiny_model("deepseek_v3"), MixedFSDPConfig(), "bf16-true")
    biases = [b for n, b in deepseek.buffers.items() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.dtype == torch.float32 and b.rule is not None for b in biases)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_device_without_float8_matmuls_is_refused_with_the_fix(recipe: str) -> None:
    from lightning_mixedfsdp.apply.float8 import check_float8_matmuls

    with pytest.raises(
        ValueError, match=rf"float8\.recipe='{recipe}' needs float8 matmuls, which CPU lacks.*float8\.emulate=True"
    ):
        check_float8_matmuls(torch.device("cpu"), recipe)
