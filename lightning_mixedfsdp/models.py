"""Deprecated path, kept so old imports work: reference models moved to ``lightning_mixedfsdp.recipes.models``."""

import warnings

from lightning_mixedfsdp.recipes.models import *  # noqa: F401,F403

warnings.warn(
    "lightning_mixedfsdp.models moved to lightning_mixedfsdp.recipes.models; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
