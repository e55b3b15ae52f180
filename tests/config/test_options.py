"""Option groups: one option is one field in one group. A throwaway option added to a group in a fixture travels from
a recipe override and a strategy keyword, through validation, to the planner's and the applier's options, with no
other file touched; every flat name of the config keeps reaching its group, in keywords, configs and recipes."""

import dataclasses
import socket
from typing import Any, Iterator, List, Literal

import pytest
import torch
from torch import nn

from lightning_mixedfsdp import MixedFSDPConfig, MixedFSDPConfigError
from lightning_mixedfsdp.config import Float8, flat_names, groups
from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError, StrategySection

ProbeChoice = Literal["low", "high"]


@pytest.fixture
def probe_option(monkeypatch: pytest.MonkeyPatch) -> type:
    """What a developer does to add an option: one more field in the ``Sharding`` group's class body. Here the
    class is rebuilt with the field, and the config's ``sharding`` field (which the recipe's strategy section
    inherits) is pointed at it: the only place that names the group's class."""
    probe_group = dataclasses.make_dataclass(
        "Sharding",
        [("probe", ProbeChoice, dataclasses.field(default="low"))],
        bases=(groups.Sharding,),
        namespace={"__doc__": groups.Sharding.__doc__, "__module__": groups.__name__},
    )
    for owner in (MixedFSDPConfig, StrategySection):
        config_field = owner.__dataclass_fields__["sharding"]  # type: ignore[attr-defined]
        monkeypatch.setattr(config_field, "type", probe_group)
        monkeypatch.setattr(config_field, "default_factory", probe_group)
    monkeypatch.setitem(MixedFSDPConfig.__annotations__, "sharding", probe_group)
    return probe_group


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank in this process, for a real ``shard_model``."""
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _seen_by_planner_and_applier(config: MixedFSDPConfig, monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """Shard a model for real on one rank and return the ``sharding`` group the planner and the applier got."""
    import lightning_mixedfsdp.model_setup as model_setup
    import lightning_mixedfsdp.planning.planner as planner
    from lightning_mixedfsdp.mesh import build_parallel_meshes
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    seen: List[Any] = []
    plan_model, apply_plan = planner.plan_model, model_setup.apply_plan

    def planning(*args: Any, **kwargs: Any) -> Any:
        seen.append(("planner", args[2].sharding))
        return plan_model(*args, **kwargs)

    def applying(*args: Any, **kwargs: Any) -> Any:
        seen.append(("applier", args[5].sharding))
        return apply_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_model", planning)
    monkeypatch.setattr(model_setup, "apply_plan", applying)
    model = TinyLlama(TinyLlamaConfig(vocab_size=32, dim=16, n_layers=1, hidden_dim=32))
    meshes = build_parallel_meshes("cpu", 1, 1, 1, 1)
    sharded = model_setup.shard_model(model, config, config.bulk_dtypes("bf16-true"), meshes, torch.device("cpu"))
    loss = sharded.module(torch.randint(0, 32, (2, 8))).float().mean()
    loss.backward()  # the sharded model trains
    return seen


def test_a_new_option_travels_from_keywords_and_recipes_to_the_planner_and_the_applier(
    probe_option: type, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_keyword = MixedFSDP2Strategy(sharding={"probe": "high"}).config
    from_recipe = load_recipe(None, ["strategy.sharding.probe=high"], launching=False).strategy_kwargs()["config"]
    for config in (from_keyword, from_recipe):
        assert isinstance(config.sharding, probe_option)
        assert config.sharding.probe == "high"
    assert MixedFSDPConfig().sharding.probe == "low"
    seen = _seen_by_planner_and_applier(from_recipe, monkeypatch)
    assert [(who, group.probe) for who, group in seen] == [("planner", "high"), ("applier", "high")]


def test_a_new_option_is_validated_by_its_type_with_its_name(probe_option: type) -> None:
    message = r"sharding\.probe='sideways' is not supported; use one of \['low', 'high'\]"
    with pytest.raises(MixedFSDPConfigError, match=message):
        MixedFSDP2Strategy(sharding={"probe": "sideways"})
    with pytest.raises(RecipeError, match=r"strategy\.sharding\.probe='sideways'"):
        load_recipe(None, ["strategy.sharding.probe=sideways"], launching=False)


FLAT_VALUES = {
    "storage": "fp32",
    "compute_dtype": "fp32",
    "reduce_dtype": "fp32",
    "keep_fp32_modules": ["Norm"],
    "keep_fp32_params": [r"bias$"],
    "honor_hf_keep_in_fp32": False,
    "cast_buffers": True,
    "pin_frozen_modules": False,
    "bf16_updates": "kahan",
    "fp32_compute_modules": ["^lm_head$"],
    "wrap_units": ["Block"],
    "conditional_modules": [r"vision_tower$"],
    "reshard_after_forward": False,
    "replicate_below_bytes": 0,
    "activation_checkpointing": "full",
    "compile": True,
    "recompute_keep_fp32_modules": True,
    "float8_emulate": True,
    "float8_skip_small": False,
    "float8_include": ["wq"],
    "float8_exclude": ["wo"],
    "quantize_base": "nf4",
    "offload": "cpu",
    "offload_frozen": "cpu",
    "data_parallel_size": 2,
    "data_parallel_replicate_size": 2,
    "tensor_parallel_size": 2,
    "buffer_sync": "average",
    "buffer_sync_names": ["running_"],
    "context_parallel_size": 2,
    "context_parallel_rotate": "alltoall",
    "expert_parallel_size": 2,
    "expert_parallel_plan": {"layers.*.experts": "ep_dispatch_experts"},
    "replicate_sync": "diloco",
    "pipeline_parallel_size": 2,
    "pipeline_schedule": "GPipe",
    "pipeline_microbatches": 8,
    "pipeline_stages_per_rank": 1,
    "pipeline_split": ["layers.2"],
    "sync_every": 5,
    "outer_lr": 0.5,
    "outer_momentum": 0.8,
    "outer_nesterov": False,
    "outer_state": "device",
    "print_report": True,
    "check_dtype_leaks": True,
    "nonfinite_check": "device_assert",
    "init_meta_params": False,
}


def test_every_flat_name_has_a_value_here() -> None:
    assert set(FLAT_VALUES) == set(flat_names())


@pytest.mark.parametrize("flat", sorted(FLAT_VALUES))
def test_a_flat_name_reaches_its_group_in_configs_keywords_and_recipes(flat: str) -> None:
    value = FLAT_VALUES[flat]
    group, option = flat_names()[flat]
    # float8's options need its recipe, a replicate sync replicas
    needs, in_group = {}, {}
    if flat.startswith("float8_"):
        needs, in_group = {"float8": "tensorwise"}, {"recipe": "tensorwise"}
    elif flat == "replicate_sync":
        needs = in_group = {"data_parallel_replicate_size": 2}
    expected = MixedFSDPConfig(**{group: {option: value, **in_group}})
    recipe_value = "[" + ",".join(value) + "]" if isinstance(value, list) else value
    recipe_overrides = [f"strategy.{flat}={recipe_value}", *(f"strategy.{k}={v}" for k, v in needs.items())]
    configs = [
        MixedFSDPConfig(**{flat: value, **needs}),
        MixedFSDPConfig.from_input(None, {flat: value, **needs}, "test"),
        MixedFSDPConfig.from_input({flat: value, **needs}, {}, "test"),
    ]
    if not isinstance(value, dict):
        # parallel=False: the name's routing, not whether the default model and world could run the value
        configs.append(load_recipe(None, recipe_overrides, launching=False, parallel=False).mixed_fsdp_config())
    for config in configs:
        assert getattr(getattr(config, group), option) == value
        assert getattr(config, group) == getattr(expected, group)


def test_setting_a_flat_name_writes_through_to_its_group() -> None:
    config = MixedFSDPConfig()
    config.keep_fp32_params = ["x$"]
    assert config.dtypes.keep_fp32_params == ["x$"]


@pytest.mark.parametrize("spelling", ["scalar", "nested"])
def test_float8_as_one_value_sets_its_recipe_in_keywords_configs_and_recipes(spelling: str) -> None:
    value: Any = "rowwise" if spelling == "scalar" else {"recipe": "rowwise", "emulate": True}
    expected = Float8(recipe="rowwise", emulate=spelling == "nested")
    assert MixedFSDPConfig(float8=value).float8 == expected
    assert MixedFSDP2Strategy(float8=value).config.float8 == expected
    override = ["strategy.float8=rowwise"] if spelling == "scalar" else ["strategy.float8.recipe=rowwise"]
    if spelling == "nested":
        override.append("strategy.float8.emulate=true")
    assert load_recipe(None, override, launching=False).mixed_fsdp_config().float8 == expected


def test_a_scalar_over_a_config_sets_only_the_main_field() -> None:
    base = MixedFSDPConfig(float8={"recipe": "tensorwise", "emulate": True})
    merged = MixedFSDPConfig.from_input(base, {"float8": "rowwise"}, "test")
    assert merged.float8 == Float8(recipe="rowwise", emulate=True)


def test_the_config_and_the_recipe_schema_read_the_same_groups() -> None:
    from lightning_mixedfsdp.config import group_classes

    config_fields = {f.name for f in dataclasses.fields(MixedFSDPConfig)}
    assert config_fields == set(group_classes())
    assert config_fields <= {f.name for f in dataclasses.fields(StrategySection)}


def test_a_plan_needs_no_config_field_by_field() -> None:
    """The planner takes the groups whole: a plan from the config equals one from its groups."""
    from lightning_mixedfsdp.planning.options import PlanOptions
    from lightning_mixedfsdp.planning.planner import plan_model, plan_sharding
    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig

    config = MixedFSDPConfig(keep_fp32_params=[r"A_log$"], replicate_below_bytes=0)
    model = TinyLlama(TinyLlamaConfig(dim=16, n_layers=2, hidden_dim=32, mixer_layers=[1]))
    by_groups = plan_model(model, config.bulk_dtypes("bf16-true"), PlanOptions.of(config))
    assert by_groups == plan_sharding(model, config, "bf16-true")
    assert isinstance(model, nn.Module)
