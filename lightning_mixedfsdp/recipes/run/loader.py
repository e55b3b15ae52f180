"""Loading a recipe: the schema's merge (schema < file < overrides), the checks of what it points at, the mesh sizes
and the model under them as the strategy and the model setup would refuse them at setup, whether the data fills a
window, and whether this machine has the accelerator, reported together in one :class:`RecipeError` before any process
starts."""

import re
from typing import List, Mapping, Optional, Sequence

from lightning_mixedfsdp.apply.context_parallel import context_parallel_problems
from lightning_mixedfsdp.fault_tolerance.session import missing_lighthouse
from lightning_mixedfsdp.mesh import ParallelDims
from lightning_mixedfsdp.recipes.objectives.objective import build_model
from lightning_mixedfsdp.recipes.objectives.registry import (
    objective_class,
    objective_problems,
    unresolved_objective_problems,
)
from lightning_mixedfsdp.recipes.settings.inputs import (
    input_problems,
    package_problems,
    reference_model_config,
    resolved_format,
)
from lightning_mixedfsdp.recipes.settings.schema import (
    PeftSection,
    Recipe,
    RecipeError,
    TrainerSection,
    merge_recipe,
    recipe_spelling,
)
from lightning_mixedfsdp.strategies.settings import setting_problems


def load_recipe(
    path: Optional[str], overrides: Sequence[str] = (), launching: bool = True, parallel: bool = True
) -> Recipe:
    """The recipe at ``path`` (schema defaults without one) with ``key.sub=value`` overrides; raise
    :class:`RecipeError` listing every problem, the files a recipe points at checked once its fields are right.
    ``launching``: also what training here needs (this machine's accelerator, enough text); a dry run plans for
    machines other than this one. ``parallel``: also the mesh sizes against the recipe's world and the model against
    its context parallelism, what the strategy and the model setup refuse at setup (False: the planner CLI, which plans
    at its own ``--world-size`` and size flags and checks those itself)."""
    recipe, problems = merge_recipe(path, overrides)
    fields_valid = not problems
    meshes = mesh_problems(recipe) if parallel else []
    problems += meshes
    if parallel:
        problems += mixer_layer_problems(recipe)
    if fields_valid:
        inputs = input_problems(recipe)
        problems += inputs
        if not any(p.startswith("data.") for p in inputs):  # the data's format reads
            problems += objective_problems(recipe)
        if parallel and not any(p.startswith("model.") for p in inputs):  # the model's config reads
            problems += model_context_parallel_problems(recipe)
        if launching:
            problems += accelerator_problems(recipe.trainer)
            problems += strategy_problems(recipe)
            problems += package_problems(recipe)
        # the data is read with the rest's problems still to fix (a reward file, a setting, a model folder): every
        # problem at once, once its files, tokenizer, objective and ranks are known
        if launching and data_readable(recipe, inputs) and not meshes and not unresolved_objective_problems(recipe):
            problems += training_data_problems(recipe)
    if len(problems) == 1:
        raise RecipeError(f"Recipe has 1 problem: {problems[0]}")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise RecipeError(f"Recipe has {len(problems)} problems:\n{listed}")
    return recipe


RECIPE_KEYS = {
    "data_parallel_replicate_size": "strategy.parallelism.data_parallel_replicate_size",
    "data_parallel_size": "strategy.parallelism.data_parallel_size",
    "tensor_parallel_size": "strategy.parallelism.tensor_parallel_size",
    "context_parallel_size": "strategy.parallelism.context_parallel_size",
    "expert_parallel_size": "strategy.parallelism.expert_parallel_size",
    "pipeline_parallel_size": "strategy.parallelism.pipeline_parallel_size",
}
"""The strategy's size names (as :class:`~lightning_mixedfsdp.mesh.ParallelDims` and the model setup say them) and the
recipe keys that set them."""


def in_recipe_keys(problem: str, keys: Mapping[str, str] = RECIPE_KEYS) -> str:
    """``problem`` with each size name the strategy says replaced by the recipe key that sets it."""
    names = "|".join(sorted(keys, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])({names})(?!\w)", lambda m: keys[m.group(1)], problem)


def mesh_problems(recipe: Recipe) -> List[str]:
    """The mesh sizes against ``trainer.devices x trainer.num_nodes`` ranks, as the strategy resolves and validates
    them at setup (``ParallelDims``), in recipe keys. Sizes out of range are named by the schema's own checks."""
    trainer, parallelism = recipe.trainer, recipe.strategy.parallelism
    if min(trainer.devices, trainer.num_nodes) < 1 or parallelism.problems("parallelism"):
        return []
    world = recipe.world_size
    problems = ParallelDims.resolve_problems(
        world_size=world,
        devices_per_node=trainer.devices,
        data_parallel_size=parallelism.data_parallel_size,
        replicate=parallelism.data_parallel_replicate_size,
        tensor_parallel_size=parallelism.tensor_parallel_size,
        expert_parallel=parallelism.expert_parallel_size,
        context_parallel=parallelism.context_parallel_size,
        pipeline=parallelism.pipeline_parallel_size,
    )
    ranks = f"trainer.devices={trainer.devices} x trainer.num_nodes={trainer.num_nodes} = {world}"
    return [
        re.sub(r"world size \(\d+\)", f"world size ({ranks})", in_recipe_keys(problem)).replace(
            "devices/nodes", "trainer.devices/trainer.num_nodes"
        )
        for problem in problems
    ]


def mixer_layer_problems(recipe: Recipe) -> List[str]:
    """The reference model's mixer layers under context parallelism: a mixer runs along the whole sequence, which
    context parallelism splits (the model setup refuses it at setup, naming the module); the fix is a recipe key."""
    model, context = recipe.model, recipe.strategy.parallelism.context_parallel_size
    if model.hf_source() is not None or not model.mixer_layers or not (isinstance(context, int) and context > 1):
        return []
    return [
        f"model.mixer_layers={list(model.mixer_layers)}: a Mamba-style mixer runs along the whole sequence, and"
        f" strategy.parallelism.context_parallel_size={context} splits every sequence across ranks (only attention"
        " runs on split sequences, as ring attention); set model.mixer_layers=[] (attention in every layer, as"
        " conf/stdlib_llama_long.yaml) or strategy.parallelism.context_parallel_size=1"
    ]


def model_context_parallel_problems(recipe: Recipe) -> List[str]:
    """What context parallelism refuses in the model the recipe points at (``model.hf_config`` or
    ``model.pretrained``), asked of the model built on the meta device as the model setup asks it at setup; a reference
    model's export is judged by its config's mixer layers."""
    model, context = recipe.model, recipe.strategy.parallelism.context_parallel_size
    if model.hf_source() is None or not (isinstance(context, int) and context > 1):
        return []
    key = "model.hf_config" if model.hf_config is not None else f"model.pretrained={model.pretrained!r}"
    reference = reference_model_config(model)
    if reference is not None:
        if not reference.mixer_layers:
            return []
        return [
            f"{key}: this export of the reference model has mixer layers {list(reference.mixer_layers)} (its"
            f" config.json), which run along the whole sequence, and strategy.parallelism.context_parallel_size="
            f"{context} splits every sequence across ranks; set strategy.parallelism.context_parallel_size=1, or"
            " fine-tune an export trained with model.mixer_layers=[]"
        ]
    built = build_model(model, PeftSection())  # on the meta device; adapters change no sequence mixer
    return [f"{key}: {in_recipe_keys(problem)}" for problem in context_parallel_problems(built, context)]


def data_readable(recipe: Recipe, inputs: List[str]) -> bool:
    """Whether the data can be read despite these problems with the recipe's inputs: its files and tokenizer are
    right (no ``data`` problem), and a model folder with problems lends it nothing: the byte tokenizer reads text
    rows (a tokenizer folder, often the model's own, and image-text rows' processor come from a folder)."""
    if any(problem.startswith("data") for problem in inputs):
        return False
    if not any(problem.startswith("model") for problem in inputs):
        return True
    return recipe.data.tokenizer == "bytes" and resolved_format(recipe.data) != "vision"


def training_data_problems(recipe: Recipe) -> List[str]:
    """Whether the data trains: enough text for a window per rank, or fine-tuning examples that all make correct
    masks (every bad one named) and fill a row per rank. The data-parallel ranks are the world over the
    context-parallel size (those ranks share their rows)."""
    context = recipe.strategy.parallelism.context_parallel_size
    ranks = recipe.world_size // context if isinstance(context, int) and context >= 1 else recipe.world_size
    return objective_class(recipe).data_problems(recipe, ranks)


def strategy_problems(recipe: Recipe) -> List[str]:
    """What the strategy's settings cannot do on this machine's accelerator (float8 without float8 matmuls, a missing
    extra, fault tolerance without a lighthouse): the questions the strategy asks at construction, asked here so the
    runner refuses before any launch, in recipe keys."""
    config = recipe.mixed_fsdp_config()
    problems = [str(problem) for problem in setting_problems(config, _device_type(recipe))]
    lighthouse = missing_lighthouse(config.fault_tolerance) if config.fault_tolerance is not None else None
    return [recipe_spelling(problem) for problem in [*problems, *([lighthouse] if lighthouse else [])]]


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
