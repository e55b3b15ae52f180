"""Loading a recipe: the schema's merge (schema < file < overrides), the checks of what it points at, whether the data
fills a window, and whether this machine has the accelerator, reported together in one :class:`RecipeError` before
any process starts."""

from typing import List, Optional, Sequence

from lightning_mixedfsdp.recipes.inputs import input_problems, logger_problems
from lightning_mixedfsdp.recipes.schema import Recipe, RecipeError, TrainerSection, merge_recipe


def load_recipe(path: Optional[str], overrides: Sequence[str] = (), launching: bool = True) -> Recipe:
    """The recipe at ``path`` (schema defaults without one) with ``key.sub=value`` overrides; raise
    :class:`RecipeError` listing every problem, the files a recipe points at checked once its fields are right.
    ``launching``: also what training here needs (this machine's accelerator, enough text); a dry run plans for
    machines other than this one."""
    recipe, problems = merge_recipe(path, overrides)
    if not problems:
        problems += input_problems(recipe)
        if launching:
            problems += accelerator_problems(recipe.trainer)
            problems += strategy_problems(recipe)
            problems += logger_problems(recipe.trainer.logger)
    if not problems and launching:  # reading the data needs valid files and tokenizer
        problems += training_data_problems(recipe)
    if len(problems) == 1:
        raise RecipeError(f"Recipe has 1 problem: {problems[0]}")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise RecipeError(f"Recipe has {len(problems)} problems:\n{listed}")
    return recipe


def training_data_problems(recipe: Recipe) -> List[str]:
    """Whether the data trains: enough text for a window per rank, or fine-tuning examples that all make correct
    masks (every bad one named) and fill a row per rank. The data-parallel ranks are the world over the
    context-parallel size (those ranks share their rows)."""
    from lightning_mixedfsdp.recipes.data import data_problems
    from lightning_mixedfsdp.recipes.sft_data import FINE_TUNING, fine_tuning_problems, resolved_format

    context = recipe.strategy.parallelism.context_parallel_size
    ranks = recipe.world_size // context if isinstance(context, int) and context >= 1 else recipe.world_size
    if resolved_format(recipe.data) in FINE_TUNING:
        packed = recipe.data.packing and context == 1
        return fine_tuning_problems(recipe.data, ranks, packed)
    return data_problems(recipe.data, ranks)


def strategy_problems(recipe: Recipe) -> List[str]:
    """What the strategy's settings cannot do on this machine's accelerator (float8 without float8 matmuls, a missing
    extra): the questions the strategy asks at construction, asked here so the runner refuses before any launch."""
    from lightning_mixedfsdp.strategies.settings import setting_problems

    return [f"strategy.{problem}" for problem in setting_problems(recipe.mixed_fsdp_config(), _device_type(recipe))]


def _device_type(recipe: Recipe) -> str:
    name = recipe.trainer.accelerator
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name == "gpu" else name


def accelerator_problems(trainer: TrainerSection) -> List[str]:
    """The accelerator must exist on this machine with ``trainer.devices`` devices (``cpu`` runs any number of
    processes; ``auto`` takes what there is)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    name = trainer.accelerator
    known = sorted(AcceleratorRegistry.available_accelerators() | {"gpu", "auto"})
    if name not in known:
        return [f"trainer.accelerator={name!r} is not one of {known}; use cpu, gpu or auto"]
    if name in ("cpu", "auto"):
        return []
    candidates = ("cuda", "mps") if name == "gpu" else (name,)
    available = [c for c in candidates if AcceleratorRegistry[c]["accelerator"].is_available()]
    if not available:
        return [
            f"trainer.accelerator={name!r}: this machine has no {'/'.join(candidates)} device; use"
            " trainer.accelerator=cpu, or run on a machine that has one"
        ]
    count = AcceleratorRegistry[available[0]]["accelerator"].auto_device_count()
    if trainer.devices > count:
        return [
            f"trainer.devices={trainer.devices}, but this machine has {count} {available[0]} device(s); lower"
            " trainer.devices"
        ]
    return []
