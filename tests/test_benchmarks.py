"""Each benchmark script runs end to end at tiny sizes, so none can rot. Timings are printed, never asserted."""

import json
from pathlib import Path

import pytest

from benchmarks import collectives_and_speed, numerics, setup_cost
from lightning_mixedfsdp.testing import run_distributed


def _rank_zero_stdout(rank: int, world_size: int, benchmark: str, argv: list, config: dict) -> str:
    """A benchmark that launches Fabric on 2 processes, run on 2 ranks forked from the fork server (Fabric finds them
    launched, as under torchrun) at the tiny ``config``: what it printed (rank 0 prints the tables)."""
    import contextlib
    import importlib
    import io

    from benchmarks import meta_memory

    meta_memory.CONFIG.update(config)  # in this rank only
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        importlib.import_module(f"benchmarks.{benchmark}").main(argv)
    return printed.getvalue()


def test_collectives_and_speed_runs_and_replication_adds_one_all_reduce_and_no_all_gather(capsys) -> None:
    argv = ["--layers", "2", "--dim", "32", "--steps", "2", "--warmup", "1", "--configs", "ae", "--device", "cpu"]
    results = collectives_and_speed.main(argv)
    uniform, mixed = results["L2/a"]["calls"], results["L2/e"]["calls"]
    assert mixed["all_gather"] == uniform["all_gather"]
    assert mixed["reduce_scatter"] == uniform["reduce_scatter"]
    assert mixed.get("all_reduce", 0) - uniform.get("all_reduce", 0) == 1
    assert results["L2/e"]["bytes"]["reduce_scatter"] > 0
    assert "| 2 | (e) mixed_fsdp2" in capsys.readouterr().out


def test_setup_cost_times_the_whole_plan_being_applied(capsys) -> None:
    result = setup_cost.main(["--layers", "6", "--repeats", "1", "--device", "cpu"])
    # the timed set-up made exactly the planned FSDP groups and replicated params
    assert result["fsdp_groups"] == result["planned_sharded_groups"] and result["fsdp_groups"] > 6
    assert result["replicated_params"] == result["planned_replicated_params"] > 0
    assert "plan_sharding (one process)" in capsys.readouterr().out


def test_numerics_runs_and_keeps_norms_fp32_only_in_the_mixed_run(tmp_path: Path, capsys) -> None:
    argv = ["--steps", "4", "--dim", "32", "--layers", "2", "--seq", "32", "--batch", "2", "--device", "cpu"]
    argv += ["--runs", "naive_bf16", "mixed_bf16_true", "--no-plot", "--out", str(tmp_path)]
    results = numerics.main(argv)
    assert results["naive_bf16"]["dtypes"]["norm.weight"] == "torch.bfloat16"
    assert results["mixed_bf16_true"]["dtypes"]["norm.weight"] == "torch.float32"
    assert results["mixed_bf16_true"]["dtypes"]["layers.1.attention.A_log"] == "torch.float32"
    assert len(results["mixed_bf16_true"]["losses"]) == 4
    assert json.loads((tmp_path / "numerics.json").read_text()).keys() == results.keys()
    assert "| naive all-bf16 |" in capsys.readouterr().out


def test_buffer_numerics_runs_and_only_the_bf16_inv_freq_run_drifts(capsys) -> None:
    from benchmarks import buffer_numerics

    argv = ["--positions", "256", "--init-ranges", "0.1", "--tokens", "64", "--zero-mean-stds", "1.0"]
    results = buffer_numerics.main(argv)
    study = results["rope"]["0.1"]
    assert set(study["inv_freq_dtypes"].values()) == {"torch.float32", "torch.bfloat16"}
    kl = study["kl"]
    assert kl["bf16-true with every buffer cast (inv_freq bf16)"][0] > kl["mixed_fsdp2 bf16-true (inv_freq fp32)"][0]
    glm = results["router"]["cases"]["uniform in [6.817, 7.063] (GLM-5.2)"]
    assert glm["distinct_values_bf16"] < glm["distinct_values_fp32"] and glm["bf16_unmoved_after_100_updates"] == 1.0
    assert "(b) Router" in capsys.readouterr().out


def test_composition_runs_every_mode_and_lora_pinning_halves_the_base(capsys) -> None:
    from benchmarks import composition

    argv = ["--layers", "2", "--dim", "32", "--steps", "1", "--warmup", "1", "--modes", "plain", "ac"]
    results = composition.main(argv)
    modes = results["modes"]
    assert modes["ac"]["mixed_fsdp2"]["saved_mib"] < modes["plain"]["mixed_fsdp2"]["saved_mib"]
    lora = results["lora"]
    pinned, fp32 = lora["base pinned to bf16 (default)"], lora["base kept in fp32"]
    assert pinned["params_mib"] < 0.6 * fp32["params_mib"]
    assert "| ac |" in capsys.readouterr().out


def test_clip_benchmark_times_clips_that_agree_with_torchs_norm(capsys) -> None:
    from benchmarks import clip

    result = clip.main(["--layers", "4", "--repeats", "2", "--device", "cpu"])
    norms = result["norms"]
    assert len(result["ms"]) == 3
    # ours computes torch's norm on the same uniform model (fp32 sums of bf16 grads), and a finite one when mixed
    torch_norm = norms["torch clip_grad_norm_, uniform bf16 FSDP2"]
    assert abs(norms["ours, uniform bf16 FSDP2"] - torch_norm) <= 1e-2 * torch_norm
    assert 0 < norms["ours, mixed_fsdp2 (Shard+Replicate, bf16+fp32)"] < float("inf")
    assert "| torch clip_grad_norm_, uniform bf16 FSDP2 |" in capsys.readouterr().out


def test_hf_fsdp_peer_runs_and_only_mixed_fsdp2_keeps_norms_fp32_in_bf16(capsys) -> None:
    from benchmarks import hf_fsdp_peer

    results = hf_fsdp_peer.main(["--layers", "2", "--hidden", "64", "--steps", "1", "--warmup", "1"])
    assert results["transformers FSDP2, bf16 load"]["fp32"] == []
    assert "model.norm.weight" in results["mixed_fsdp2, bf16-true"]["fp32"]
    assert "| mixed_fsdp2, bf16-true |" in capsys.readouterr().out


def test_meta_memory_benchmark_measures_one_launch(tmp_path, monkeypatch) -> None:
    from benchmarks import meta_memory

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    for key, value in tiny.items():
        monkeypatch.setitem(meta_memory.CONFIG, key, value)
    meta_memory.save_copy(str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file()
    printed = run_distributed(_rank_zero_stdout, 2, "meta_memory", ["--load", str(tmp_path), "--scenario", "load"],
                              tiny, timeout=300)  # fmt: skip
    assert "| load_full_weights of the saved copy |" in printed[0]


def test_planner_scale_runs_on_a_public_shape(capsys) -> None:
    from benchmarks import planner_scale

    results = planner_scale.main(["--shapes", "gpt_oss_120b", "--world-sizes", "8", "--device", "cpu"])
    assert 116e9 < results["plans"]["gpt_oss_120b"]["params"] < 118e9
    assert results["setup_s"]["gpt_oss_120b"] > 0
    assert "| gpt_oss_120b |" in capsys.readouterr().out


def test_buffer_sync_runs_and_only_unsynced_biases_differ_between_ranks(capsys) -> None:
    from benchmarks import buffer_sync

    results = buffer_sync.main(["--layers", "2", "--hidden", "64", "--steps", "2", "--warmup", "1", "--device", "cpu"])
    assert results["none"]["bias_spread"] > 0
    assert results["broadcast"]["bias_spread"] == 0 and results["average"]["bias_spread"] == 0
    none, broadcast, average = (results[mode]["collectives"] for mode in ("none", "broadcast", "average"))
    assert broadcast.get("broadcast", 0) - none.get("broadcast", 0) == 1
    assert average.get("all_reduce", 0) - none.get("all_reduce", 0) == 1
    assert "| average | 0 | 1 all_reduce |" in capsys.readouterr().out


def test_expert_parallel_benchmark_runs_and_e2_halves_the_gathered_experts(tmp_path: Path, capsys) -> None:
    from benchmarks import expert_parallel

    out = tmp_path / "expert_parallel.json"
    argv = ["--world-size", "2", "--sizes", "1", "2", "--hidden", "32", "--experts", "4", "--steps", "1"]
    results = expert_parallel.main(argv + ["--warmup", "1", "--out", str(out)])
    e1, e2 = results["1"], results["2"]
    assert (e1["experts_per_rank"], e2["experts_per_rank"]) == (4, 2)
    assert e1["all_to_alls_per_step"] == 0 and e2["all_to_alls_per_step"] == 2 * (3 + 2)  # 2 layers
    assert e2["unsharded_experts_per_layer_mib"] == e1["unsharded_experts_per_layer_mib"] / 2
    assert e2["all_gather_mib_per_step"] < e1["all_gather_mib_per_step"]
    assert json.loads(out.read_text())["results"].keys() == results.keys()
    assert "| 2 | 2 |" in capsys.readouterr().out


def test_expert_kernels_benchmark_runs_hfs_experts_with_fewer_local_experts(capsys) -> None:
    from benchmarks import expert_kernels

    argv = ["--device", "cpu", "--hidden", "32", "--intermediate", "16", "--experts", "4", "--top-k", "2"]
    results = expert_kernels.main(argv + ["--tokens", "16", "--steps", "1", "--warmup", "1", "--sizes", "1", "2"])
    assert (results["1"]["experts"], results["2"]["experts"]) == (4, 2)
    assert results["2"]["params_mib"] == results["1"]["params_mib"] / 2
    assert "| 2 | 2 |" in capsys.readouterr().out


def test_io_benchmark_measures_both_load_and_both_export_paths(tmp_path, monkeypatch) -> None:
    import torch

    from benchmarks import io_per_rank, meta_memory
    from lightning_mixedfsdp.checkpoint import read_state_dict

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    with monkeypatch.context() as patched:
        for key, value in tiny.items():
            patched.setitem(meta_memory.CONFIG, key, value)
        io_per_rank.main(["--save", str(tmp_path / "copy"), "--shard-size", "20KB"])
    assert len(list((tmp_path / "copy").glob("*.safetensors"))) > 1
    printed = run_distributed(
        _rank_zero_stdout, 2, "io_per_rank", ["--load", str(tmp_path / "copy"), "--repeats", "1"], tiny, timeout=300
    )[0]
    assert "| load | rank_zero | 0 |" in printed and "| load | own_parts | 1 |" in printed
    assert "| export | gathered | 0 |" in printed and "| export | streamed | 1 |" in printed
    assert "| export | streamed_16MiB | 0 |" in printed
    # every export path wrote the same tensors
    gathered, *streamed = (read_state_dict(tmp_path / f"copy-export-{kind}") for kind in io_per_rank.EXPORTS)
    for other in streamed:
        assert gathered.keys() == other.keys() and all(torch.equal(gathered[n], other[n]) for n in gathered)
    assert meta_memory.CONFIG["hidden_size"] == 1024  # the tiny config stayed in the test and its ranks


def test_qlora_benchmark_measures_the_three_setups_and_a_4_bit_base_is_about_a_quarter() -> None:
    pytest.importorskip("torchao")
    tiny = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    tiny["num_key_value_heads"] = 4
    argv = ["--steps", "1", "--repeats", "1", "--seq", "16"]
    printed = run_distributed(_rank_zero_stdout, 2, "qlora_memory", argv, tiny, timeout=300)[0]
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| ")}
    assert {"bf16 base", "nf4", "nf4 + offload"} <= set(rows)
    assert "nf4 against bf16 base: base 0.258x" in printed


def test_gpu_llama_float8_table_runs_every_set_up_on_the_cpu_emulated(tmp_path) -> None:
    pytest.importorskip("torchao")
    from benchmarks import gpu_llama

    out = tmp_path / "gpu_llama.json"
    argv = ["--float8", "--tiny", "--device", "cpu", "--modes", "eager", "--steps", "1", "--warmup", "1"]
    results = gpu_llama.main([*argv, "--out", str(out)])
    rows = results["eager/float8"]
    assert set(rows) == {"A", "A8", "B", "B8", "B8r"} and all("step_ms" in row for row in rows.values()), rows
    assert (tmp_path / "gpu_llama_float8.json").exists()


def test_fault_tolerance_benchmark_times_both_launches(capsys) -> None:
    # the kill and heal half runs the orchestration tests/fault_tolerance/test_kill_and_heal.py proves; left out here
    # for CI's time
    pytest.importorskip("torchft")
    from benchmarks import fault_tolerance

    # 6 steps: a group that joins late heals to the other's step and records only the iterations left, and the
    # timing needs one after the warm-up (with 3 steps, group 0 once recorded none on a loaded machine)
    argv = ["--hidden", "32", "--layers", "2", "--seq", "16", "--steps", "6", "--warmup", "1", "--pairs", "1"]
    results = fault_tolerance.main([*argv, "--no-kill"])
    pair = results["pairs"][0]
    assert pair["hsdp_s"] > 0 and pair["ft_s"] > 0 and results["median_ratio"] == pair["ratio"]
    assert "| 1 | " in capsys.readouterr().out


def test_context_parallel_benchmark_measures_both_settings_at_each_length(capsys) -> None:
    from benchmarks import context_parallel

    results = context_parallel.main(["--lengths", "64", "128", "--budget-mib", "64"])
    assert set(results["growth"]) == {(1, 64), (2, 64), (1, 128), (2, 128)}
    assert set(results["longest"]) == {1, 2} and all(tokens > 0 for tokens in results["longest"].values())
    out = capsys.readouterr().out
    assert "| 128 |" in out and "CP 2:" in out


def test_sft_packing_benchmark_packs_fewer_rows_with_less_padding(capsys) -> None:
    from benchmarks import sft_packing

    results = sft_packing.main(["--steps", "2", "--seq-len", "256", "--batch", "1"])
    packed, padded = results["packed"], results["padded"]
    assert packed["rows"] < padded["rows"] and packed["padding"] < padded["padding"]
    assert packed["trained_per_row"] > padded["trained_per_row"]
    assert "| packed |" in capsys.readouterr().out


def test_precision_monitor_benchmark_times_measured_and_plain_steps(capsys) -> None:
    from benchmarks import precision_monitor

    result = precision_monitor.main(["--steps", "4", "--dim", "32", "--seq", "16", "--batch", "2"])
    assert result["measured_s"] > 0 and result["plain_s"] > 0
    assert result["spread"] == result["extra_s"] / (50 * result["plain_s"])
    assert "| measured by the monitor |" in capsys.readouterr().out


def test_ring_routing_times_a_step_with_and_without_the_mode(capsys) -> None:
    from benchmarks import ring_routing

    results = ring_routing.main(["--lengths", "32", "--repeats", "1"])
    assert set(results[32]) == {"without", "with", "ratio"} and results[32]["with"] > 0
    assert "| 32 |" in capsys.readouterr().out


def test_distill_memory_counts_the_teachers_bytes_and_the_losss_peak_and_times_both_steps(capsys) -> None:
    pytest.importorskip("torchao")
    from benchmarks import distill_memory

    argv = ["--size", "tiny", "--seq", "32", "--steps", "1", "--loss-tokens", "512", "--loss-vocab", "8192"]
    argv += ["--loss-hidden", "32", "--chunk-tokens", "32", "--timed", *distill_memory.TEACHERS]
    results = distill_memory.main(argv)
    teachers = results["teachers"]
    rest = {name: sum(row["stored"].values()) for name, row in teachers.items()}
    # bytes counted tensor by tensor, not measured noise: 4 bits < bf16 shards < a whole copy on each rank
    assert rest["nf4, sharded"] < rest["bf16, sharded"] < rest["bf16, replicated"]
    assert rest["bf16, replicated"] == teachers["bf16, replicated"]["storage"]
    assert rest["bf16, sharded"] == pytest.approx(teachers["bf16, sharded"]["storage"] / 2, rel=0.02)
    assert teachers["bf16, replicated"]["unit"] == teachers["bf16, replicated"]["gathered_at_once"] == 0
    for name in ("bf16, sharded", "nf4, sharded"):
        row = teachers[name]
        assert 0 < row["unit"] <= row["gathered_at_once"] and sum(row["peak"].values()) > rest[name]
        # after its forward: the shards, and its root unit (embedding and output head, bf16) kept gathered for the
        # loss, which reads the output weight there without a copy
        config = distill_memory.llama("tiny", "teacher")
        assert row["head_copy"] == 0
        assert row["after_call"] == rest[name] + 2 * config.vocab_size * config.hidden_size * 2
    assert set(results["ratios"]) == set(distill_memory.TEACHERS)
    assert set(results["step_s"]) == {distill_memory.PLAIN, *distill_memory.TEACHERS}
    assert all(seconds > 0 for seconds in results["step_s"].values())
    loss = results["loss"]
    assert set(loss) == set(distill_memory.ALLOCATORS) and all(set(rows) == {"whole", "32"} for rows in loss.values())
    for rows in loss.values():  # the chunks compute the whole logits' loss
        assert rows["32"]["loss"] == pytest.approx(rows["whole"]["loss"], rel=1e-4)
    # with freed tensors leaving RSS, 16 chunks of 32 tokens hold far less than the whole [512, 8192] logits
    assert loss["mmap"]["32"]["growth"] < loss["mmap"]["whole"]["growth"] / 2
    out = capsys.readouterr().out
    assert "| nf4, sharded |" in out and "| distillation, teacher bf16, sharded |" in out
    assert "| mmap | whole [tokens, vocab] logits |" in out


def test_preference_memory_counts_each_references_bytes_and_times_its_step() -> None:
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    from benchmarks import preference_memory

    results = preference_memory.main(["--size", "tiny", "--seq", "16", "--steps", "1"])
    held = {setup: sum(row["reference"].values()) for setup, row in results["bytes"].items()}
    state = {setup: sum(row["policy"].values()) for setup, row in results["bytes"].items()}
    # bytes counted tensor by tensor: 4 bits < the bf16 copy; the scores of every pair; adapters off hold nothing
    assert 0 < held["copy, nf4"] < held["copy, bf16"] == held["copy, offloaded"]
    assert held["precomputed"] == held["LoRA, precomputed"] == preference_memory.DATA_PAIRS * 2 * 4
    assert held["LoRA, adapters_off"] == 0
    assert state["LoRA, adapters_off"] == state["LoRA, precomputed"] < state["precomputed"] == state["copy, bf16"]
    assert set(results["step_s"]) == set(preference_memory.SETUPS)
    assert all(seconds > 0 for seconds in results["step_s"].values())


def test_bf16_updates_counts_each_methods_bytes_and_times_and_evaluates_it() -> None:
    from benchmarks import bf16_updates

    results = bf16_updates.main(["--steps", "2", "--dim", "32", "--seq", "16", "--batch", "2"])
    assert set(results) == set(bf16_updates.SETUPS)
    per_bulk = {name: row["bytes"].get("bf16 bulk") for name, row in results.items()}
    # counted tensor by tensor: bf16 param + AdamW's states (+ the buffer); fp32 masters have no bf16 bulk
    assert per_bulk == {
        "fp32 masters (bf16-mixed)": None, "bf16, nearest": 6.0, "bf16, stochastic": 8.0, "bf16, kahan": 10.0,
    }  # fmt: skip
    assert results["fp32 masters (bf16-mixed)"]["bytes"]["all"] == 12.0
    assert all(row["step_s"] > 0 and row["held_out_loss"] > 0 for row in results.values())


def test_semi_sync_runs_and_diloco_moves_a_fraction_of_every_step_syncs_bytes(capsys) -> None:
    from benchmarks import semi_sync

    argv = ["--steps", "4", "--dim", "32", "--seq", "16", "--batch", "2", "--setups", "every_step", "diloco_5"]
    results = semi_sync.main(argv)
    # fp32 pseudo-gradients every 5 steps against bf16 gradients every step: about 2/5 of the bytes
    assert 0.35 < results["diloco_5"]["bytes"] / results["every_step"]["bytes"] < 0.45
    assert "| diloco_5 |" in capsys.readouterr().out


def test_muon_benchmark_compares_both_optimizers_and_both_exchanges(capsys) -> None:
    from benchmarks import muon

    results = muon.main(["--steps", "4", "--dim", "32", "--seq", "16", "--batch", "2"])
    assert set(results["curves"]) == {"AdamW", "Muon + AdamW"}
    assert all(list(curve) == [4] for curve in results["curves"].values())
    assert results["step_s"]["owner-based"] > 0 and results["step_s"]["naive"] > 0
    # each matrix orthogonalised once across the 2 ranks, not on both: half the FLOPs summed over ranks, or less
    assert results["flops"]["owner-based"] < results["flops"]["naive"]
    assert results["bytes"]["owner-based"] < results["bytes"]["naive"] * 2
    out = capsys.readouterr().out
    assert "| owner-based |" in out and "| naive |" in out and "reaches AdamW's 4-step perplexity" in out


def test_rl_benchmark_splits_a_step_for_both_generation_modes_and_measures_both_heads(capsys) -> None:
    from benchmarks import rl

    results = rl.main(["--dim", "32", "--layers", "2", "--steps", "2", "--prompts", "2", "--group", "2", "--new", "4",
                       "--peaked-steps", "2", "--bucket-mb", "0.01"])  # fmt: skip
    assert set(results["phases"]) == {"gathered", "sharded"}
    assert all(value > 0 for phases in results["phases"].values() for value in phases.values())
    assert all(results["tokens_per_s"][mode] > 0 for mode in ("gathered", "sharded"))
    # gathered holds every unit unsharded while decoding; sharded its shards and one unit at a time
    assert results["bytes"]["gathered"] > results["bytes"]["sharded"]
    assert set(results["mismatch"]) == {"bf16", "fp32"}
    out = capsys.readouterr().out
    assert "| gathered |" in out and "| sharded |" in out and "log-prob mismatch" in out
    sync = results["sync"][0.01]  # rank 0 receives the weights, rank 1 holds a region at a time
    assert sync[0]["bytes"] > 0 and sync[0]["peak"] > sync[1]["peak"] > 0 and "| 0.01 MiB |" in out


def test_pipeline_benchmark_measures_each_schedule_and_counts_resharding(capsys) -> None:
    from benchmarks import pipeline

    flags = ["--steps", "1", "--microbatches", "4", "--batch", "8", "--seq", "16", "--hidden", "64", "--layers", "4"]
    results = pipeline.main(flags)
    assert set(results["table"]) == {"GPipe m=4", "1F1B m=4", "Interleaved1F1B m=4"}
    assert all(0 <= row["bubble"] < 1 for row in results["table"].values())
    resharding = results["resharding"]
    assert resharding[True]["all_gathers"] > resharding[False]["all_gathers"] > 0
    assert pipeline.simulated_bubble("GPipe", 4, 4, 1.0, 2.0) == pytest.approx(pipeline.formula("GPipe", 4, 4, 1))
    assert "FSDP alone on the same 2 ranks" in capsys.readouterr().out


def test_layout_bytes_files_each_layouts_traffic_under_its_mesh_dims(capsys) -> None:
    """Bytes, not time: FSDP over both nodes sends everything between them, HSDP its replicate all-reduce, a pipeline
    only its stage boundary; TP's all-reduces stay inside a node; PP x CP is refused with its reason."""
    from benchmarks import layout_bytes

    table = layout_bytes.main(["--hidden", "32", "--layers", "2", "--batch", "4", "--seq", "16"])
    fsdp, hsdp, pp, pp_tp = (table[name] for name in ("FSDP 4", "HSDP 2 x 2", "PP 2 x FSDP 2", "PP 2 x TP 2"))
    assert set(fsdp["by_dim"]) == {"data_parallel"} and fsdp["between_nodes"] == fsdp["total"]
    assert hsdp["by_dim"]["data_parallel_replicate"] <= hsdp["between_nodes"] < fsdp["between_nodes"]
    assert pp["between_nodes"] == pp["by_dim"]["pipeline"] < hsdp["between_nodes"]
    assert pp_tp["between_nodes"] == pp_tp["by_dim"]["pipeline"] and pp_tp["by_dim"]["tensor_parallel"] > 0
    assert "context_parallel_size=2 is not supported yet" in table["PP 2 x CP 2"]["refused"]
    assert "between nodes" in capsys.readouterr().out
