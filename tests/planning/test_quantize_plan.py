"""The 4-bit base in the plan, without processes: which weights are quantized and why not, their bytes, the report,
the memory estimate with offload; and the per-rank quantization against torchao's whole-tensor one."""

import pytest
import torch
from torch import nn

from lightning_mixedfsdp import MixedFSDPConfig, plan_sharding
from lightning_mixedfsdp.planning.memory import estimate_memory
from lightning_mixedfsdp.planning.report import format_plan
from tests.composed.test_qlora import QLORA_DIMS, qlora_model

pytest.importorskip("torchao", reason="QLoRA needs torchao (pip install 'lightning-mixedfsdp[qlora]')")

NF4 = MixedFSDPConfig(quantize_base="nf4")


def test_every_frozen_linear_base_weight_is_nf4_and_nothing_trainable_or_pinned_is() -> None:
    model = qlora_model("llama")
    plan = plan_sharding(model, NF4, "bf16-true", shard_ranks=2)
    frozen_linear = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad
    }
    assert set(plan.quantized_params) == frozen_linear - {"base_model.model.lm_head.weight"}
    assert plan.not_quantized == {"base_model.model.lm_head.weight": "output head"}
    for name in plan.quantized_params:
        param = plan.params[name]
        assert param.quantized == "nf4" and not param.requires_grad and param.key.storage == torch.bfloat16
    assert not any(plan.params[n].quantized for n in plan.params if "lora_" in n or "norm" in n)


def test_a_shard_that_does_not_fill_whole_blocks_stays_in_its_dtype_with_the_reason() -> None:
    plan = plan_sharding(qlora_model("llama"), NF4, "bf16-true", shard_ranks=4)
    # k_proj and v_proj are 128x256: 32x256 = 8,192 weights per shard on 4 ranks, half a double-quantization block
    reasons = {name.split(".")[-3]: reason for name, reason in plan.not_quantized.items()}
    assert reasons["k_proj"] == reasons["v_proj"]
    assert "a shard of 32x256 weights is not a multiple of 16384" in reasons["k_proj"]
    assert "q_proj" not in reasons and any(".q_proj." in name for name in plan.quantized_params)


def test_tied_and_pinned_linear_weights_stay_as_they_are() -> None:
    model = qlora_model("llama")
    base = model.base_model.model
    base.lm_head.weight = base.model.embed_tokens.weight  # a tied head, as Gemma and small Llamas have
    config = MixedFSDPConfig(quantize_base="nf4", keep_fp32_params=[r"layers\.0\.mlp\.down_proj\.base_layer\.weight"])
    plan = plan_sharding(model, config, "bf16-true", shard_ranks=2)
    assert plan.not_quantized["base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"] == "keep-fp32"
    assert plan.not_quantized["base_model.model.lm_head.weight"] in ("output head", "tied to another param")
    assert "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight" in plan.quantized_params


def test_nf4_bytes_are_about_a_quarter_of_bf16_and_the_report_shows_them() -> None:
    plan = plan_sharding(qlora_model("llama"), NF4, "bf16-true", shard_ranks=2)
    q_proj = plan.params["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    # 65,536 weights: 32,768 bytes of data, 1,024 int8 scalers, 4 bf16 factors
    assert q_proj.nbytes == 32768 + 1024 + 4 * 2
    report = format_plan(plan)
    assert "4-bit base: 14 frozen weights in nf4" in report and "(0.258x)" in report
    assert "not quantized: base_model.model.lm_head.weight: output head" in report
    row = next(line for line in report.splitlines() if "q_proj.base_layer.weight" in line)
    assert row.split()[3:7] == ["256x256", "nf4", "bf16", "bf16"]  # name (frozen) x2, shape, storage...


def test_offload_moves_the_sharded_training_state_to_the_host_and_keeps_replicated_params_on_the_device() -> None:
    model = qlora_model("llama")
    on_device = estimate_memory(plan_sharding(model, NF4, "bf16-true", shard_ranks=2), 2, 2)
    offload = MixedFSDPConfig(quantize_base="nf4", offload="cpu")
    offloaded = estimate_memory(plan_sharding(model, offload, "bf16-true", shard_ranks=2), 2, 2)
    assert offloaded.total == on_device.total and on_device.host == 0
    plan = plan_sharding(model, offload, "bf16-true", shard_ranks=2)
    replicated = sum(
        plan.params[name].nbytes * (4 if plan.params[name].requires_grad else 1) for name in plan.replicated_params
    )
    assert offloaded.host == offloaded.total - replicated
    assert offloaded.device == replicated + offloaded.gathered


def test_plain_lora_is_planned_as_before_without_quantize_base() -> None:
    plan = plan_sharding(qlora_model("llama"), MixedFSDPConfig(), "bf16-true", shard_ranks=2)
    assert plan.quantized_params == () and plan.not_quantized == {} and "4-bit" not in format_plan(plan)


def test_each_ranks_rows_quantized_with_the_whole_weights_mean_equal_torchaos_whole_tensor_chunked() -> None:
    from torchao.quantization import to_nf4

    from lightning_mixedfsdp.model.quantized import nf4_parts, quantize_part

    rows = 4 * QLORA_DIMS["hidden_size"]
    scale = torch.linspace(0.01, 0.1, rows).unsqueeze(-1)  # each rank's rows at another scale, as layers' rows are
    weight = (torch.randn(rows, 512, generator=torch.Generator().manual_seed(0)) * scale).to(torch.bfloat16)
    whole = torch.chunk(to_nf4(weight), 4)
    for rank, rows in enumerate(torch.chunk(weight, 4)):
        ours = quantize_part(weight, rows)
        assert all(torch.equal(a, b) for a, b in zip(nf4_parts(ours), nf4_parts(whole[rank]), strict=True))
        own_mean = to_nf4(rows)  # what a rank quantizing alone gets: another scaler mean, other scalers
        assert not torch.equal(own_mean.scaler_mean, whole[rank].scaler_mean)


def test_a_weight_quantized_by_another_library_is_left_alone_with_the_reason() -> None:
    model = qlora_model("llama")
    layer = model.base_model.model.model.layers[0].mlp.up_proj.base_layer
    layer.weight = nn.Parameter(torch.zeros(layer.weight.shape, dtype=torch.uint8), requires_grad=False)
    plan = plan_sharding(model, NF4, "bf16-true", shard_ranks=2)
    reason = plan.not_quantized["base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"]
    assert reason == "stored as torch.uint8 already (quantized by another library?)"
