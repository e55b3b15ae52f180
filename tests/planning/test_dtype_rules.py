"""One dtype decision per tensor: every buffer rule on real HF models, on 2 ranks, after setup and after a checkpoint
round trip (Fabric's DCP save and load into a fresh model); the state-space params the default rules keep fp32
(``A_log``, ``dt_bias``, Mamba's ``D``, Mamba-1's ``dt_proj.bias``) on HF Mamba, Mamba2, Qwen3-Next and Falcon-H1, and
checkpoints saved under the rules before ``dt_bias`` and ``D``, or ``dt_proj.bias``, joined them loading under the new
ones with the manifest's warning."""

import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.planning.report import format_plan
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import TOWER_UNITS, TowerModel, make_fabric, unwrap

WORLD = 2
FLAGS = ("bf16-true", "bf16-mixed", "32-true")
ROPE = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")
ROUTER_BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
# the default keep_fp32_params before dt_bias and Mamba's D joined them: what a checkpoint made then was saved under
OLD_DEFAULT_PARAMS = [r"(^|\.)A_log$", r"(^|\.)(e_score_correction_bias|expert_bias)$"]
A_LOG_RULE, DT_BIAS_RULE, D_RULE = r"param:(^|\.)A_log$", r"param:(^|\.)dt_bias$", r"param:(^|\.)(mixer|mamba)\.D$"
DT_PROJ_RULE = r"param:(^|\.)(mixer|mamba)\.dt_proj\.bias$"
# the default keep_fp32_params before Mamba-1's dt_proj.bias joined them
BEFORE_DT_PROJ = [r"(^|\.)A_log$", r"(^|\.)dt_bias$", r"(^|\.)(mixer|mamba)\.D$", OLD_DEFAULT_PARAMS[1]]
# every state-space param of the tiny models' two layers, with the default rule that keeps it fp32
SSM_PARAMS = {
    # Mamba-1: the time-step bias is the bias of the mixer's dt_proj Linear, whose weight stays bf16
    "mamba": {
        f"backbone.layers.{i}.mixer.{n}": rule
        for i in (0, 1)
        for n, rule in (("A_log", A_LOG_RULE), ("D", D_RULE), ("dt_proj.bias", DT_PROJ_RULE))
    },
    "mamba2": {
        f"backbone.layers.{i}.mixer.{n}": rule
        for i in (0, 1)
        for n, rule in (("A_log", A_LOG_RULE), ("dt_bias", DT_BIAS_RULE), ("D", D_RULE))
    },
    # layer 1 is full attention
    "qwen3_next": {"model.layers.0.linear_attn.A_log": A_LOG_RULE, "model.layers.0.linear_attn.dt_bias": DT_BIAS_RULE},
    # Falcon-H1: attention and a Mamba2 mixer side by side in every layer
    "falcon_h1": {
        f"model.layers.{i}.mamba.{n}": rule
        for i in (0, 1)
        for n, rule in (("A_log", A_LOG_RULE), ("dt_bias", DT_BIAS_RULE), ("D", D_RULE))
    },
}
# the norms, kept by the default class rules
SSM_NORMS = {
    "mamba": {*(f"backbone.layers.{i}.norm.weight" for i in (0, 1)), "backbone.norm_f.weight"},
    "mamba2": {
        *(f"backbone.layers.{i}.{n}.weight" for i in (0, 1) for n in ("norm", "mixer.norm")),
        "backbone.norm_f.weight",
    },
    "qwen3_next": {
        *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")),
        "model.layers.0.linear_attn.norm.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.norm.weight",
    },
    "falcon_h1": {
        *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "pre_ff_layernorm")),
        "model.final_layernorm.weight",
    },
}


class FrozenLlamaTower(nn.Module):
    """A frozen HF LlamaModel (a tower with RoPE buffers) feeding a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = tiny_model("llama").model
        self.head = nn.Linear(32, 1)
        self.tower.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tower(input_ids=input_ids).last_hidden_state)


def _tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every param (full) and floating buffer, by canonical name."""
    from torch.distributed.tensor import DTensor

    inner = unwrap(model)
    out = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in inner.named_parameters()}
    out.update({n: b.detach().clone() for n, b in inner.named_buffers() if b.is_floating_point()})
    return out


def _round_trip(
    build: Any,
    precision: str,
    folder: Path,
    strategy_fields: Optional[Dict[str, Any]] = None,
    load_fields: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Set up ``build(0)`` and train one step (AdamW, lr 1e-3), save; set up ``build(1)``, load (under
    ``load_fields`` in a Fabric of its own when given); the states before and after the step, the loaded one, the
    keep-fp32 warnings of the load and the plan."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fields = strategy_fields or {}
    fabric = make_fabric(WORLD, precision, MixedFSDP2Strategy(**fields))
    model = fabric.setup(build(0))
    initial = _tensors(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(fabric.global_rank))
    output = model(input_ids=tokens)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    fabric.backward(logits.float().pow(2).mean())
    optimizer.step()
    plan = fabric.strategy.plan_of(model)
    saved = _tensors(model)
    fabric.save(folder, {"model": model})
    target = fabric if load_fields is None else make_fabric(WORLD, precision, MixedFSDP2Strategy(**load_fields))
    fresh = target.setup(build(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.load(folder, {"model": fresh})
    rules = {
        **{n: None if p.rule is None else str(p.rule) for n, p in plan.params.items()},
        **{n: b.set_by for n, b in plan.buffers.items()},
    }
    return {
        "initial": initial,
        "saved": saved,
        "loaded": _tensors(fresh),
        "load_warnings": [str(w.message) for w in caught if "keep-fp32 rules" in str(w.message)],
        "rules": rules,
        "param_dtypes": {n: saved[n].dtype for n in plan.params},
        "report": format_plan(plan),
    }


def _llama(seed: int) -> nn.Module:
    return tiny_model("llama", seed=seed)


def _mamba(seed: int) -> nn.Module:
    return tiny_model("mamba", seed=seed)


def _mamba2(seed: int) -> nn.Module:
    return tiny_model("mamba2", seed=seed)


def _qwen3_next(seed: int) -> nn.Module:
    return tiny_model("qwen3_next", seed=seed)


def _falcon_h1(seed: int) -> nn.Module:
    return tiny_model("falcon_h1", seed=seed)


SSM_BUILDS = {"mamba": _mamba, "mamba2": _mamba2, "qwen3_next": _qwen3_next, "falcon_h1": _falcon_h1}


def _dots1_in_bf16(seed: int) -> nn.Module:
    # arrives in bf16, so under 32-true the strict HF name has to cast the router bias back up
    return tiny_model("dots1", seed=seed).to(torch.bfloat16)


def _gpt_oss_in_bf16(seed: int) -> nn.Module:
    return tiny_model("gpt_oss", seed=seed).to(torch.bfloat16)


def _frozen_llama_tower(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return FrozenLlamaTower()


def _tower(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = TowerModel()
    with torch.no_grad():
        model.tower.normalizer.std_scale.add_(seed)  # the loaded values must come from the checkpoint
    return model


class _TowerWithIds(nn.Module):
    """TowerModel called like the HF models above (``input_ids`` of width 16 as features)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.inner = _tower(seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.nn.functional.one_hot(input_ids % 16, 16).float().mean(1))


def _plugin_agreement(rank: int) -> Dict[str, Any]:
    from lightning_mixedfsdp import MixedFSDPPrecision
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(storage="fp32", keep_fp32_params=[r"lm_head"])
    fabric = make_fabric(WORLD, precision=None, strategy=strategy, plugins=[MixedFSDPPrecision("bf16-true")])
    model = fabric.setup(tiny_model("llama"))
    plan = fabric.strategy.plan_of(model)
    dtypes = {n: p.dtype for n, p in unwrap(model).named_parameters()}
    return {
        "plugin_bulk": tuple(fabric.strategy.precision.bulk),
        "plan_bulk": tuple(plan.bulk),
        "planned": {n: p.key.storage for n, p in plan.params.items()},
        "dtypes": dtypes,
    }


def _scenarios(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    root = Path(folder)
    out: Dict[str, Any] = {"llama": _round_trip(_llama, "bf16-true", root / "llama")}
    for flag in FLAGS:
        # keep_fp32_params=[]: only the model's own HF strict list keeps its router bias fp32 here (the default
        # regexes name it too)
        out[f"dots1/{flag}"] = _round_trip(_dots1_in_bf16, flag, root / f"dots1-{flag}", {"keep_fp32_params": []})
        # keep_fp32_modules=[]: only the model's own HF list keeps its norms fp32 here
        out[f"gpt_oss/{flag}"] = _round_trip(
            _gpt_oss_in_bf16, flag, root / f"gpt_oss-{flag}", {"keep_fp32_modules": []}
        )
    out["gpt_oss/not_honoured"] = _round_trip(
        _gpt_oss_in_bf16,
        "bf16-true",
        root / "gpt_oss-off",
        {"keep_fp32_modules": [], "honor_hf_keep_in_fp32": False},
    )
    out["frozen_llama_tower"] = _round_trip(_frozen_llama_tower, "bf16-mixed", root / "tower-rope", {})
    out["frozen_llama_tower/no_rules"] = _round_trip(
        _frozen_llama_tower, "bf16-mixed", root / "tower-rope-off", {"keep_fp32_modules": []}
    )
    out["tower"] = _round_trip(
        _TowerWithIds, "bf16-mixed", root / "tower", {"wrap_units": TOWER_UNITS, "keep_fp32_params": [r"std_scale$"]}
    )
    out["plugin"] = _plugin_agreement(rank)
    for name, build in SSM_BUILDS.items():
        out[name] = _round_trip(build, "bf16-true", root / name)
    # a checkpoint made before dt_bias and D were kept fp32 by default, resumed under the defaults now
    out["mamba2/old_rules"] = _round_trip(
        _mamba2, "bf16-true", root / "mamba2-old", {"keep_fp32_params": OLD_DEFAULT_PARAMS}, load_fields={}
    )
    out["mamba/old_rules"] = _round_trip(
        _mamba, "bf16-true", root / "mamba-old", {"keep_fp32_params": BEFORE_DT_PROJ}, load_fields={}
    )
    return out


LAUNCH = Launch(_scenarios, WORLD, timeout=300)


def _assert_both(results: list, scenario: str, name: str, dtype: torch.dtype, rule: str) -> None:
    """``name`` has ``dtype`` and its rule after setup (and training), and loads back bit for bit, on every rank."""
    for result in results:
        out = result[scenario]
        assert out["rules"][name] == rule, (scenario, name, out["report"])
        saved, loaded = out["saved"][name], out["loaded"][name]
        assert saved.dtype == dtype and loaded.dtype == dtype, (scenario, name, saved.dtype, loaded.dtype)
        assert torch.equal(loaded, saved), (scenario, name)


def test_rope_inv_freq_stays_fp32_and_bit_exact(results: list) -> None:
    reference = dict(tiny_model("llama").named_buffers())
    for name in ROPE:
        _assert_both(results, "llama", name, torch.float32, "module:RotaryEmbedding")
        assert torch.equal(results[0]["llama"]["saved"][name], reference[name]), name
    assert "model.rotary_emb.inv_freq" in results[0]["llama"]["report"]


@pytest.mark.parametrize("flag", FLAGS)
def test_hf_strict_buffer_is_fp32_under_every_flag(results: list, flag: str) -> None:
    rule = "hf:_keep_in_fp32_modules_strict[e_score_correction_bias]"
    _assert_both(results, f"dots1/{flag}", ROUTER_BIAS, torch.float32, rule)


@pytest.mark.parametrize("flag", FLAGS)
def test_hf_non_strict_name_is_fp32_under_every_flag_when_honoured(results: list, flag: str) -> None:
    _assert_both(results, f"gpt_oss/{flag}", "model.norm.weight", torch.float32, "hf:_keep_in_fp32_modules[norm]")
    bulk = {"bf16-true": torch.bfloat16, "bf16-mixed": torch.float32, "32-true": torch.bfloat16}[flag]
    assert results[0][f"gpt_oss/{flag}"]["saved"]["model.embed_tokens.weight"].dtype == bulk


def test_hf_non_strict_name_follows_the_bulk_when_not_honoured(results: list) -> None:
    _assert_both(results, "gpt_oss/not_honoured", "model.norm.weight", torch.bfloat16, None)


def test_class_rule_keeps_a_frozen_towers_rope_buffers_fp32(results: list) -> None:
    for name in ROPE:
        tower_name = name.replace("model.", "tower.", 1)
        _assert_both(results, "frozen_llama_tower", tower_name, torch.float32, "module:RotaryEmbedding")


def test_frozen_module_buffer_goes_to_the_compute_dtype(results: list) -> None:
    # the same frozen tower without the RotaryEmbedding rule: its buffers follow the frozen-module rule
    _assert_both(results, "frozen_llama_tower/no_rules", "tower.rotary_emb.inv_freq", torch.bfloat16, "frozen module")
    _assert_both(results, "tower", "inner.tower.normalizer.std_bias", torch.bfloat16, "frozen module")


def test_regex_matched_buffer_is_fp32_inside_a_frozen_module(results: list) -> None:
    _assert_both(results, "tower", "inner.tower.normalizer.std_scale", torch.float32, r"param:std_scale$")


def test_a_user_passed_plugin_takes_the_strategys_dtypes(results: list) -> None:
    for result in results:
        out = result["plugin"]
        # the strategy says fp32 master weights; the plugin's flag alone would say bf16 storage
        assert out["plugin_bulk"] == out["plan_bulk"] == (torch.float32, torch.bfloat16, torch.bfloat16)
        assert out["dtypes"] == out["planned"]
        assert out["dtypes"]["model.layers.0.mlp.up_proj.weight"] == torch.float32


@pytest.mark.parametrize("model_type", SSM_BUILDS)
def test_state_space_params_are_fp32_by_default_and_a_bf16_true_step_moves_them(results: list, model_type: str) -> None:
    kept = SSM_PARAMS[model_type]
    for name, rule in kept.items():
        _assert_both(results, model_type, name, torch.float32, rule)
    fp32 = {*kept, *SSM_NORMS[model_type]}
    for result in results:
        out = result[model_type]
        assert out["param_dtypes"] == {n: torch.float32 if n in fp32 else torch.bfloat16 for n in out["param_dtypes"]}
        for name in kept:
            # AdamW's first update, about lr = 1e-3 per element, is kept in fp32: every element moved
            assert (out["saved"][name] != out["initial"][name]).all(), (model_type, name)


@pytest.mark.parametrize(
    ("scenario", "added_rules"), [("mamba2/old_rules", (DT_BIAS_RULE, D_RULE)), ("mamba/old_rules", (DT_PROJ_RULE,))]
)
def test_a_checkpoint_saved_before_a_rule_joined_the_defaults_loads_under_them_with_the_difference(
    results: list, scenario: str, added_rules: tuple
) -> None:
    out = results[0][scenario]
    added = {n: rule for n, rule in SSM_PARAMS[scenario.split("/")[0]].items() if rule in added_rules}
    (warning,) = out["load_warnings"]
    listed = ", ".join(f"{name} ({added[name]})" for name in sorted(added))
    assert f"(now kept fp32: {listed})" in warning and "no longer kept fp32" not in warning
    assert results[1][scenario]["load_warnings"] == []  # rank 0 warns
    for result in results:
        out = result[scenario]
        for name in added:
            saved, loaded = out["saved"][name], out["loaded"][name]
            # saved in bf16, where AdamW's first update (about 1e-3) rounded away on every element
            assert saved.dtype == torch.bfloat16 and torch.equal(saved, out["initial"][name]), name
            assert loaded.dtype == torch.float32 and torch.equal(loaded, saved.float()), name  # widened exactly
        for name in out["saved"].keys() - added.keys():
            assert out["loaded"][name].dtype == out["saved"][name].dtype, name
            assert torch.equal(out["loaded"][name], out["saved"][name]), name


class _UnrelatedD(nn.Module):
    """Params named ``D`` and ``dt_proj.bias`` (and near them) outside a Mamba mixer, beside the two places HF's Mamba
    mixers live."""

    def __init__(self) -> None:
        super().__init__()
        self.D = nn.Parameter(torch.ones(4))
        self.gate = nn.Linear(4, 4)
        self.gate.D = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList([nn.Module(), nn.Module()])
        self.layers[0].mixer = nn.Linear(4, 4)
        self.layers[0].mixer.D = nn.Parameter(torch.ones(4))
        self.layers[0].mixer.D_scale = nn.Parameter(torch.ones(4))
        self.layers[1].mamba = nn.Linear(4, 4)
        self.layers[1].mamba.D = nn.Parameter(torch.ones(4))
        self.layers[1].mamba.mixer_D = nn.Parameter(torch.ones(4))
        self.dt_proj = nn.Linear(4, 4)  # a time-step projection outside a Mamba mixer
        self.layers[1].mamba.dt_proj = nn.Linear(4, 4)


def test_the_default_rules_keep_only_a_mamba_mixers_d_and_dt_proj_bias_fp32() -> None:
    from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding

    plan = plan_sharding(_UnrelatedD(), MixedFSDPConfig(), "bf16-true")
    fp32 = {n for n, p in plan.params.items() if p.key.storage == torch.float32}
    assert fp32 == {"layers.0.mixer.D", "layers.1.mamba.D", "layers.1.mamba.dt_proj.bias"}
