"""Preference tuning through the runner's own pieces: masks of text and conversational pairs, the DPO and IPO losses
against their formulas, and one launch of 2 ranks (3 steps with activation checkpointing, a checkpoint at step 2, a
resumed run; the precomputed and adapters-off references) against one process on the whole batch without
checkpointing, fp32, an HF Llama policy and its frozen copy as the reference. Refusals run in this process."""

import json
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.data.chat import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.preference import preference_pair
from lightning_mixedfsdp.recipes.data.sft import ExampleMaker
from lightning_mixedfsdp.recipes.data.text import ByteTokenizer
from lightning_mixedfsdp.recipes.objectives.preference import preference_scores
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import DataSection, RecipeError
from lightning_mixedfsdp.testing import run_distributed
from tests.launch_together import run_together
from tests.recipes.exports import assert_the_export_states_its_dtype
from tests.recipes.second_model import equal_to_one_process, make_llama_folder

STEPS, BATCH = 3, 2


def _maker() -> ExampleMaker:
    return ExampleMaker(DataSection(format="preference"), "preference", ByteTokenizer())


def _trained_text(example: Any) -> str:
    return bytes(i for i, label in zip(example.ids, example.labels, strict=True) if label != IGNORE_INDEX).decode()


def test_a_text_pair_trains_each_answer_and_its_end_marker_and_not_the_prompt() -> None:
    pair = preference_pair({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, _maker())
    assert bytes(pair.chosen.ids).decode() == "Q: 2+2?\nA: 4<|end|>"  # the byte tokenizer's end marker
    assert _trained_text(pair.chosen) == " 4<|end|>" and _trained_text(pair.rejected) == " 5<|end|>"


def test_a_conversational_pair_trains_the_last_assistant_turn_only() -> None:
    record = {
        "prompt": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2+2?"},
        ],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    pair = preference_pair(record, _maker())
    assert _trained_text(pair.chosen) == "4<|end|>" and _trained_text(pair.rejected) == "5<|end|>"
    assert bytes(pair.chosen.ids).decode().startswith("<|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n")


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_the_losses_are_their_formulas(kind: str) -> None:
    torch.manual_seed(0)
    pc, pr, rc, rr = (torch.randn(5, dtype=torch.float64) * 10 for _ in range(4))
    nc, nr = torch.tensor([3, 4, 5, 6, 7]), torch.tensor([2, 9, 5, 1, 4])
    got = preference_scores((pc, pr), (rc, rr), (nc, nr), kind, 0.3, 0.5)
    if kind == "sigmoid":
        expected = [-math.log(1 / (1 + math.exp(-0.3 * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()))) for i in range(5)]
    else:
        expected = [
            ((pc[i] / nc[i] - rc[i] / nc[i]) - (pr[i] / nr[i] - rr[i] / nr[i]) - 1 / 0.6).item() ** 2 for i in range(5)
        ]
    expected = [e + 0.5 * -(pc[i] / nc[i]).item() for i, e in enumerate(expected)]  # the SFT term on the chosen
    torch.testing.assert_close(got.loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def _pairs_file(folder: Path) -> Path:
    lines = [
        {"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"}
        for i in range(60)
    ]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def overrides(policy: Path, pairs: Path, output: Path, batch: int, devices: int) -> List[str]:
    return [
        "trainer.accelerator=cpu", f"trainer.devices={devices}", f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=3", "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=2",
        "trainer.keep_checkpoints=4", "trainer.precision=32-true", f"model.pretrained={policy}",
        f"data.files={pairs}", "data.seq_len=48", f"data.batch_size={batch}", "data.val_windows=4",
        "preference.beta=0.5", "preference.sft_weight=0.2", "optimizer.lr=0.01", "optimizer.warmup_steps=1",
        f"output.dir={output}", "output.export_dtype=fp32",
    ]  # fmt: skip


def _fit(recipe_overrides: List[str], checkpoint: Any = None) -> Dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.recipes.data.preference import pair_batch
    from lightning_mixedfsdp.recipes.objectives import precomputed_reference
    from lightning_mixedfsdp.recipes.objectives.preference import answer_log_probs
    from lightning_mixedfsdp.recipes.run import runner

    seen: Dict[str, Any] = {"scoring_passes": 0}
    score_pairs = precomputed_reference.score_pairs

    def counted(*args: Any) -> Any:  # how often a precomputed reference scores the pairs
        seen["scoring_passes"] += 1
        return score_pairs(*args)

    precomputed_reference.score_pairs = counted  # type: ignore[assignment]  # this process's objective only

    class Read(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
            seen.setdefault("losses", []).append(outputs["loss"].item())  # this rank's micro-batch

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
            if index == 0 and "first_loss" not in seen:
                with torch.no_grad():
                    seen["first_loss"] = module.training_loss(batch).logged.item()
                    ids, labels, positions = pair_batch(batch)
                    policy, tokens = answer_log_probs(module.model, ids, labels, positions)
                    reference = module.reference_scores(batch, "train")
                seen["first_batch"], seen["first_reference"] = batch, reference
                pairs = len(ids) // 2
                margins = (policy[:pairs] - reference[:pairs]) - (policy[pairs:] - reference[pairs:])
                dpo = -torch.nn.functional.logsigmoid(0.5 * margins) + 0.2 * -policy[:pairs] / tokens[:pairs]
                seen["first_loss_by_formula"] = dpo.mean().item()

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            local = [getattr(p, "_local_tensor", p) for p in module.model.parameters()]
            seen["nf4_weights"] = sum(type(t).__name__ == "NF4Tensor" for t in local)
            if "first_batch" in seen:  # the reference's scores of the first batch after training
                seen["last_reference"] = module.reference_scores(seen.pop("first_batch"), "train")
            if module.reference is None:
                return
            optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
            reference = list(module.reference.parameters())
            seen["reference_frozen"] = all(not p.requires_grad and p.grad is None for p in reference)
            seen["reference_optimized"] = any(id(p) in optimized for p in reference)
            seen["reference_sharded"] = all(hasattr(p, "placements") for p in reference)

    runner.monitors = lambda recipe: [Read()]  # type: ignore[assignment]  # this process's runner only
    runner.run(load_recipe(None, recipe_overrides, launching=False), checkpoint)
    return seen


def _two_ranks(rank: int, world_size: int, policy: str, pairs: str, folder: str) -> Dict[str, Any]:
    straight = Path(folder) / "straight"
    checkpointed = ["strategy.activation_checkpointing=full"]  # recomputed in fp32: the one process runs without
    seen = _fit([*overrides(Path(policy), Path(pairs), straight, BATCH, world_size), *checkpointed])
    resumed = overrides(Path(policy), Path(pairs), Path(folder) / "resumed", BATCH, world_size)
    _fit([*resumed, *checkpointed], straight / "checkpoints" / "step=2.ckpt")
    # the other references: precomputed (straight, then resumed in its own run folder), and LoRA's adapters off
    precomputed = overrides(Path(policy), Path(pairs), Path(folder) / "precomputed", BATCH, world_size)
    precomputed.append("preference.reference=precomputed")
    seen["precomputed"] = _fit(precomputed)
    seen["precomputed_resumed"] = _fit(precomputed, Path(folder) / "precomputed" / "checkpoints" / "step=2.ckpt")
    lora = overrides(Path(policy), Path(pairs), Path(folder) / "adapters_off", BATCH, world_size)
    seen["adapters_off"] = _fit([*lora, "peft.enabled=true", "peft.target_modules=[q_proj,v_proj,down_proj]"])
    # QLoRA: the adapters over a 4-bit base, the reference that base with the adapters off, bf16-true
    qlora = overrides(Path(folder) / "wide_policy", Path(pairs), Path(folder) / "qlora", BATCH, world_size)
    qlora += ["peft.enabled=true", "strategy.memory.quantize_base=nf4", "trainer.precision=bf16-true"]
    seen["qlora"] = _fit(qlora)
    return seen


def _one_process(rank: int, world_size: int, policy: str, pairs: str, folder: str) -> Dict[str, Any]:
    return _fit(overrides(Path(policy), Path(pairs), Path(folder) / "one_process", BATCH * 2, 1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("preference")
    policy, pairs = make_llama_folder(folder / "policy"), _pairs_file(folder)
    make_llama_folder(folder / "wide_policy", hidden=256)  # its Linear shards fill NF4's blocks
    launched = run_together({  # side by side: each its own folder
        "ranks": lambda: run_distributed(_two_ranks, 2, str(policy), str(pairs), str(folder), timeout=600),
        "one": lambda: run_distributed(_one_process, 1, str(policy), str(pairs), str(folder), timeout=600)[0],
    })  # fmt: skip
    return {"folder": folder, **launched}


def _export(folder: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(folder / "export" / "model.safetensors"))


def test_two_ranks_equal_one_process_on_the_whole_batch(runs: Dict[str, Any]) -> None:
    equal_to_one_process(runs, "straight", STEPS, _export)


def test_the_trained_loss_is_the_dpo_formula_on_the_whole_logits(runs: Dict[str, Any]) -> None:
    for run in [runs["one"], *runs["ranks"]]:
        assert run["first_loss"] == pytest.approx(run["first_loss_by_formula"], rel=1e-6)


def test_a_resumed_run_repeats_the_straight_run(runs: Dict[str, Any]) -> None:
    straight, resumed = _export(runs["folder"] / "straight"), _export(runs["folder"] / "resumed")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_precomputed_reference_gives_the_copys_losses_and_a_resume_reads_it_back(runs: Dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        precomputed, resumed = rank["precomputed"], rank["precomputed_resumed"]
        assert precomputed["losses"] == pytest.approx(rank["losses"], rel=1e-6)
        assert precomputed["first_loss"] == pytest.approx(precomputed["first_loss_by_formula"], rel=1e-6)
        assert precomputed["scoring_passes"] == 2 and resumed["scoring_passes"] == 0  # training and held-out pairs
        assert resumed["losses"] == pytest.approx(precomputed["losses"][2:], rel=1e-6)
    stored = torch.load(runs["folder"] / "precomputed" / "reference_log_probs.pt", weights_only=True)
    assert {name: len(scores) for name, scores in stored["scores"].items()}["held_out"] >= 4


def test_lora_s_adapters_off_reference_is_the_starting_weights_before_and_after_training(
    runs: Dict[str, Any],
) -> None:
    for rank in runs["ranks"]:
        lora = rank["adapters_off"]
        # at step 0 the adapters add nothing: the copy's loss; after 3 steps the base is still the starting weights
        assert lora["first_loss"] == pytest.approx(rank["first_loss"], rel=1e-6)
        assert lora["first_loss"] == pytest.approx(lora["first_loss_by_formula"], rel=1e-6)
        torch.testing.assert_close(lora["last_reference"], rank["first_reference"], rtol=1e-6, atol=1e-5)
        assert lora["losses"][-1] != pytest.approx(lora["losses"][0], rel=1e-3)  # the adapters trained
    assert (runs["folder"] / "adapters_off" / "adapter").is_dir()


def test_qlora_s_adapters_off_reference_is_its_4_bit_base_and_trains(runs: Dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        qlora = rank["qlora"]
        assert qlora["nf4_weights"] == 14  # 7 projections in each of 2 layers, 4 bits, the reference's base too
        # at step 0 the policy is its reference: DPO's log 2 and the SFT term, as written out (bf16: 1e-3)
        assert qlora["first_loss"] == pytest.approx(qlora["first_loss_by_formula"], rel=1e-3)
        assert qlora["losses"][-1] != pytest.approx(qlora["losses"][0], rel=1e-3)


def test_the_reference_is_sharded_frozen_and_out_of_the_optimizer_checkpoint_and_export(runs: Dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    for rank in runs["ranks"]:
        assert rank["reference_frozen"] and rank["reference_sharded"] and not rank["reference_optimized"]
    straight = runs["folder"] / "straight"
    saved = list(FileSystemReader(str(straight / "checkpoints" / "last.ckpt")).read_metadata().state_dict_metadata)
    assert any(key.startswith("state_dict.model.") for key in saved) and not any("reference" in k for k in saved)
    assert _export(straight).keys() == _export(runs["folder"] / "one_process").keys()
    assert_the_export_states_its_dtype(straight / "export", torch.float32)  # output.export_dtype=fp32


def test_the_csv_log_holds_the_rewards_in_training_and_on_the_held_out_pairs(runs: Dict[str, Any]) -> None:
    from lightning_mixedfsdp.recipes.run.plot import read_metrics

    metrics = read_metrics(runs["folder"] / "straight" / "logs")
    for name in ("train_rewards_chosen", "train_rewards_rejected", "train_reward_margin", "train_reward_accuracy"):
        assert len(metrics[name]) == STEPS, name
    for name in ("val_loss", "val_reward_accuracy", "val_reward_margin", "val_policy_prefers_chosen"):
        assert len(metrics[name]) == 1, name


# -- refusals before launch


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_folder(tmp_path_factory.mktemp("refusals") / "policy")


def _refusal(policy: Path, *extra: str, pairs: Any = None) -> str:
    pairs = pairs or _pairs_file(policy.parent)
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [*overrides(policy, pairs, policy.parent / "out", BATCH, 2), *extra])
    return str(error.value)


def test_bad_preference_settings_are_refused_all_at_once(policy: Path) -> None:
    message = _refusal(
        policy, "preference.reference=cached", "preference.loss=hinge", "preference.beta=0",
        "preference.sft_weight=-1", "preference.reference_quantize=int4", "preference.reference_offload=disk",
    )  # fmt: skip
    assert "preference.reference='cached': use one of copy, adapters_off, precomputed" in message
    assert "preference.loss='hinge': use one of sigmoid, ipo" in message
    assert "preference.beta=0.0 must be > 0" in message
    assert "preference.sft_weight=-1.0 must be >= 0" in message
    assert "preference.reference_quantize='int4': use one of none, nf4" in message
    assert "preference.reference_offload='disk': use one of none, cpu" in message


def test_a_policy_without_starting_weights_and_untested_compositions_are_refused(policy: Path) -> None:
    base = [o for o in overrides(policy, _pairs_file(policy.parent), policy.parent / "o", BATCH, 2)]
    base = [o for o in base if not o.startswith("model.pretrained")]
    with pytest.raises(RecipeError, match="set model.pretrained to the model to tune"):
        load_recipe(None, base)
    assert "context_parallel_size=2 is not supported yet" in _refusal(
        policy, "strategy.parallelism.context_parallel_size=2"
    )
    fault_tolerant = _refusal(
        policy, "strategy.fault_tolerance.num_replica_groups=2", "strategy.fault_tolerance.replica_id=0"
    )
    assert "preference tuning with strategy.fault_tolerance is not supported yet" in fault_tolerant


def test_a_reference_that_does_not_fit_the_policy_is_refused_with_the_one_that_does(policy: Path) -> None:
    assert "peft is off: set peft.enabled=true, or use preference.reference=copy or precomputed" in _refusal(
        policy, "preference.reference=adapters_off"
    )
    assert "use preference.reference=adapters_off (the default with peft) or precomputed" in _refusal(
        policy, "peft.enabled=true", "preference.reference=copy"
    )
    assert "preference.reference='precomputed' holds none: leave them at none" in _refusal(
        policy, "preference.reference=precomputed", "preference.reference_quantize=nf4"
    )


def test_bad_pairs_are_named_by_file_and_line_all_at_once(policy: Path) -> None:
    pairs = policy.parent / "bad.jsonl"
    lines = [{"prompt": "q", "chosen": " a", "rejected": " b"}] * 30
    lines[3] = {"prompt": "q", "chosen": " a"}
    lines[5] = {"prompt": "q", "chosen": "", "rejected": " b"}
    lines[7] = {"prompt": "q", "chosen": " a", "rejected": " a"}
    pairs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    message = _refusal(policy, "data.format=preference", pairs=pairs)
    assert f"data: {pairs}:4 has the fields ['chosen', 'prompt'], not 'prompt', 'chosen' and 'rejected'" in message
    assert f"data: {pairs}:6 has an empty answer" in message
    assert f"data: {pairs}:8 has 'chosen' equal to 'rejected'" in message
