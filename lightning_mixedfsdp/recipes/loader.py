"""Loading a recipe: the schema's merge (schema < file < overrides) and the checks of what it points at, reported
together in one :class:`RecipeError` before any process starts."""

from typing import Optional, Sequence

from lightning_mixedfsdp.recipes.inputs import input_problems
from lightning_mixedfsdp.recipes.schema import Recipe, RecipeError, merge_recipe


def load_recipe(path: Optional[str], overrides: Sequence[str] = ()) -> Recipe:
    """The recipe at ``path`` (schema defaults without one) with ``key.sub=value`` overrides; raise
    :class:`RecipeError` listing every problem, the files a recipe points at checked once its fields are right."""
    recipe, problems = merge_recipe(path, overrides)
    if not problems:
        problems += input_problems(recipe)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise RecipeError(f"Recipe has {len(problems)} problem(s):\n{listed}")
    return recipe
