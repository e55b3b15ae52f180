"""Deprecated path, kept so old imports work: loading moved to ``lightning_mixedfsdp.checkpoint``."""

import warnings

from lightning_mixedfsdp.checkpoint import *  # noqa: F401,F403

warnings.warn(
    "lightning_mixedfsdp.loading moved to lightning_mixedfsdp.checkpoint; import it from there.",
    DeprecationWarning,
    stacklevel=2,
)
