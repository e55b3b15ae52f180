"""Recipes under pipeline parallelism, before launch: what cannot train pipelined is refused with the fix, every
problem at once; the LM recipe's plan is what the strategy splits."""

import pytest

from lightning_mixedfsdp.recipes.run.loader import RecipeError, load_recipe

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

PIPELINED = "strategy.parallelism.pipeline_parallel_size=2"
REFUSALS = {
    "objective": (
        ["conf/stdlib_llama_dpo.yaml"],
        "objective 'preference' does not train under strategy.parallelism.pipeline_parallel_size=2 yet",
    ),
    "accumulation": (
        ["conf/stdlib_llama.yaml", "trainer.accumulate_grad_batches=2"],
        "trainer.accumulate_grad_batches=2 with strategy.parallelism.pipeline_parallel_size=2: set it to 1",
    ),
    "batch": (
        ["conf/stdlib_llama.yaml", "data.batch_size=7"],
        "data.batch_size=7 does not split into 2 pipeline micro-batches",
    ),
    "context_parallel": (
        ["conf/stdlib_llama.yaml", "strategy.parallelism.context_parallel_size=2"],
        "pipeline_parallel_size=2 with context_parallel_size=2 is not supported yet",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_recipe_refusal_under_pipeline_parallelism_names_the_fix(case: str) -> None:
    (path, *overrides), message = REFUSALS[case]
    with pytest.raises(RecipeError, match="problem") as raised:
        load_recipe(path, [PIPELINED, *overrides], launching=False)
    assert message in str(raised.value), str(raised.value)


def test_the_lm_recipe_loads_pipelined() -> None:
    recipe = load_recipe("conf/stdlib_llama.yaml", [PIPELINED, "data.batch_size=16"], launching=False)
    assert recipe.strategy.parallelism.microbatches == 2
