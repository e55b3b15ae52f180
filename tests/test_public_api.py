"""Every documented import path works: the entry points and the package's exports."""

import importlib

import pytest

ENTRY_POINTS = {
    "lightning_mixedfsdp.fabric": ["MixedFSDP2Strategy"],
    "lightning_mixedfsdp.pytorch": ["MixedFSDP2Strategy", "MixedFSDPTrainerPrecision"],
    "lightning_mixedfsdp.checkpoint": ["load_weights", "load_full_weights", "read_state_dict", "export_model"],
    "lightning_mixedfsdp.recipes.models": ["TinyLlama", "TinyLlamaConfig", "causal_lm_loss"],
    "lightning_mixedfsdp.recipes.settings.schema": ["Recipe", "RecipeError"],
    "lightning_mixedfsdp.recipes.run.loader": ["load_recipe"],
    "lightning_mixedfsdp.diagnostics": ["count_collectives", "DtypeLeakWarning"],
    "lightning_mixedfsdp.model_setup": ["shard_model", "ShardedModel", "ShardedModels"],
    "lightning_mixedfsdp.train": ["main"],
    "lightning_mixedfsdp.plan": ["main"],
}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_documented_module_exports_its_names(module: str) -> None:
    imported = importlib.import_module(module)
    for name in ENTRY_POINTS[module]:
        assert hasattr(imported, name), f"{module}.{name}"


def test_package_exports_every_name_in_all() -> None:
    import lightning_mixedfsdp

    for name in lightning_mixedfsdp.__all__:
        assert getattr(lightning_mixedfsdp, name) is not None, name


def test_importing_the_package_registers_the_strategy_for_fabric_and_trainer() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mixedfsdp.fabric
    import lightning_mixedfsdp.pytorch

    assert STRATEGY_REGISTRY["mixed_fsdp2"]["strategy"] is lightning_mixedfsdp.fabric.MixedFSDP2Strategy
    assert StrategyRegistry["mixed_fsdp2"]["strategy"] is lightning_mixedfsdp.pytorch.MixedFSDP2Strategy
