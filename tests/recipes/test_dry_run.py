"""The dry-run planner: public 70B-120B shapes planned on the meta device, and its per-rank prediction against what a
2-rank run of a scaled-down twin really allocates."""

import re
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from lightning_mixedfsdp.testing import run_distributed
from tests.hf_models import tiny_model
from tests.scenarios import make_fabric

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {
    "llama3_70b": (70.0e9, 71.0e9),
    "qwen3_next_80b_a3b": (79.0e9, 81.0e9),
    "gpt_oss_120b": (116.0e9, 118.0e9),
}
TWINS = ("llama", "qwen3_next", "gpt_oss")


@pytest.mark.parametrize("shape", PUBLIC)
def test_public_shapes_plan_on_meta_with_fp32_norms_and_a_memory_verdict(shape: str, capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = ROOT / "benchmarks" / "configs" / f"{shape}.json"
    out = main(["--hf-config", str(config), "--world-size", "64", "--gpu-memory", "80"])
    low, high = PUBLIC[shape]
    assert low < out["params"] < high
    plan, estimate = out["plan"], out["estimate"]
    assert plan.params["model.norm.weight"].key.storage == torch.float32
    assert plan.buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    bulk = sum(p.nbytes for p in plan.params.values()) / 64
    assert bulk < estimate.params < 1.05 * bulk  # sharded 64 ways, plus padding and the replicated norms
    printed = capsys.readouterr().out
    assert "collectives per step" in printed and "on a 80 GiB GPU: fits" in printed


def test_expert_parallel_dry_run_shows_the_expert_mesh_bytes_and_all_to_alls(capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = ROOT / "benchmarks" / "configs" / "gpt_oss_120b.json"
    out = main(["--hf-config", str(config), "--world-size", "64", "--expert-parallel", "8"])
    plan = out["plan"]
    experts = plan.experts
    assert experts.size == 8 and len(experts.modules) == 36 and set(experts.num_experts.values()) == {128}
    total, per_rank = plan.expert_bytes(expert_shard_ranks=8)
    assert per_rank == total // 64
    printed = capsys.readouterr().out
    assert "expert parallel: expert_parallel=8 x expert_data_parallel=8; 36 MoE layers" in printed
    assert "128 -> 16 per rank" in printed
    # 36 layers: forward dispatch + combine + split sizes, backward dispatch + combine
    assert "all-to-all per step (predicted): forward 108" in printed and "backward 72" in printed


def test_a_model_that_does_not_fit_says_by_how_much(capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = ROOT / "benchmarks" / "configs" / "llama3_70b.json"
    main(["--hf-config", str(config), "--world-size", "8", "--precision", "bf16-mixed", "--gpu-memory", "80"])
    assert "on a 80 GiB GPU: does not fit: short by" in capsys.readouterr().out


def test_llama3_70b_qlora_on_8_gpus_of_24_gib_fits_with_a_4_bit_base_and_more_room_with_offload(capsys: Any) -> None:
    pytest.importorskip("peft")
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = ROOT / "benchmarks" / "configs" / "llama3_70b.json"
    base = ["--hf-config", str(config), "--world-size", "8", "--gpu-memory", "24", "--lora-rank", "16"]
    runs = {
        name: main([*base, *flags])
        for name, flags in {
            "bf16 base": [],
            "nf4": ["--quantize-base", "nf4"],
            "nf4 + offload": ["--quantize-base", "nf4", "--offload", "cpu"],
        }.items()
    }
    printed = capsys.readouterr().out
    assert "4-bit base: 560 frozen weights in nf4" in printed and "(0.258x)" in printed
    assert "not quantized: base_model.model.lm_head.weight: output head" in printed
    device = {name: run["estimate"].device for name, run in runs.items()}
    assert device["nf4 + offload"] < device["nf4"] < 0.5 * device["bf16 base"]
    assert device["bf16 base"] > 23 * 2**30  # bf16: the base alone leaves no room for activations
    assert runs["nf4 + offload"]["estimate"].host > 4 * 2**30 and runs["nf4"]["estimate"].host == 0
    assert printed.count("on a 24 GiB GPU: fits") == 3 and "(offloaded)" in printed


def test_a_config_without_model_type_is_refused_with_the_fix(tmp_path: Path) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match=r"has no 'model_type'; add it \(e.g. model_type: llama\)"):
        main(["--hf-config", str(config), "--world-size", "8"])


def _allocated(rank: int, world_size: int) -> Dict[str, Any]:
    """Each twin set up on 2 ranks, one AdamW step: the bytes this rank really holds, and the planner's prediction."""
    from torch.distributed.tensor import DTensor

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.planning.memory import estimate_memory

    def local(tensor: torch.Tensor) -> int:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return tensor.numel() * tensor.element_size()

    out = {}
    for model_type in TWINS:
        fabric = make_fabric(world_size, "bf16-mixed", MixedFSDP2Strategy())
        model = fabric.setup(tiny_model(model_type))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        fabric.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        params = list(model.parameters())
        states = [t for p in params for t in optimizer.state[p].values() if torch.is_tensor(t) and t.dim() > 0]
        predicted = estimate_memory(fabric.strategy.plan_of(model), shard_ranks=world_size, data_parallel_ranks=2)
        out[model_type] = {
            "real": {
                "params": sum(local(p) for p in params),
                "grads": sum(local(p.grad) for p in params if p.grad is not None),
                "AdamW states": sum(local(t) for t in states),
            },
            "predicted": predicted.rows(),
        }
    return out


@pytest.fixture(scope="module")
def allocated() -> list:
    return run_distributed(_allocated, 2, timeout=300)


@pytest.mark.parametrize("model_type", TWINS)
def test_the_prediction_equals_what_a_two_rank_twin_allocates_on_its_busiest_rank(
    allocated: list, model_type: str
) -> None:
    predicted = allocated[0][model_type]["predicted"]
    for name in ("params", "grads", "AdamW states"):
        busiest = max(result[model_type]["real"][name] for result in allocated)
        assert busiest == predicted[name], (name, busiest, predicted[name])


def test_a_tiny_plan_prints_sizes_in_units_that_fit(capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    out = main(["--recipe", str(ROOT / "conf" / "hf_qwen3_next_tiny.yaml"), "--world-size", "2"])
    printed = capsys.readouterr().out
    assert f"{out['params'] / 1e6:.2f}M params" in printed
    assert "0.00 GiB" not in printed and "0.00B" not in printed
    total = out["estimate"].total
    assert f"total        {total / 2**20:.2f} MiB" in printed  # under 1 GiB: MiB
    assert re.search(r"mixed_fsdp2 dtype plan: \d+ params \([\d.]+ MiB\), .* \([\d.]+ KiB replicated\)", printed)


def test_context_parallelism_in_the_dry_run_splits_the_activations_and_lengthens_what_fits(capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = str(ROOT / "benchmarks" / "configs" / "llama3_8b.json")
    base = ["--hf-config", config, "--world-size", "8", "--gpu-memory", "80", "--seq-len", "131072"]
    runs = {cp: main([*base, "--context-parallel", str(cp)]) for cp in (1, 4)}
    printed = capsys.readouterr().out
    longest = {
        cp: int(re.search(r"context_parallel=\d+: (\d+) tokens", out["activations"][-1]).group(1))  # type: ignore
        for cp, out in runs.items()
    }
    assert 3.9 * longest[1] <= longest[4] <= 4 * longest[1] + 1024
    assert runs[4]["plan"].context_parallel == 4 and runs[1]["plan"].context_parallel == 1
    assert runs[4]["estimate"].device == runs[1]["estimate"].device  # the params shard over as many ranks
    assert "FSDP over 8 shard ranks (2 data-parallel x 4 context-parallel)" in printed
    assert printed.count("context parallel: every sequence split over 4 ranks") == 1


def test_a_context_parallel_size_that_does_not_divide_the_ranks_is_refused_before_planning() -> None:
    """The strategy's own size check (``ParallelDims``), in the flags' names."""
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = str(ROOT / "benchmarks" / "configs" / "llama3_8b.json")
    with pytest.raises(SystemExit) as error:
        main(["--hf-config", config, "--world-size", "8", "--context-parallel", "3"])
    assert "--context-parallel=3 must divide the world size (--world-size 8); use a divisor of it" in str(error.value)


def test_a_model_context_parallelism_refuses_is_refused_before_planning(capsys: Any) -> None:
    """The model setup's refusal at setup (a sequence mixer that is not attention), asked of the meta model."""
    from lightning_mixedfsdp.recipes.run.dry_run import main

    recipe = str(ROOT / "conf" / "hf_qwen3_next_tiny.yaml")
    with pytest.raises(SystemExit) as error:
        main(["--recipe", recipe, "--world-size", "8", "--context-parallel", "2"])
    message = str(error.value)
    assert message.startswith("python -m lightning_mixedfsdp.plan: --context-parallel=2 ")
    assert (
        "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)" in message and "dtype plan" not in capsys.readouterr().out
    )


def test_every_example_in_the_help_names_files_that_exist_from_the_project_root(
    capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shlex

    from lightning_mixedfsdp.recipes.run.dry_run import _parse, _settings

    with pytest.raises(SystemExit):
        _parse(["--help"])
    help_text = capsys.readouterr().out.replace("\\\n", " ")  # continued lines joined, as the shell does
    examples = [line.split() for line in help_text.splitlines() if "python -m lightning_mixedfsdp.plan --" in line]
    assert len(examples) == 6
    monkeypatch.chdir(ROOT)  # copied into a shell at the project's root
    for example in examples:
        args = _parse(shlex.split(" ".join(example))[3:])
        named = [path for path in (args.hf_config, args.recipe) if path is not None]
        assert named and all(Path(path).is_file() for path in named), example
        _settings(args)  # the config and the recipe load, the flags agree


def test_lora_rank_without_peft_is_one_line_with_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    config = str(ROOT / "benchmarks" / "configs" / "llama3_8b.json")
    with pytest.raises(SystemExit) as exit_:
        main(["--hf-config", config, "--world-size", "8", "--lora-rank", "16"])
    assert str(exit_.value.code) == (
        "python -m lightning_mixedfsdp.plan: --lora-rank needs peft, which is not installed:"
        " pip install 'lightning-mixedfsdp[peft]'  (or: pip install peft)"
    )


def test_llama_405b_at_fsdp8_tp8_pp8_plans_one_tp_ranks_share_of_each_stage(capsys: Any) -> None:
    """torchtitan's 405B layout on 512 GPUs: each stage's params are one TP rank's share by the model's own plan (q,
    k, v, o, gate, up, down split 8 ways, norms whole), sharded 8 ways; its activations split the key/value heads and
    the MLP's units, the hidden width whole on each TP rank."""
    from lightning_mixedfsdp.planning.memory import ActivationShape, stage_activation_bytes
    from lightning_mixedfsdp.planning.report import format_bytes, format_count
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = ROOT / "benchmarks" / "configs" / "llama3_405b.json"
    argv = ["--hf-config", str(config), "--world-size", "512", "--tensor-parallel", "8", "--pipeline", "8"]
    out = main([*argv, "--seq-len", "8192", "--batch", "8"])
    assert 405e9 < out["params"] < 406e9
    hidden, kv, units = 16384, 8 * 128, 53248
    layer = (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * units) // 8 + 2 * hidden
    stages = out["activations"]
    assert len(stages) == 9 and "each stage FSDP over 8 x TP 8 ranks" in stages[0]
    middle = stages[2]  # stage 1: blocks 15-30
    assert f"blocks 15-30, {format_count(16 * layer)} params" in middle
    shape = ActivationShape(hidden, units // 8, 126, kv // 8, 128256)
    assert f"x {format_bytes(stage_activation_bytes(shape, 16, False, 8192, 1))} =" in middle
    printed = capsys.readouterr().out
    assert "tensor parallel 8 by the model's `base_model_tp_plan`: 630 colwise" in printed
    assert "planned over the 64 ranks of its TP position" in printed


def test_a_tensor_parallel_size_the_ranks_cannot_take_is_refused_in_the_flags_names() -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = str(ROOT / "benchmarks" / "configs" / "llama3_8b.json")
    with pytest.raises(SystemExit) as error:
        main(["--hf-config", config, "--world-size", "12", "--tensor-parallel", "8"])
    assert "`--tensor-parallel=8` multiplied should equal the world size (--world-size 12)" in str(error.value)


def test_a_recipes_auto_tensor_parallel_size_asks_for_the_flag(tmp_path: Path) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    recipe = (ROOT / "conf" / "hf_qwen3_next_tiny.yaml").read_text()
    auto = recipe.replace(
        "strategy:\n  name: mixed_fsdp2\n",
        "strategy:\n  name: mixed_fsdp2\n  parallelism:\n    tensor_parallel_size: auto\n",
    )
    (tmp_path / "auto.yaml").write_text(auto)
    with pytest.raises(SystemExit) as error:
        main(["--recipe", str(tmp_path / "auto.yaml"), "--world-size", "8"])
    assert "tensor_parallel_size='auto' needs the devices of a node; pass --tensor-parallel N" in str(error.value)
