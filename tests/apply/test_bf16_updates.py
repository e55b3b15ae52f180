"""``dtypes.bf16_updates``: bf16 params under ``bf16-true`` whose fp32 updates are written back stochastically rounded
or Kahan-compensated, against plain PyTorch on fp32 params. One launch of 2 ranks holds every distributed check;
refusals before launch run in this process."""

import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from lightning_mixedfsdp.model.tensors import local_tensor
from lightning_mixedfsdp.testing import run_distributed

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

SPACING_AT_7 = 2.0**-5  # bf16's spacing in [4, 8)
SINGLE_STEPS, SINGLE_LR = 200, 1e-4
GAP_STEPS = 100


def _fabric(world: int, precision: str = "bf16-true", **options: Any) -> Any:
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=MixedFSDP2Strategy(**options), precision=precision)
    fabric.launch()
    return fabric


def _state_bytes(optimizer: Any, param: Any) -> float:
    """The optimizer's state bytes per local element of ``param``."""

    state = [local_tensor(t) for t in optimizer.state[param].values() if isinstance(t, torch.Tensor) and t.dim()]
    return sum(t.numel() * t.element_size() for t in state) / local_tensor(param).numel()


# -- a single param near 7 under a steady gradient: bf16 spacing 1/32, updates about lr = 1e-4 per step


def _single_param(world: int, method: str, betas: Tuple[float, float], monitored: bool = False) -> Dict[str, Any]:
    from lightning_mixedfsdp import PrecisionMonitor

    fabric = _fabric(world, bf16_updates=method, keep_fp32_modules=[])
    model = fabric.setup_module(nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        local_tensor(model.weight).fill_(7.0)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=SINGLE_LR, betas=betas))
    # an LR scheduler built after setup wraps the step the strategy installed (a constant rate here)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0)
    reference = torch.full((64, 64), 7.0, requires_grad=True)  # plain PyTorch, fp32
    reference_optimizer = torch.optim.AdamW([reference], lr=SINGLE_LR, betas=betas)
    monitor = PrecisionMonitor(every_n_steps=1, patience=2)
    inputs = torch.ones(2, 64, dtype=torch.bfloat16)
    farthest = drift = 0.0
    for step in range(SINGLE_STEPS):
        fabric.backward(model(inputs).float().sum())
        (reference * 2.0).sum().backward()  # the same gradient: 2 rows of ones
        if monitored:
            with monitor.around_step(model, optimizer, step):
                optimizer.step()
        else:
            optimizer.step()
        reference_optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        farthest = max(farthest, (model.weight.full_tensor().float() - reference.detach()).abs().max().item())
        drift = max(drift, (_represented(model.weight, optimizer) - reference.detach()).abs().max().item())
    return {
        "moved": (7.0 - model.weight.full_tensor().double()).mean().item(),
        "fp32_moved": (7.0 - reference.detach().double()).mean().item(),
        "farthest_from_fp32": farthest,
        "compensated_drift": drift,
        "state_bytes": _state_bytes(optimizer, model.weight),
        "named": dict(monitor.named),
        "shares": dict(monitor.shares),
    }


def _represented(param: Any, optimizer: Any) -> torch.Tensor:
    """The whole param as fp32, its Kahan compensation added where it has one."""
    value = param.full_tensor().float()
    compensation = optimizer.state[param].get("compensation")
    return value + compensation.full_tensor().float() if compensation is not None else value


# -- Adam (L2 decay) and SGD (momentum, Nesterov, decay) against PyTorch on fp32, through Kahan's represented value


def _other_optimizers(world: int) -> Dict[str, float]:
    out = {}
    makers = {
        "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
        "Adam": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1),
        "SGD": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, nesterov=True, weight_decay=0.01),
        "SGD, no momentum": lambda params: torch.optim.SGD(params, lr=1e-3),
    }
    for name, make in makers.items():
        torch.manual_seed(0)
        start = torch.randn(64, 64) * 3
        fabric = _fabric(world, bf16_updates="kahan", keep_fp32_modules=[])
        linear = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            linear.weight.copy_(start)
        model = fabric.setup_module(linear)
        optimizer = fabric.setup_optimizers(make(model.parameters()))
        reference = start.to(torch.bfloat16).float().requires_grad_(True)
        reference_optimizer = make([reference])
        inputs = torch.linspace(-1, 1, 128).reshape(2, 64)
        for _ in range(30):
            fabric.backward(model(inputs.to(torch.bfloat16)).float().square().sum() / 100)
            grad = model.weight.grad.full_tensor().float()
            reference.grad = grad  # the same gradient: what differs is the update's arithmetic and write-back
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
        error = (_represented(model.weight, optimizer) - reference.detach()).abs().mean()
        out[name] = (error / (reference.detach() - start.to(torch.bfloat16).float()).abs().mean()).item()
        out[f"{name} bytes"] = _state_bytes(optimizer, model.weight)
    return out


# -- a tiny HF Llama's held-out loss after 100 AdamW steps, each method against fp32 masters


def _stdlib_bytes() -> torch.Tensor:
    import argparse
    import inspect
    import json
    import string
    import textwrap

    text = b"".join(Path(module.__file__).read_bytes() for module in (json, inspect, argparse, textwrap, string))
    return torch.tensor(list(text), dtype=torch.long)


def _held_out_loss(world: int, precision: str, method: str) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    fabric = _fabric(world, precision, bf16_updates=method)
    fabric.seed_everything(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    with fabric.init_module():
        model = fabric.setup_module(LlamaForCausalLM(config))
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    )
    data = _stdlib_bytes()
    train, held_out = data[:-20000], data[-20000:]
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(GAP_STEPS):
        starts = torch.randint(0, len(train) - 65, (4,), generator=generator)
        rows = torch.stack([train[s : s + 64] for s in starts])
        fabric.backward(model(input_ids=rows, labels=rows).loss)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # 256 held-out rows: the evaluation's own noise well under the gaps compared
        rows = held_out[: 256 * 64].reshape(256, 64)
        return model(input_ids=rows, labels=rows).loss.float().item()


# -- HSDP: 2 replicas x 1 shard, each rank its own data; stochastic rounding must leave the replicas bitwise equal


def _replicas(world: int) -> List[bool]:
    import torch.distributed as dist

    fabric = _fabric(world, bf16_updates="stochastic", data_parallel_replicate_size=2, keep_fp32_modules=[])
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 1, bias=False)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    equal = []
    for _ in range(8):
        rows = torch.randn(4, 32, generator=generator).to(torch.bfloat16)
        fabric.backward(model(rows).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        mine = torch.cat([p.full_tensor().view(torch.int16).flatten() for p in model.parameters()]).int()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        equal.append(all(torch.equal(gathered[0], other) for other in gathered[1:]))
    return equal


# -- a checkpoint round trip of the Kahan buffer (sharded, bitwise) and the fp32 second moment


def _checkpoint_round_trip(world: int, folder: Path) -> Dict[str, Any]:

    def built() -> Tuple[Any, Any, Any]:
        fabric = _fabric(world, bf16_updates="kahan", keep_fp32_modules=[])
        torch.manual_seed(0)
        model = fabric.setup_module(nn.Linear(64, 64, bias=False))
        return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))

    fabric, model, optimizer = built()
    for _ in range(3):
        fabric.backward(model(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum())
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(folder / "kahan", {"model": model, "optimizer": optimizer})
    saved = {k: local_tensor(v).clone() for k, v in optimizer.state[model.weight].items() if v.dim()}
    fabric, model, optimizer = built()
    fabric.load(folder / "kahan", {"model": model, "optimizer": optimizer})
    state = optimizer.state[model.weight]
    return {
        "equal": {k: torch.equal(local_tensor(state[k]), v) for k, v in saved.items()},
        "dtypes": {k: str(state[k].dtype) for k in saved},
        "placement": str(state["compensation"].placements),
        "local_rows": local_tensor(state["compensation"]).shape[0],
        "group": optimizer.param_groups[0]["bf16_updates"],
    }


# -- the recipe runner (the Trainer): a run resumed from step 2 repeats the straight run's losses bitwise


def _recipe_losses(world: int, folder: Path, method: str) -> Dict[str, List[float]]:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.recipes.run import runner
    from lightning_mixedfsdp.recipes.run.loader import load_recipe

    scheduler_warnings: List[str] = []

    def fit(output: Path, checkpoint: Any = None) -> List[float]:
        losses: List[float] = []

        class Losses(pl.Callback):
            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
                losses.append(outputs["loss"].item())

        runner.monitors = lambda recipe: [Losses()]  # type: ignore[assignment]  # this process's runner only
        # the recipe's LambdaLR wraps the optimizer's step before the strategy installs its own: it must still see
        # each step (no "overridden after learning rate scheduler initialization" or "before optimizer.step()")
        overrides = [
            "trainer.accelerator=cpu", f"trainer.devices={world}", "trainer.max_steps=4",
            "trainer.val_check_interval=4", "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=4",
            "model.dim=32", "model.hidden_dim=64", "model.n_layers=2", "data.seq_len=32", "data.batch_size=2",
            "data.val_windows=2", "data.max_bytes=40000", "optimizer.lr=0.001",
            f"strategy.dtypes.bf16_updates={method}", f"output.dir={output}",
        ]  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.run(load_recipe(None, overrides, launching=False), checkpoint)
        scheduler_warnings.extend(str(w.message) for w in caught if "lr_scheduler" in str(w.message))
        return losses

    from safetensors import safe_open

    straight = fit(folder / f"straight_{method}")
    resumed = fit(folder / f"resumed_{method}", folder / f"straight_{method}" / "checkpoints" / "step=2.ckpt")
    with safe_open(str(folder / f"straight_{method}" / "export" / "model.safetensors"), "pt") as export:
        metadata = export.metadata()
    export_says = metadata.get("mixed_fsdp2_bf16_updates")
    return {"straight": straight, "resumed": resumed, "export_says": export_says, "warnings": scheduler_warnings}


def _added_group(world: int) -> float:
    """A layer added to the optimizer after setup (``add_param_group``, as ``BaseFinetuning`` unfreezes one): its bf16
    weight at 7 moves by its updates of 1e-4 too (rounded to nearest it would stay at 7)."""
    fabric = _fabric(world, bf16_updates="stochastic", keep_fp32_modules=[])
    model = fabric.setup_module(nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)))
    with torch.no_grad():
        local_tensor(model.module[1].weight).fill_(7.0)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.module[0].parameters(), lr=1e-4, weight_decay=0.0))
    optimizer.add_param_group({"params": list(model.module[1].parameters())})
    for _ in range(40):
        fabric.backward(model(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum())
        optimizer.step()
        optimizer.zero_grad()
    return (7.0 - model.module[1].weight.full_tensor().double()).abs().mean().item()


def _refused(world: int) -> Dict[str, str]:
    out = {}
    for name, make in {
        "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
        "amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
    }.items():
        fabric = _fabric(world, bf16_updates="stochastic", keep_fp32_modules=[])
        model = fabric.setup_module(nn.Linear(64, 64, bias=False))
        with pytest.raises(ValueError) as error:
            fabric.setup_optimizers(make(model.parameters()))
        out[name] = str(error.value)
    return out


def _two_ranks(rank: int, world: int, folder: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {"single": {}, "gap": {}}
    for method, betas in [
        ("nearest", (0.9, 0.95)), ("stochastic", (0.9, 0.95)), ("kahan", (0.9, 0.95)), ("stochastic", (0.9, 0.999)),
    ]:  # fmt: skip
        out["single"][method, betas] = _single_param(world, method, betas, monitored=True)
    out["other_optimizers"] = _other_optimizers(world)
    for precision, method in [
        ("bf16-mixed", "nearest"), ("bf16-true", "nearest"), ("bf16-true", "stochastic"), ("bf16-true", "kahan"),
    ]:  # fmt: skip
        out["gap"][method if precision == "bf16-true" else "fp32 masters"] = _held_out_loss(world, precision, method)
    out["replicas_equal"] = _replicas(world)
    out["checkpoint"] = _checkpoint_round_trip(world, Path(folder))
    out["recipe"] = {method: _recipe_losses(world, Path(folder), method) for method in ("stochastic", "kahan")}
    out["refused"] = _refused(world)
    out["added_group_moved"] = _added_group(world)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp("bf16_updates")), timeout=900)


def test_a_param_near_7_moves_as_fp32_stochastically_and_within_a_spacing_compensated(runs: List[Dict]) -> None:
    single = runs[0]["single"]
    fp32 = single["nearest", (0.9, 0.95)]["fp32_moved"]
    # AdamW under a steady gradient: lr a step, and its default decay (0.01) of 7 is part of the update
    assert fp32 == pytest.approx(SINGLE_STEPS * SINGLE_LR * (1 + 0.01 * 7), rel=0.01)
    assert single["nearest", (0.9, 0.95)]["moved"] == 0.0  # every update under half the spacing rounds away
    # 4,096 elements: the standard error of the mean movement is under 1 % of fp32's here; 3 % is the bound
    assert single["stochastic", (0.9, 0.95)]["moved"] == pytest.approx(fp32, rel=0.03)
    assert single["stochastic", (0.9, 0.999)]["moved"] == pytest.approx(fp32, rel=0.03)  # torch's default betas
    kahan = single["kahan", (0.9, 0.95)]
    assert kahan["farthest_from_fp32"] <= SPACING_AT_7  # the param alone, at every step: within one spacing
    # param + buffer: closer, down to the buffer's own bf16 floor (each write loses up to half its last bit)
    assert kahan["compensated_drift"] <= SPACING_AT_7 / 8


def test_adamw_adam_and_sgd_follow_pytorchs_fp32_trajectory_through_the_compensated_value(runs: List[Dict]) -> None:
    other = runs[0]["other_optimizers"]
    for name in ("AdamW", "Adam", "SGD", "SGD, no momentum"):
        # the mean distance from fp32's trajectory against the mean movement: the buffer's floor and the bf16
        # first moment's rounding (measured 0.05-0.4 %)
        assert other[name] < 0.01, name


def test_the_state_bytes_per_element_stay_within_the_limits(runs: List[Dict]) -> None:
    from lightning_mixedfsdp.apply.bf16_updates import state_bytes_per_element
    from lightning_mixedfsdp.planning.memory import ADAMW_BF16_STATE_BYTES

    single, other = runs[0]["single"], runs[0]["other_optimizers"]
    for method in ("nearest", "stochastic", "kahan"):
        measured = single[method, (0.9, 0.95)]["state_bytes"]
        assert measured == state_bytes_per_element(method, "AdamW") == ADAMW_BF16_STATE_BYTES[method]
    assert single["stochastic", (0.9, 0.95)]["state_bytes"] == 6 and single["kahan", (0.9, 0.95)]["state_bytes"] == 8
    assert other["SGD bytes"] == 6 and other["SGD, no momentum bytes"] == 2  # an fp32 momentum, the buffer


def test_a_tiny_llama_learns_as_with_fp32_masters_under_either_method(runs: List[Dict]) -> None:
    gap = runs[0]["gap"]
    nearest = gap["nearest"] - gap["fp32 masters"]
    assert nearest > 0.02  # what rounding to nearest loses at lr 1e-4
    for method in ("stochastic", "kahan"):
        # under a fifth of nearest's gap to fp32 masters. Ending below them happens: bf16-mixed also computes its
        # forward otherwise (autocast), and one seed's noise is of the gaps' order (measured on torch 2.13: nearest
        # +0.071, stochastic -0.005, kahan -0.0005; on 2.11: nearest +0.024, stochastic -0.032)
        assert gap[method] - gap["fp32 masters"] < 0.2 * nearest, method


def test_stochastic_rounding_leaves_the_replicas_bitwise_equal_after_every_step(runs: List[Dict]) -> None:
    for rank in runs:
        assert rank["replicas_equal"] == [True] * 8


def test_the_kahan_buffer_is_sharded_and_round_trips_bitwise_through_a_checkpoint(runs: List[Dict]) -> None:
    for rank in runs:
        checkpoint = rank["checkpoint"]
        assert checkpoint["equal"] == {"exp_avg": True, "exp_avg_sq": True, "compensation": True}
        assert checkpoint["dtypes"] == {
            "exp_avg": "torch.bfloat16", "exp_avg_sq": "torch.float32", "compensation": "torch.bfloat16",
        }  # fmt: skip
        assert checkpoint["placement"] == "(Shard(dim=0),)" and checkpoint["local_rows"] == 32
        assert checkpoint["group"] == "kahan"


def test_a_resumed_recipe_repeats_the_straight_runs_losses_bitwise(runs: List[Dict]) -> None:
    for rank in runs:
        for method in ("stochastic", "kahan"):
            straight, resumed = rank["recipe"][method]["straight"], rank["recipe"][method]["resumed"]
            assert len(straight) == 4 and resumed == straight[2:], method
            assert rank["recipe"][method]["export_says"] == method
            assert rank["recipe"][method]["warnings"] == []


def test_the_monitor_names_no_compensated_param_and_still_names_the_nearest_one(runs: List[Dict]) -> None:
    single = runs[0]["single"]
    assert list(single["nearest", (0.9, 0.95)]["named"]) == ["weight"]
    for method in ("stochastic", "kahan"):
        assert single[method, (0.9, 0.95)]["named"] == {}, method
        assert single[method, (0.9, 0.95)]["shares"]["weight"] == 0.0, method


def test_a_param_group_added_after_setup_is_written_back_too(runs: List[Dict]) -> None:
    # 40 updates of about 1e-4 each, of a steady sign per element (AdamW's step under a gradient that barely
    # changes): each element moves a spacing (1/32) with probability 0.13, none rounded to nearest
    assert runs[0]["added_group_moved"] == pytest.approx(40 * 1e-4, rel=0.2)


def test_an_optimizer_it_does_not_reproduce_is_refused_with_the_supported_list(runs: List[Dict]) -> None:
    refused = runs[0]["refused"]
    assert "torch.optim.rmsprop.RMSprop is none of them. Use one of those" in refused["RMSprop"]
    assert "does not reproduce AdamW(amsgrad=True); set amsgrad=False" in refused["amsgrad"]


def test_a_precision_with_fp32_masters_is_refused_before_launch() -> None:
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    with pytest.raises(ValueError, match="precision='bf16-mixed' .* stores them in fp32, as masters"):
        Fabric(accelerator="cpu", devices=2, strategy=MixedFSDP2Strategy(bf16_updates="kahan"), precision="bf16-mixed")


def test_a_recipe_with_fp32_masters_and_bf16_updates_is_refused() -> None:
    from lightning_mixedfsdp.recipes.run.loader import load_recipe
    from lightning_mixedfsdp.recipes.settings.schema import RecipeError

    with pytest.raises(RecipeError, match="strategy.dtypes.bf16_updates='stochastic' writes updates into params"):
        load_recipe(None, ["trainer.precision=bf16-mixed", "strategy.dtypes.bf16_updates=stochastic"])


def test_the_dry_run_shows_the_method_and_its_bytes_and_counts_them(capsys: pytest.CaptureFixture) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main

    config = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama3_70b.json"
    base = ["--hf-config", str(config), "--world-size", "64"]
    runs = {method: main([*base, "--bf16-updates", method]) for method in ("nearest", "kahan")}
    printed = capsys.readouterr().out
    assert "bf16_updates kahan: the updates of" in printed and "AdamW keeps 8 bytes per element" in printed
    # the bf16 bulk's AdamW state: 4 bytes an element rounding to nearest, 8 with Kahan's buffer
    bulk = sum(p.nbytes for p in runs["kahan"]["plan"].params.values() if p.key.storage == torch.bfloat16) / 64
    grown = runs["kahan"]["estimate"].optimizer - runs["nearest"]["estimate"].optimizer
    assert grown == pytest.approx(bulk / 2 * 4, rel=0.01)
    with pytest.raises(SystemExit, match="--bf16-updates: dtypes.bf16_updates=.kahan. writes updates into params"):
        main([*base, "--bf16-updates", "kahan", "--precision", "bf16-mixed"])
