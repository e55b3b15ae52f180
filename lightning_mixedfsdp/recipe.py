"""Deprecated path, kept so old imports work: recipe schema moved to ``lightning_mixedfsdp.recipes.schema``."""

import warnings

from lightning_mixedfsdp.recipes.schema import *  # noqa: F401,F403

warnings.warn(
    "lightning_mixedfsdp.recipe moved to lightning_mixedfsdp.recipes.schema; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
