"""Distillation through the runner's own pieces, as a recipe runs it: an HF Llama teacher (its vocabulary padded past
the byte tokenizer's 256 tokens) and a smaller HF Llama student, fp32.

One launch of 2 ranks trains 4 steps with activation checkpointing (a checkpoint at step 2), resumes a second run
from that checkpoint, and takes a first step with a wider teacher in bf16 and in NF4; one process trains the same 4
steps on the whole batch, without activation checkpointing. The student's export after 4 steps equals the one process's
(1e-5), and the resumed run's equals the straight run's; the teacher's params are sharded, fp32, frozen, without
grads and without optimizer state; checkpoints and exports hold no teacher tensor. Refusals before launch run in
this process."""

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError
from lightning_mixedfsdp.testing import run_distributed
from tests.launch_together import run_together
from tests.recipes.exports import assert_the_export_states_its_dtype
from tests.recipes.second_model import TEACHER_VOCAB, equal_to_one_process, make_llama_folder

STUDENT = (
    "{model_type: llama, vocab_size: 256, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,"
    " num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, max_position_embeddings: 256}"
)
STEPS, BATCH = 4, 2


def overrides(teacher: Path, output: Path, batch: int, devices: int, steps: int = STEPS) -> List[str]:
    return [
        "trainer.accelerator=cpu", f"trainer.devices={devices}", f"trainer.max_steps={steps}",
        "trainer.val_check_interval=4", "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=2",
        "trainer.keep_checkpoints=4", "trainer.precision=32-true", f"model.hf_config={STUDENT}",
        f"teacher.pretrained={teacher}", "distill.loss=jsd", "distill.temperature=2.0", "distill.weight=0.7",
        "distill.chunk_tokens=40", "data.seq_len=32", f"data.batch_size={batch}", "data.val_windows=4",
        "data.max_bytes=60000", "optimizer.lr=0.01", "optimizer.warmup_steps=1", f"output.dir={output}",
        "output.export_dtype=fp32",
    ]  # fmt: skip


def _fit(recipe_overrides: List[str], checkpoint: Any = None) -> Dict[str, Any]:
    """``runner.run`` with a callback that reads the teacher and the optimizer at the end of training."""
    import lightning.pytorch as pl

    from lightning_mixedfsdp.recipes.run import runner

    seen: Dict[str, Any] = {}

    class ReadTheTeacher(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
            seen.setdefault("losses", []).append(outputs["loss"].item())  # this rank's micro-batch

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            seen["trained"] = [name for name, p in module.model.named_parameters() if p.requires_grad]
            optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
            teacher = dict(module.teacher.named_parameters())
            seen["teacher"] = {
                name: {
                    "placement": str(getattr(param, "placements", None)),
                    "dtype": str(param.dtype),
                    "trains": param.requires_grad,
                    "grad": param.grad is not None,
                    "optimized": id(param) in optimized or param in trainer.optimizers[0].state,
                    "local_rows": param.to_local().shape[0] if hasattr(param, "to_local") else None,
                }
                for name, param in teacher.items()
            }

        def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
            # the output projection is used by the chunked loss alone (its forward call sees an empty sequence)
            grad = module.model.lm_head.weight.grad
            seen.setdefault("head_grad_norms", []).append(grad.full_tensor().norm().item() if grad is not None else 0.0)
            # the teacher's output unit, kept gathered for the loss, is resharded once the backward has run
            seen.setdefault("teacher_head_after_backward", []).append(type(module.teacher.lm_head.weight).__name__)

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
            if index == 0 and "first_loss" not in seen:  # the loss as trained, and as its formula gives it
                with torch.no_grad():
                    seen["first_loss"] = module.training_loss(batch).logged.item()
                    student = module.model(input_ids=batch).logits[:, :-1, :256].double()
                    teacher = module.teacher(input_ids=batch).logits[:, :-1, :256].double()
                seen["first_loss_by_formula"] = _loss_by_formula(student, teacher, batch[:, 1:]).item()
                seen["units"], seen["offloaded_units"] = _units_and_offloaded(module.teacher)
                seen["nf4_weights"] = sum(type(p).__name__ == "NF4Tensor" for p in module.teacher.parameters())
                seen["nf4_weights"] += sum(
                    type(getattr(p, "_local_tensor", None)).__name__ == "NF4Tensor" for p in module.teacher.parameters()
                )

    runner.monitors = lambda recipe: [ReadTheTeacher()]  # type: ignore[assignment]  # this process's runner only
    runner.run(load_recipe(None, recipe_overrides, launching=False), checkpoint)
    return seen


def _units_and_offloaded(teacher: Any) -> Any:
    """The teacher's FSDP units, and how many of them hold their shards on the host (FSDP2's own record of each unit's
    offload policy: private, read by this test only)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    units = [module for module in teacher.modules() if isinstance(module, FSDPModule)]
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    return len(units), sum(isinstance(group.offload_policy, CPUOffloadPolicy) for group in groups if group is not None)


def _loss_by_formula(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The recipe's loss written out: 0.7 x JSD at temperature 2 (times 4) + 0.3 x cross-entropy, the mean over every
    token (the student's vocabulary is the tokenizer's here, so its cross-entropy is over the same 256 logits)."""
    p_s, p_t = torch.softmax(student / 2, -1), torch.softmax(teacher / 2, -1)
    m = (p_s + p_t) / 2
    jsd = ((p_t * (p_t / m).log()).sum(-1) + (p_s * (p_s / m).log()).sum(-1)) / 2 * 4
    cross_entropy = -torch.log_softmax(student, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (0.7 * jsd + 0.3 * cross_entropy).mean()


def _two_ranks(rank: int, world_size: int, teacher: str, wide_teacher: str, folder: str) -> Dict[str, Any]:
    straight, resumed = Path(folder) / "straight", Path(folder) / "resumed"
    checkpointed = ["strategy.activation_checkpointing=full"]  # recomputed in fp32: the one process runs without
    seen = _fit([*overrides(Path(teacher), straight, BATCH, world_size), *checkpointed])
    _fit(
        [*overrides(Path(teacher), resumed, BATCH, world_size), *checkpointed], straight / "checkpoints" / "step=2.ckpt"
    )
    # a LoRA student: adapters on its attention and MLP, the rest frozen beside the frozen teacher
    lora = overrides(Path(teacher), Path(folder) / "lora", BATCH, world_size, steps=3)
    seen["lora"] = _fit([*lora, "peft.enabled=true", "peft.target_modules=[q_proj,v_proj,down_proj]"])
    # the first step's loss, bf16-true: the teacher's Linear weights in bf16 or NF4, or its shards on the host
    for variant, setting in (
        ("none", "teacher.quantize=none"),
        ("nf4", "teacher.quantize=nf4"),
        ("cpu", "teacher.offload=cpu"),
    ):
        wide = overrides(Path(wide_teacher), Path(folder) / f"teacher_{variant}", BATCH, world_size, steps=1)
        wide += ["trainer.precision=bf16-true", setting, "trainer.val_check_interval=1"]
        result = _fit(wide)
        for key in ("first_loss", "nf4_weights", "offloaded_units", "units"):
            seen[f"{key}_{variant}"] = result[key]
    return seen


def _one_process(rank: int, world_size: int, teacher: str, folder: str) -> Dict[str, Any]:
    return _fit(overrides(Path(teacher), Path(folder) / "one_process", BATCH * 2, 1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("distillation")
    teacher = make_llama_folder(folder / "teacher")
    wide_teacher = make_llama_folder(folder / "wide_teacher", hidden=256)  # its Linear shards fill NF4's blocks
    launched = run_together({  # side by side: each its own folder
        "ranks": lambda: run_distributed(_two_ranks, 2, str(teacher), str(wide_teacher), str(folder), timeout=600),
        "one": lambda: run_distributed(_one_process, 1, str(teacher), str(folder), timeout=600)[0],
    })  # fmt: skip
    return {"folder": folder, "teacher": teacher, **launched}


def _export(folder: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(folder / "export" / "model.safetensors"))


def test_the_students_weights_after_four_steps_equal_one_process_on_the_whole_batch(runs: Dict[str, Any]) -> None:
    assert len(_export(runs["folder"] / "straight")) == 21  # the student's tensors, every one
    equal_to_one_process(runs, "straight", STEPS, _export)


def test_the_trained_loss_is_its_formula_on_the_whole_logits(runs: Dict[str, Any]) -> None:
    one = runs["one"]
    assert one["first_loss"] == pytest.approx(one["first_loss_by_formula"], rel=1e-5)
    for rank in runs["ranks"]:  # each rank's own micro-batch
        assert rank["first_loss"] == pytest.approx(rank["first_loss_by_formula"], rel=1e-5)


def test_the_output_projection_learns_from_the_chunked_loss(runs: Dict[str, Any]) -> None:
    for run in [runs["one"], *runs["ranks"]]:
        assert len(run["head_grad_norms"]) == STEPS and min(run["head_grad_norms"]) > 0


def test_an_nf4_teacher_gives_the_first_loss_within_2_percent_of_the_bf16_teacher(runs: Dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        assert rank["first_loss_nf4"] == pytest.approx(rank["first_loss_none"], rel=0.02)
        assert rank["nf4_weights_none"] == 0 and rank["nf4_weights_nf4"] == 14  # q, k, v, o, gate, up, down x 2
        assert rank["first_loss_nf4"] != rank["first_loss_none"]  # the 4-bit weights did change the teacher


def test_an_offloaded_teacher_keeps_every_unit_on_the_host_and_gives_the_same_first_loss(runs: Dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        assert rank["units_cpu"] == 3 and rank["offloaded_units_cpu"] == 3  # the root and its 2 layers
        assert rank["offloaded_units_none"] == 0
        # on a CPU the host is the device: the same bytes, the same loss (on a GPU: copied in for each forward)
        assert rank["first_loss_cpu"] == pytest.approx(rank["first_loss_none"], rel=1e-6)


def test_a_resumed_run_repeats_the_straight_runs_steps(runs: Dict[str, Any]) -> None:
    straight, resumed = _export(runs["folder"] / "straight"), _export(runs["folder"] / "resumed")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_teacher_is_sharded_frozen_and_outside_the_optimizer(runs: Dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        teacher = rank["teacher"]
        assert teacher and all(p["dtype"] == "torch.float32" for p in teacher.values())
        assert not any(p["trains"] or p["grad"] or p["optimized"] for p in teacher.values())
        embedding = teacher["model.embed_tokens.weight"]
        assert embedding["placement"] == "(Shard(dim=0),)" and embedding["local_rows"] == TEACHER_VOCAB // 2
        # the loss reads the teacher's gathered output weight (no copy) until its backward, then it is resharded
        assert rank["teacher_head_after_backward"] == ["DTensor"] * STEPS


def test_a_lora_student_trains_its_adapters_alone_on_the_losss_formula(runs: Dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        lora = rank["lora"]
        # the trained loss is its formula's on the whole logits of the LoRA student (its base built from config)
        assert lora["first_loss"] == pytest.approx(lora["first_loss_by_formula"], rel=1e-6)
        assert lora["trained"] and all(".lora_" in name for name in lora["trained"])
        assert lora["teacher_head_after_backward"] == ["DTensor"] * 3
        assert lora["losses"][-1] != pytest.approx(lora["losses"][0], rel=1e-3)
    assert (runs["folder"] / "lora" / "adapter").is_dir()


def test_checkpoints_and_exports_hold_the_student_alone(runs: Dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    straight = runs["folder"] / "straight"
    saved = list(FileSystemReader(str(straight / "checkpoints" / "last.ckpt")).read_metadata().state_dict_metadata)
    assert any(key.startswith("state_dict.model.") for key in saved)  # the student, under its attribute
    assert not any("teacher" in key for key in saved)
    export = _export(straight)
    assert export["model.embed_tokens.weight"].shape == (256, 32)  # the student's, not the teacher's (272, 64)
    assert json.loads((straight / "export" / "config.json").read_text())["hidden_size"] == 32
    assert_the_export_states_its_dtype(straight / "export", torch.float32)  # output.export_dtype=fp32


def test_the_csv_log_holds_both_losses_and_both_perplexities(runs: Dict[str, Any]) -> None:
    from lightning_mixedfsdp.recipes.run.plot import read_metrics

    metrics = read_metrics(runs["folder"] / "straight" / "logs")
    assert len(metrics["train_kd_loss"]) == STEPS and len(metrics["train_ce_loss"]) == STEPS
    assert all(value > 0 for value in metrics["train_kd_loss"].values())
    assert set(metrics["teacher_ppl"]) == {0} and "val_ppl" in metrics


def test_the_dry_run_plans_the_teacher_beside_the_student(teacher: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    main(["--dry-run", *overrides(teacher, teacher.parent / "out", BATCH, 2)])
    out = capsys.readouterr().out
    student, teacher_plan = out.split("== teacher")
    assert student.startswith("== model") and "AdamW states" in student
    assert "reduce_scatter 0" in teacher_plan and "grads        0 B" in teacher_plan
    assert "AdamW states 0 B" in teacher_plan and "host memory  0 B" in teacher_plan

    main(["--dry-run", *overrides(teacher, teacher.parent / "out", BATCH, 2), "teacher.offload=cpu"])
    student, teacher_plan = capsys.readouterr().out.split("== teacher")
    assert "offload_frozen cpu: the units with no trainable param keep their shards in host memory" in teacher_plan
    assert "host memory  0 B" in student and "host memory  0 B" not in teacher_plan


# -- refusals before launch, each with its fix


def _refusal(teacher: Path, *extra: str) -> str:
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [*overrides(teacher, teacher.parent / "out", BATCH, 2), *extra], launching=False)
    return str(error.value)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_folder(tmp_path_factory.mktemp("refusals") / "teacher")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_sizes(teacher: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = teacher.parent / "word_teacher"
    other.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other / name).write_bytes((teacher / name).read_bytes())
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(other)
    message = _refusal(other)
    assert f"teacher.pretrained={str(other)!r} tokenizes differently from data.tokenizer='bytes'" in message
    assert "(the teacher's 300 tokens, the data's 256)" in message


def test_bad_distillation_settings_are_refused_all_at_once(teacher: Path) -> None:
    message = _refusal(
        teacher, "distill.loss=kl", "distill.temperature=0", "distill.weight=1.5", "distill.chunk_tokens=0",
        "teacher.quantize=int8", "teacher.offload=disk",
    )  # fmt: skip
    assert "teacher.quantize='int8': use one of none, nf4" in message
    assert "teacher.offload='disk': use one of none, cpu" in message
    assert "distill.loss='kl': use one of forward_kl, reverse_kl, jsd" in message
    assert "distill.temperature=0.0 must be > 0" in message
    assert "distill.weight=1.5 must be in [0, 1]" in message
    assert "distill.chunk_tokens=0 must be >= 1" in message


def test_compositions_not_yet_tested_are_refused_with_the_reason(teacher: Path) -> None:
    message = _refusal(teacher, "strategy.parallelism.context_parallel_size=2")
    assert "distillation with strategy.parallelism.context_parallel_size=2 is not supported yet" in message
    fault_tolerant = _refusal(
        teacher, "strategy.fault_tolerance.num_replica_groups=2", "strategy.fault_tolerance.replica_id=0"
    )
    assert "distillation with strategy.fault_tolerance is not supported yet" in fault_tolerant


def test_distillation_named_without_a_teacher_and_a_teacher_under_another_objective_are_refused(
    teacher: Path,
) -> None:
    base = [o for o in overrides(teacher, teacher.parent / "out", BATCH, 2) if not o.startswith("teacher.")]
    with pytest.raises(RecipeError, match="objective='distillation' needs a teacher: set teacher.pretrained"):
        load_recipe(None, [*base, "objective=distillation"], launching=False)
    assert "teacher.pretrained asks for objective 'distillation', and objective='language_modeling'" in _refusal(
        teacher, "objective=language_modeling"
    )


def test_a_teacher_folder_without_a_config_is_refused(teacher: Path) -> None:
    empty = teacher.parent / "empty"
    empty.mkdir()
    assert f"teacher.pretrained={str(empty)!r} is not a directory holding a config.json; point it at" in _refusal(empty)
