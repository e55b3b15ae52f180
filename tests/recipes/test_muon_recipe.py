"""``optimizer.name: muon`` in a recipe: the main job through the runner on 2 ranks (``main_job.py``'s launch: the
console names the split, the held-out perplexity falls), the dry run's split and state bytes, and each refusal before
launch."""

import re
from typing import Any, Dict

import pytest

from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError
from tests.recipes.main_job import RECIPE, TINY

# the main job's tiny model: layer 0 attention (wq, wk, wv, wo), layer 1 the mixer (in_proj, out_proj), an MLP each
MATRICES = 4 + 2 + 2 * 3


def test_the_main_job_with_muon_names_the_split_and_learns(main_job: Dict[str, Any]) -> None:
    out = main_job["muon_out"]
    assert re.search(rf"optimizer: Muon: {MATRICES} matrices, [\d.]+M params; AdamW: \d+ tensors", out), out[-3000:]
    before, after = map(float, re.search(r"held-out perplexity: ([\d.]+) untrained -> ([\d.]+)", out).groups())  # type: ignore[union-attr]
    assert after < before / 4, out[-2000:]
    assert "Traceback" not in out


def test_muons_matrices_train_at_muon_lr_on_the_schedule(main_job: Dict[str, Any]) -> None:
    from lightning_mixedfsdp.recipes.objectives.objective import warmup_cosine
    from lightning_mixedfsdp.recipes.run.plot import read_metrics

    # the logged lr is the first param group's, Muon's: optimizer.muon_lr=0.05 on the schedule, not AdamW's 0.01
    logged = read_metrics(main_job["whole"].parent / "muon" / "logs")["lr"]
    assert len(logged) == 20
    for step, lr in logged.items():
        assert lr == pytest.approx(0.05 * warmup_cosine(step, 20, 20), rel=1e-6), step


def test_the_dry_run_says_which_optimizer_each_param_gets_and_counts_one_state_for_muon(capsys: Any) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    main([*TINY, "--dry-run"])
    adamw = capsys.readouterr().out
    main([*TINY, "--dry-run", "optimizer.name=muon"])
    muon = capsys.readouterr().out
    assert f"optimizer: Muon for {MATRICES} matrices" in muon and "1 state each: the momentum buffer" in muon
    # the report's optimizer column: the blocks' matrices Muon, norms, the mixer's A_log, embeddings and head AdamW
    rows = {
        line.split()[0]: line.split()[-1] for line in muon.splitlines() if line.startswith(("layers.", "tok_", "out"))
    }
    assert rows["layers.*.attention.wq.weight"] == rows["layers.*.feed_forward.w2.weight"] == "Muon"
    assert rows["layers.*.attention.in_proj.weight"] == "Muon"
    assert rows["layers.*.attention_norm.weight"] == rows["layers.*.attention.A_log"] == "AdamW"
    assert rows["tok_embeddings.weight"] == rows["output.weight"] == "AdamW"
    assert "optimizer" not in adamw.splitlines()[3]  # an AdamW recipe's report has no optimizer column

    def states(text: str, label: str) -> str:
        return re.search(rf"  {label} +([\d.]+ \w+)", text).group(1)  # type: ignore[union-attr]

    assert states(adamw, "params") == states(muon, "params")
    adamw_kib, muon_kib = (
        float(states(t, label).split()[0]) for t, label in ((adamw, "AdamW states"), (muon, "Muon \\+ AdamW"))
    )
    assert muon_kib < adamw_kib  # the matrices hold one state, not two


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.name=sgd"], r"optimizer.name='sgd' is none of adamw, muon; pick one"),
        (["optimizer.name=muon", "optimizer.adjust_lr_fn=rms"], r"optimizer.adjust_lr_fn='rms' is none of original"),
        (
            ["optimizer.name=muon", "trainer.precision=bf16-true", "strategy.dtypes.bf16_updates=stochastic"],
            r"optimizer.name=muon with strategy.dtypes.bf16_updates='stochastic': the bf16 write-back computes",
        ),
        (
            ["optimizer.name=muon", "model.hf_config={model_type: llama, vocab_size: 256}", "peft.enabled=true"],
            r"optimizer.name=muon with peft.enabled=true: LoRA's factors are not the weights Muon is for",
        ),
    ],
)
def test_what_a_recipe_cannot_run_with_muon_is_refused_before_launch(overrides: list, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPE, overrides, launching=False)
