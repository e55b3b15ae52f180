"""``optimizer.schedule``: the learning rate after the warm-up, as the recipe's scheduler sets it."""

import math

import pytest
import torch

from lightning_mixedfsdp.recipes.objectives.language_modeling import CausalLM
from lightning_mixedfsdp.recipes.objectives.objective import Schedule
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, RecipeError

PEAK, WARMUP, STEPS = 0.01, 3, 13


def expected(shape: str, step: int) -> float:
    """Each shape written out: warm-up to the peak, then the shape's decay to 10 % over the remaining steps."""
    if step < WARMUP:
        return PEAK * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    decay = {
        "constant": 1.0,
        "linear": 1 - 0.9 * progress,
        "cosine": 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2,
    }
    return PEAK * decay[shape]


@pytest.mark.parametrize("shape", ["cosine", "linear", "constant"])
def test_the_recipes_scheduler_sets_each_steps_rate_by_the_shape(shape: str) -> None:
    model = ModelSection(dim=16, n_layers=1, hidden_dim=32, mixer_layers=[])
    objective = CausalLM(model, Schedule(PEAK, 0.0, (0.9, 0.95), WARMUP, STEPS, shape=shape))
    configured = objective.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(STEPS + 2):  # past the end it stays at the end's rate
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([expected(shape, min(step, STEPS)) for step in range(STEPS + 2)], rel=1e-12)
    assert isinstance(optimizer, torch.optim.AdamW)


def test_an_unknown_schedule_is_refused_before_launch() -> None:
    with pytest.raises(RecipeError, match=r"optimizer.schedule='step' is none of cosine, linear, constant; pick one"):
        load_recipe("conf/stdlib_llama.yaml", ["optimizer.schedule=step"], launching=False)


def test_a_negative_warm_up_is_refused_before_launch() -> None:
    with pytest.raises(RecipeError, match=r"optimizer.warmup_steps=-1 must be >= 0 \(0: no warm-up\)"):
        load_recipe("conf/stdlib_llama.yaml", ["optimizer.warmup_steps=-1"], launching=False)
