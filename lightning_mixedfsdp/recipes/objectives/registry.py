"""The objectives a recipe names (``objective: <name>``), and the one a recipe that names none trains: the one a key
of the recipe asks for (``teacher.pretrained``: distillation), else the first whose data format the recipe's data
resolves to."""

import difflib
from typing import Dict, List, Type

from lightning_mixedfsdp.recipes.objectives.distillation import Distillation
from lightning_mixedfsdp.recipes.objectives.grpo import GroupRelativePolicyOptimization
from lightning_mixedfsdp.recipes.objectives.language_modeling import CausalLM
from lightning_mixedfsdp.recipes.objectives.objective import Objective
from lightning_mixedfsdp.recipes.objectives.preference import PreferenceTuning
from lightning_mixedfsdp.recipes.objectives.sft import ChatLM
from lightning_mixedfsdp.recipes.objectives.vision_sft import VisionChatLM, model_key
from lightning_mixedfsdp.recipes.settings.inputs import resolved_format
from lightning_mixedfsdp.recipes.settings.schema import Recipe

OBJECTIVES: Dict[str, Type[Objective]] = {
    "language_modeling": CausalLM,
    "sft": ChatLM,
    "distillation": Distillation,
    "preference": PreferenceTuning,
    "vision_sft": VisionChatLM,
    "grpo": GroupRelativePolicyOptimization,
}
"""Every objective by the name a recipe gives it; the first that trains a data format is that format's default."""


def objective_name(recipe: Recipe) -> str:
    """The recipe's ``objective``, or the one a key of the recipe asks for, or the first registered one that trains
    its data's format."""
    if recipe.objective is not None:
        return recipe.objective
    asked = [name for name, objective in OBJECTIVES.items() if objective.asked_for(recipe) is not None]
    if asked:
        return asked[0]
    data_format = resolved_format(recipe.data)
    return next(name for name, objective in OBJECTIVES.items() if data_format in objective.formats)


def objective_class(recipe: Recipe) -> Type[Objective]:
    """The class that trains the recipe (its name checked before launch by :func:`objective_problems`)."""
    return OBJECTIVES[objective_name(recipe)]


def objective_problems(recipe: Recipe) -> List[str]:
    """An unknown ``objective``, one that does not train the data's format, keys that ask for another objective, and
    what the objective needs of the recipe, each with the fix."""
    unresolved = unresolved_objective_problems(recipe)
    if unresolved:
        return unresolved
    name = objective_name(recipe)
    problems = [
        f"{key} asks for objective {other!r}, and objective={name!r}; leave objective unset, or remove {key}"
        for other, objective in OBJECTIVES.items()
        if recipe.objective is not None and other != name and (key := objective.asked_for(recipe)) is not None
    ]
    return problems + OBJECTIVES[name].recipe_problems(recipe) + pipeline_problems(recipe, name)


def pipeline_problems(recipe: Recipe, name: str) -> List[str]:
    """What pipeline parallelism cannot train of the recipe (before launch): an objective whose step is not one
    model's forward and backward, gradient accumulation, adapters, a batch that does not split into the
    micro-batches."""
    parallelism = recipe.strategy.parallelism
    size = parallelism.pipeline_parallel_size
    if size == 1:
        return []
    key = f"strategy.parallelism.pipeline_parallel_size={size}"
    problems = []
    if not OBJECTIVES[name].pipelines:
        trained = sorted(other for other, objective in OBJECTIVES.items() if objective.pipelines)
        problems.append(
            f"objective {name!r} does not train under {key} yet (its step is more than one model's forward and"
            f" backward through the stages); objectives {trained} do: set pipeline_parallel_size=1 for {name!r}"
        )
    if recipe.trainer.accumulate_grad_batches > 1:
        problems.append(
            f"trainer.accumulate_grad_batches={recipe.trainer.accumulate_grad_batches} with {key}: set it to 1 and"
            " raise data.batch_size with strategy.parallelism.pipeline_microbatches instead"
        )
    if recipe.peft.enabled:
        problems.append(f"peft.enabled=true with {key} is not supported yet: train the whole model, or use FSDP alone")
    micro = parallelism.microbatches if isinstance(parallelism.pipeline_microbatches, (int, type(None))) else 1
    if isinstance(recipe.data.batch_size, int) and recipe.data.batch_size % micro:
        problems.append(
            f"data.batch_size={recipe.data.batch_size} does not split into {micro} pipeline micro-batches"
            " (strategy.parallelism.pipeline_microbatches); use a multiple of it"
        )
    return problems


def unresolved_objective_problems(recipe: Recipe) -> List[str]:
    """Why no objective trains the recipe's model and data: an unknown ``objective``, one that does not train the
    data's format, or an image-text model under another objective than ``vision_sft``. Empty: the objective's own
    checks (its data's, its settings') can run."""
    name = recipe.objective
    image_text = model_key(recipe)
    chosen = name if name is not None else objective_name(recipe)
    if image_text is not None and chosen in OBJECTIVES and OBJECTIVES[chosen] is not VisionChatLM:
        return [
            f"{image_text} names an image-text model, which trains with objective 'vision_sft' (fine-tuning on"
            f" image-text chats); objective {chosen!r} is not in place for image-text models: leave objective unset"
            " (and remove teacher.pretrained / the preference data), or train a causal LM"
        ]
    if name is None:
        return []
    if name not in OBJECTIVES:
        close = difflib.get_close_matches(name, list(OBJECTIVES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return [
            f"objective={name!r} is not one of {sorted(OBJECTIVES)}; {hint}leave it unset to train the data's format"
        ]
    data_format = resolved_format(recipe.data)
    formats = OBJECTIVES[name].formats
    if data_format not in formats:
        fitting = [other for other, objective in OBJECTIVES.items() if data_format in objective.formats]
        return [
            f"objective={name!r} trains on {' or '.join(formats)} data, and data.format resolves to {data_format!r};"
            f" point data.files at {' or '.join(formats)} records, or set objective to one of {fitting}"
        ]
    return []
