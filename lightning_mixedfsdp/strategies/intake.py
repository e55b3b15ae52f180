"""What a strategy takes in while Fabric or the Trainer is constructed, before any process starts: the config (from
a ``MixedFSDPConfig``, a mapping or keywords), the mesh sizes, the extras the config needs, the precision plugin, the
accelerator and the process group backend. Whatever cannot run is refused here, once, with its fix."""

from typing import Any, Dict, Mapping, Optional, Tuple, Type, Union

import torch
from lightning.fabric.plugins.precision.precision import Precision

from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.fault_tolerance.hooks import NoFaultTolerance, fault_tolerance_for
from lightning_mixedfsdp.strategies.precision import MixedFSDPPrecision, TPlugin, adopt_precision, plugin_or_default
from lightning_mixedfsdp.strategies.process_group import process_group_backend as process_group_backend_for
from lightning_mixedfsdp.strategies.settings import accelerator_device_type, check_accelerator, check_extras

STRATEGY_NAME = "mixed_fsdp2"

ConfigInput = Union[MixedFSDPConfig, Mapping[str, Any], None]


def given(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """The arguments a strategy was given (not ``None``): Lightning's mesh sizes, which are config options too."""
    return {name: value for name, value in arguments.items() if value is not None}


class IntakeMixin:
    """The settings half of :class:`~lightning_mixedfsdp.strategies.mixin.MixedFSDP2Mixin`: the config, the
    precision plugin, the accelerator and the backend, each checked as Lightning hands it over."""

    _config: MixedFSDPConfig
    _fault_tolerance: NoFaultTolerance
    _process_group_backend: Optional[str]
    _accelerator: Any
    root_device: torch.device  # provided by Lightning's strategies
    _split_in = "parallelize_fn"
    """Where the user applies tensor parallelism (the Trainer's: ``configure_model``), named by a refusal."""

    def _intake(self, config: ConfigInput, options: Dict[str, Any], process_group_backend: Optional[str]) -> None:
        """Before Lightning's ``__init__``, which already calls the precision setter that needs the config: the
        config (the mesh sizes among its options), missing extras (torchao, torchft), a process group backend offload
        cannot use."""
        owner = type(self).__name__
        self._config = MixedFSDPConfig.from_input(config, options, owner)
        check_extras(self._config, owner)
        if process_group_backend is not None:  # refused now when it has no host part for offload's collectives
            process_group_backend_for("cuda", process_group_backend, self._host_collectives, owner)
        semi_synchronous = self._config.parallelism.replicate_sync != "every_step"
        self._fault_tolerance = fault_tolerance_for(self._config.fault_tolerance, owner, semi_synchronous)
        self._reset_state()

    def _reset_state(self) -> None:
        """The state the strategy's hooks fill in later (meshes, set-up models, watched optimizers)."""

    @property
    def _host_collectives(self) -> bool:
        """Whether collectives meet host tensors (CPU offload), which needs a CPU backend beside NCCL."""
        memory = self._config.memory
        return memory.offload is not None or memory.offload_frozen is not None

    @property
    def config(self) -> MixedFSDPConfig:
        return self._config

    # the methods below override those of the Lightning strategy this class is mixed into (the type checker sees no
    # base here, so they carry no @override)
    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        # Lightning hands the strategy its accelerator while Fabric or the Trainer is constructed: what cannot run on
        # it is refused then, before any process starts
        if accelerator is not None:
            check_accelerator(self._config, accelerator_device_type(accelerator), type(self).__name__)
        self._accelerator = accelerator

    def _get_process_group_backend(self) -> str:
        # Lightning's private hook (strategies/lightning_compat.py lists it): gloo beside NCCL under offload
        requested = self._process_group_backend
        return process_group_backend_for(self.root_device.type, requested, self._host_collectives, type(self).__name__)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="FSDP2 with dtype-grouped sharding for mixed-dtype models"
            )

    def _plugin_or_default(self, plugin: Optional[Precision], plugin_class: Type[TPlugin]) -> TPlugin:
        assert plugin is None or isinstance(plugin, MixedFSDPPrecision)
        return plugin_or_default(plugin, self._config, plugin_class)

    def _adopted(self, plugin: Any, plugin_class: Type[TPlugin], translatable: Tuple[type, ...]) -> Optional[TPlugin]:
        return adopt_precision(plugin, self._config, type(self).__name__, plugin_class, translatable)
