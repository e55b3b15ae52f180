"""The precision monitor on 2 gloo ranks, on real ``fully_shard``-ed models: an HF Llama whose final norm is bf16
near 7 (AdamW at 1e-3: every update rounds away) is named with the rule, and names nothing once that rule keeps it
fp32; a default bf16-true Llama at lr 1e-3 raises no false alarm; one weight frozen by a tiny learning rate of its own
is named, the same weight at a large one is not; on params whose updates the test sets (SGD on a fixed gradient), the
shares on 2 ranks equal those in one process, sharded and replicated params alike; the Trainer's callback logs the
shares and names the same param; names stay the model's through activation checkpointing and compile; under peft
LoRA only the adapters are measured; the keep-fp32 manifest rides with checkpoints and exports, and a resume under other
rules warns with the difference."""

import functools
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.testing import run_distributed
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import make_fabric

WORLD, STEPS = 2, 20
TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


def _llama_with_norm_at(value: float) -> nn.Module:
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.norm.weight.fill_(value).add_(torch.linspace(-0.05, 0.05, model.model.norm.weight.numel()))
    return model


def _train(model: nn.Module, fabric: Any, monitor: Any, lrs: Dict[str, float], lr: float = 1e-3) -> Dict[str, Any]:
    """``STEPS`` AdamW steps on this rank's rows, every step sampled; ``lrs``: a learning rate for single params."""
    model = fabric.setup(model)
    named = dict(model.module.named_parameters())  # the sharded params, by the user's names
    own = [named[name] for name in lrs]
    groups = [{"params": [p for p in model.parameters() if all(p is not o for o in own)]}]
    groups += [{"params": [named[name]], "lr": value} for name, value in lrs.items()]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(groups, lr=lr, weight_decay=0.0))
    rows = TOKENS.chunk(fabric.world_size)[fabric.global_rank]
    for step in range(STEPS):
        fabric.backward(model(input_ids=rows, labels=rows).loss)
        with monitor.around_step(model, optimizer, step):
            optimizer.step()
        optimizer.zero_grad()
    report = monitor.report(fabric.strategy.plan_of(model))
    return {"named": monitor.named, "metrics": monitor.metrics, "samples": monitor.samples, "report": report}


def _monitored(world: int, model: nn.Module, lrs: Dict[str, float], **options: Any) -> Dict[str, Any]:
    from lightning_mixedfsdp import PrecisionMonitor
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world, "bf16-true", MixedFSDP2Strategy(**options))
    messages: List[str] = []
    handler = _Collect(messages)
    import logging

    logging.getLogger("lightning_mixedfsdp").addHandler(handler)
    try:
        out = _train(model, fabric, PrecisionMonitor(every_n_steps=1), lrs)
    finally:
        logging.getLogger("lightning_mixedfsdp").removeHandler(handler)
    return {**out, "warnings": messages}


class _Collect:
    level = 0

    def __init__(self, messages: List[str]) -> None:
        self.messages = messages

    def handle(self, record: Any) -> None:
        self.messages.append(record.getMessage())


def _scenarios(rank: int, world: int, folder: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    torch.manual_seed(0)
    out["near_7"] = _monitored(world, _llama_with_norm_at(7.0), {}, keep_fp32_modules=[])
    rules = list(out["near_7"]["named"].values())
    torch.manual_seed(0)
    out["near_7_kept"] = _monitored(world, _llama_with_norm_at(7.0), {}, keep_fp32_modules=[], keep_fp32_params=rules)
    torch.manual_seed(0)
    out["default"] = _monitored(world, tiny_model("llama"), {})
    weight = "model.layers.0.mlp.down_proj.weight"
    for name, lr in (("tiny_lr", 1e-7), ("large_lr", 1e-2)):
        torch.manual_seed(0)
        out[name] = _monitored(world, tiny_model("llama"), {weight: lr})
    torch.manual_seed(0)
    # the names the monitor sees are dynamo's wrapping (``_orig_mod``), whatever compiles the graphs: the eager
    # backend keeps this launch short; inductor compiles in tests/composed/test_compose.py
    nn_compile = torch.nn.Module.compile
    torch.nn.Module.compile = functools.partialmethod(nn_compile, backend="eager")  # type: ignore[method-assign]
    try:
        out["wrapped"] = _monitored(
            world, _llama_with_norm_at(7.0), {}, keep_fp32_modules=[], activation_checkpointing="full", compile=True
        )
    finally:
        torch.nn.Module.compile = nn_compile  # type: ignore[method-assign]
    out["lora"] = _lora(world)
    out["set_updates"] = _set_updates(rank, world)
    out["trainer"] = _trainer(Path(folder))
    out["manifest"] = _manifest(world, Path(folder))
    return out


def _lora(world: int) -> Dict[str, Any]:
    """peft LoRA on a frozen bf16 Llama: only the adapters are trainable, so only they are measured."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    out = _monitored(world, model, {})
    return {**out, "trainable": len(trainable)}


def _c(count: int) -> torch.Tensor:
    return torch.linspace(0.5, 2.0, count)


class _Pinned(nn.Module):
    """A unit whose fp32 (pinned) weight outweighs its bf16 ``scale``: the bf16 minority is replicated."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.pinned = nn.Linear(dim, dim, bias=False)
        self.scale = nn.Parameter(torch.logspace(-2, 1.2, dim))

    def forward(self) -> torch.Tensor:
        return (self.scale.float() * _c(self.scale.numel())).sum() + 0.0 * self.pinned.weight.float().sum()


class _Plain(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.logspace(-3, 1.5, dim * dim).reshape(dim, dim))

    def forward(self) -> torch.Tensor:
        return (self.weight.float() * _c(self.weight.numel()).reshape(self.weight.shape)).sum()


class _FixedGradient(nn.Module):
    """``loss = sum(param * c)`` for fixed ``c`` in [0.5, 2]: each element's gradient is its ``c`` on every rank."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.units = nn.ModuleList([_Plain(dim), _Pinned(dim)])

    def forward(self) -> torch.Tensor:
        return sum((unit() for unit in self.units), torch.zeros(()))


def _set_updates(rank: int, world: int) -> Dict[str, Any]:
    from lightning_mixedfsdp import PrecisionMonitor
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    strategy = MixedFSDP2Strategy(keep_fp32_modules=[], keep_fp32_params=[r"pinned\.weight$"])
    fabric = make_fabric(world, "bf16-true", strategy)
    model = fabric.setup(_FixedGradient())
    plan = fabric.strategy.plan_of(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=2e-3))
    monitor = PrecisionMonitor(every_n_steps=1)
    shares = []
    for step in range(3):
        fabric.backward(model())
        with monitor.around_step(model, optimizer, step):
            optimizer.step()
        optimizer.zero_grad()
        shares.append({name: share.share for name, share in monitor.watch.latest.items()})
    placement = {name: "replicated" if p.replicated else "sharded" for name, p in plan.params.items()}
    return {
        "shares": shares,
        "placement": placement,
        "updates": {n: s.mean_abs_update for n, s in monitor.watch.latest.items()},
    }


def _one_process_set_updates(rank: int, world: int) -> Dict[str, Any]:
    return _set_updates(rank, world)


def _trainer(folder: Path) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mixedfsdp import PrecisionMonitor
    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = _llama_with_norm_at(7.0)

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)

    monitor = PrecisionMonitor(every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=MixedFSDP2Strategy(keep_fp32_modules=[]), precision="bf16-true",
        max_steps=12, logger=CSVLogger(folder, name="monitor"), callbacks=[monitor], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LM(), torch.utils.data.DataLoader(TOKENS.repeat(6, 1), batch_size=2))
    return {"named": monitor.named, "samples": monitor.samples, "summary": monitor.summary()}


def _manifest(world: int, folder: Path) -> Dict[str, Any]:
    from lightning_mixedfsdp.checkpoint.manifest import export_manifest
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world, "bf16-true", MixedFSDP2Strategy())
    model = fabric.setup(tiny_model("llama"))
    saved = fabric.strategy.plan_of(model).keep_fp32_manifest
    fabric.save(folder / "checkpoint", {"model": model})
    fabric.strategy.export_safetensors(model, folder / "export")
    out: Dict[str, Any] = {"saved": saved, "exported": export_manifest(folder / "export")}
    for name, options in (("same", {}), ("other", {"keep_fp32_params": [r"mlp\.down_proj\.weight$"]})):
        target = make_fabric(world, "bf16-true", MixedFSDP2Strategy(**options))
        other = target.setup(tiny_model("llama", seed=3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target.load(folder / "checkpoint", {"model": other})
        out[name] = [str(w.message) for w in caught if "keep-fp32 rules" in str(w.message)]
    return out


LAUNCH = Launch(_scenarios, WORLD, timeout=400)


def test_a_bf16_param_near_7_with_updates_of_1e_3_is_named_with_the_rule(results: list) -> None:
    near = results[0]["near_7"]
    assert near["named"]["model.norm.weight"] == r"^model\.norm\.weight$"
    warning = next(w for w in near["warnings"] if "model.norm.weight" in w)
    assert (
        "bfloat16 numbers are 0.0312 apart" in warning and "keep_fp32_params=['^model\\\\.norm\\\\.weight$']" in warning
    )
    found = re.search(r"the optimizer's update is about ([\d.e-]+) per element", warning)
    assert found is not None and 1e-4 < float(found.group(1)) < 0.0312 / 2  # AdamW at 1e-3: under half the spacing
    assert near["metrics"]["stalled_share/model.norm.weight"] == 1.0
    assert results[1]["near_7"]["named"] == near["named"]  # every rank agrees
    assert [r for r in results if r["near_7"]["warnings"]] == [results[0]]  # rank 0 warns


def test_kept_fp32_by_the_suggested_rules_nothing_is_named(results: list) -> None:
    kept = results[0]["near_7_kept"]
    assert kept["named"] == {} and kept["warnings"] == []
    assert "stalled_share/model.norm.weight" not in kept["metrics"]  # fp32 now: not measured


def test_a_default_bf16_llama_at_lr_1e_3_raises_no_false_alarm(results: list) -> None:
    default = results[0]["default"]
    assert default["samples"] == STEPS and default["named"] == {}
    assert max(default["metrics"].values()) < 0.5


def test_a_weight_frozen_by_a_tiny_learning_rate_is_named_and_at_a_large_one_is_not(results: list) -> None:
    assert "model.layers.0.mlp.down_proj.weight" in results[0]["tiny_lr"]["named"]
    assert results[0]["large_lr"]["named"] == {}


@pytest.fixture(scope="module")
def one_process() -> Dict[str, Any]:
    return run_distributed(_one_process_set_updates, 1, timeout=200)[0]


def test_set_updates_stall_in_equal_shares_on_two_ranks_and_in_one_process(results: list, one_process: Dict) -> None:
    two = results[0]["set_updates"]
    assert two["placement"]["units.0.weight"] == "sharded" and two["placement"]["units.1.scale"] == "replicated"
    assert two["shares"] == one_process["shares"] == results[1]["set_updates"]["shares"]
    last = two["shares"][-1]
    assert 0.2 < last["units.0.weight"] < 0.9 and 0.2 < last["units.1.scale"] < 0.9  # some elements stall, not all
    assert two["updates"]["units.0.weight"] == pytest.approx(2e-3 * 1.25, rel=1e-3)  # lr x mean |c|


def test_the_trainer_callback_logs_the_shares_and_names_the_param(results: list, tmp_path: Path) -> None:
    trainer = results[0]["trainer"]
    assert "model.model.norm.weight" in trainer["named"] and trainer["samples"] == 6
    assert "stalled: " in trainer["summary"]


def test_the_manifest_rides_with_checkpoints_and_exports_and_a_changed_rule_set_warns(results: list) -> None:
    manifest = results[0]["manifest"]
    assert manifest["saved"]["model.norm.weight"] == "module:RMSNorm"
    assert manifest["exported"] == manifest["saved"]
    assert manifest["same"] == []
    (warning,) = manifest["other"]
    assert "now kept fp32: model.layers.0.mlp.down_proj.weight (param:mlp\\.down_proj\\.weight$)" in warning
    assert results[1]["manifest"]["other"] == []  # rank 0 warns


def test_bad_monitor_settings_are_refused_all_at_once_with_the_fix() -> None:
    from lightning_mixedfsdp import PrecisionMonitor

    with pytest.raises(
        ValueError,
        match=r"PrecisionMonitor: every_n_steps=0 must be an int >= 1; threshold=1.5 must be in \[0, 1\), e\.g\. 0\.5;"
        r" patience=0 must be an int >= 1\.",
    ):
        PrecisionMonitor(every_n_steps=0, threshold=1.5, patience=0)


def test_a_recipes_monitor_settings_out_of_range_are_refused() -> None:
    from lightning_mixedfsdp.recipes.run.loader import load_recipe
    from lightning_mixedfsdp.recipes.settings.schema import RecipeError

    with pytest.raises(RecipeError, match=r"monitor.every_n_steps=-1 \(>= 0; 0 is off\).*fix the one out of range"):
        load_recipe(None, ["monitor.every_n_steps=-1"], launching=False)


def test_the_dtype_report_shows_the_latest_shares(results: list) -> None:
    report = results[0]["near_7"]["report"]
    header = next(line for line in report.splitlines() if line.startswith("parameter"))
    assert header.rstrip().endswith("stalled")
    row = next(line for line in report.splitlines() if line.startswith("model.norm.weight "))
    assert row.rstrip().endswith("100%")


def test_through_activation_checkpointing_and_compile_the_names_are_the_models(results: list) -> None:
    wrapped = results[0]["wrapped"]
    assert wrapped["named"]["model.norm.weight"] == r"^model\.norm\.weight$"
    assert wrapped["metrics"] and not any("_wrapped" in k or "_orig_mod" in k for k in wrapped["metrics"])
    assert wrapped["metrics"].keys() == results[0]["near_7"]["metrics"].keys()


def test_under_peft_lora_only_the_adapters_are_measured(results: list) -> None:
    lora = results[0]["lora"]
    assert len(lora["metrics"]) == lora["trainable"] == 8  # A and B of q and v in 2 layers
    assert all(".lora_A." in k or ".lora_B." in k for k in lora["metrics"])
    assert lora["named"] == {}
