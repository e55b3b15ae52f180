"""The Lightning faces of the library: one shared mixin, the Fabric strategy, the Trainer strategy, the precision
plugins, and every private Lightning API they use (``lightning_compat``). Only this room and the recipes import
Lightning."""

from lightning_mixedfsdp.model.names import register_unwrapper
from lightning_mixedfsdp.strategies.lightning_compat import unwrap_fabric_module

register_unwrapper(unwrap_fabric_module)
