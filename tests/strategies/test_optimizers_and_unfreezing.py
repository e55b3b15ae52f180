"""What users do with optimizers and frozen modules around setup, on 2 ranks:

- ``fabric.setup(model, optimizer)`` with the optimizer built before setup (Fabric's most common idiom) trains equal to
  the separate setup, its param groups and hyperparameters kept; an optimizer that stepped before is refused;
- whole-matrix optimizers (``Adafactor``, a Muon subclass with a step of its own) on sharded params are refused on
  every rank; ``torch.optim.Muon`` is taken over (``tests/apply/test_muon.py``); SGD with momentum trains;
- a module frozen at setup and unfrozen later under ``bf16-mixed`` (no fp32 master) is refused at the next forward on
  every rank with the fix; with ``pin_frozen_modules=False`` it trains with fp32 masters; under ``32-true`` the
  unfreeze trains; Lightning's ``BackboneFinetuning`` on the Trainer likewise."""

from typing import Any, Callable, Dict

import torch
from torch import nn

from lightning_mixedfsdp.testing import accelerator_for
from tests.conftest import Launch
from tests.hf_models import tiny_model
from tests.scenarios import full_params, make_fabric, train_hf_steps

WORLD = 2


def _error(action: Callable[[], Any]) -> str:
    try:
        action()
    except ValueError as failure:
        return str(failure)
    return "no error"


def _grouped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with their own learning rates, as users write them."""
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    others = [p for name, p in model.named_parameters() if "norm" not in name]
    return torch.optim.AdamW([{"params": norms, "lr": 1e-3}, {"params": others}], lr=1e-2, weight_decay=0.01)


def _joint_setup(world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    fabric = make_fabric(world, "32-true")
    model = tiny_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, optimizer = fabric.setup(model, _grouped_adamw(model))
    train_hf_steps(fabric, model, optimizer, 3)
    out["joint"] = full_params(model)
    out["before"] = before
    out["lrs"] = [group["lr"] for group in optimizer.param_groups]
    fabric = make_fabric(world, "32-true")
    model = fabric.setup(tiny_model("llama"))
    optimizer = fabric.setup_optimizers(_grouped_adamw(model))
    train_hf_steps(fabric, model, optimizer, 3)
    out["separate"] = full_params(model)
    # an optimizer that stepped before setup holds state of the unsharded params
    stale_model = tiny_model("llama")
    stale = torch.optim.AdamW(stale_model.parameters(), lr=1e-2)
    stale_model(
        input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)
    ).loss.backward()
    stale.step()
    out["stepped"] = _error(lambda: fabric.setup(stale_model, stale))
    return out


class _MyMuon(torch.optim.Muon):
    """A user's Muon variant with a step of its own: its math is not torch's Muon, so it is refused, not taken over."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


def _whole_matrix_optimizers(world: int) -> Dict[str, str]:
    fabric = make_fabric(world, "32-true")
    torch.manual_seed(0)
    model = fabric.setup(nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)))
    out = {
        kind.__name__: _error(lambda kind=kind: fabric.setup_optimizers(kind(model.parameters(), lr=1e-2)))
        for kind in (torch.optim.Adafactor, _MyMuon)
    }
    out["Muon"] = _error(lambda: fabric.setup_optimizers(torch.optim.Muon(model.parameters(), lr=1e-2)))
    sgd = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    fabric.backward(model(torch.randn(4, 64)).square().mean())
    sgd.step()
    out["SGD"] = "trained"
    return out


def _unfreeze_run(world: int, precision: str, **options: Any) -> Dict[str, Any]:
    """An HF Llama whose layer 0 is frozen at setup, unfrozen after one step as BaseFinetuning does it."""
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    fabric = make_fabric(world, precision, MixedFSDP2Strategy(**options))
    model = tiny_model("llama")
    model.model.layers[0].requires_grad_(False)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    train_hf_steps(fabric, model, optimizer, 1)
    layer = model.model.layers[0]
    before = {name: p.full_tensor().float().clone() for name, p in layer.named_parameters()}
    layer.requires_grad_(True)
    optimizer.add_param_group({"params": list(layer.parameters()), "lr": 1e-2})
    out: Dict[str, Any] = {"error": _error(lambda: train_hf_steps(fabric, model, optimizer, 3, start=1))}
    out["dtypes"] = {str(p.dtype) for p in layer.parameters()}
    if out["error"] == "no error":
        after = {name: p.full_tensor().float() for name, p in layer.named_parameters()}
        out["moved"] = all(not torch.equal(after[name], before[name]) for name in before)
        out["state_dtypes"] = {str(optimizer.state[p]["exp_avg"].dtype) for p in layer.parameters()}
    return out


def _backbone_finetuning(world: int, **options: Any) -> Dict[str, Any]:
    """Lightning's BackboneFinetuning on the Trainer under bf16-mixed: the backbone frozen at setup, unfrozen at the
    second epoch."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BackboneFinetuning

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32))
            self.head = nn.Linear(32, 4)
            self.initial = {n: p.detach().clone() for n, p in self.backbone.named_parameters()}

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    class DTensorBackboneFinetuning(BackboneFinetuning):
        """Lightning's callback, with its duplicate filter comparing params by identity: Lightning's compares them by
        value (``torch.equal``), which DTensor params of other shapes cannot answer (docs/training.md)."""

        @staticmethod
        def unfreeze_and_add_param_group(
            modules: Any, optimizer: Any, lr: Any = None, initial_denom_lr: float = 10.0, train_bn: bool = True
        ) -> None:
            BackboneFinetuning.make_trainable(modules)
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            params = BackboneFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
            params = [p for p in params if id(p) not in held]
            rate = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
            if params:
                optimizer.add_param_group({"params": params, "lr": rate})

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,)))
    trainer = pl.Trainer(
        accelerator=accelerator_for(world),
        devices=world,
        strategy=MixedFSDP2Strategy(**options),
        precision="bf16-mixed",
        max_epochs=2,
        callbacks=[DTensorBackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Classifier()
    out: Dict[str, Any] = {
        "error": _error(lambda: trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8)))
    }
    if out["error"] == "no error":
        after = full_params(module.backbone)
        out["dtypes"] = {str(p.dtype) for p in module.backbone.parameters()}
        out["moved"] = all(not torch.equal(after[n], module.initial[n]) for n in module.initial)
    return out


def _scenarios(rank: int, world: int, folder: str) -> Dict[str, Any]:
    return {
        "joint": _joint_setup(world),
        "whole_matrix": _whole_matrix_optimizers(world),
        "unfreeze_pinned": _unfreeze_run(world, "bf16-mixed"),
        "unfreeze_unpinned": _unfreeze_run(world, "bf16-mixed", pin_frozen_modules=False),
        "unfreeze_32": _unfreeze_run(world, "32-true"),
        "backbone_pinned": _backbone_finetuning(world),
        "backbone_unpinned": _backbone_finetuning(world, pin_frozen_modules=False),
    }


LAUNCH = Launch(_scenarios, WORLD, timeout=300)


def test_joint_setup_trains_as_the_separate_setup_does(results: list) -> None:
    for result in results:
        joint = result["joint"]
        assert joint["joint"].keys() == joint["separate"].keys()
        for name, value in joint["separate"].items():
            assert torch.equal(joint["joint"][name], value), name
        moved = [n for n, value in joint["before"].items() if not torch.equal(joint["joint"][n], value)]
        assert len(moved) == len(joint["before"])  # every weight trained
        assert joint["lrs"] == [1e-3, 1e-2]  # the groups and their hyperparameters kept


def test_joint_setup_refuses_an_optimizer_that_stepped_before(results: list) -> None:
    for result in results:
        message = result["joint"]["stepped"]
        assert "MixedFSDP2Strategy: `setup(model, optimizer)` got an optimizer with state already" in message
        assert "then call `setup_optimizers(optimizer)`" in message


def test_whole_matrix_optimizers_on_shards_are_refused_on_every_rank(results: list) -> None:
    for result in results:
        refused = result["whole_matrix"]
        assert "orthogonalises each 2-D update over the whole matrix" in refused["_MyMuon"]
        assert "(64, 64) param split over 2 ranks" in refused["_MyMuon"]
        assert "Use an elementwise optimizer (torch.optim.AdamW, Adam, SGD, ...)" in refused["_MyMuon"]
        assert "factors each matrix's second moment" in refused["Adafactor"]
        assert refused["Muon"] == "no error"  # taken over: each matrix orthogonalised whole
        assert refused["SGD"] == "trained"
    assert results[0]["whole_matrix"] == results[1]["whole_matrix"]


def test_a_pinned_module_unfrozen_after_setup_is_refused_on_every_rank(results: list) -> None:
    for result in results:
        message = result["unfreeze_pinned"]["error"]
        assert "mixed_fsdp2: modules frozen at setup are trainable now (LlamaForCausalLM: model.layers.0" in message
        assert "with no fp32 master" in message and "Set pin_frozen_modules=False" in message
        assert result["unfreeze_pinned"]["dtypes"] == {"torch.bfloat16", "torch.float32"}  # fp32: the norms
    assert results[0]["unfreeze_pinned"]["error"] == results[1]["unfreeze_pinned"]["error"]


def test_unpinned_or_32_true_modules_unfrozen_after_setup_train_with_their_masters(results: list) -> None:
    for result in results:
        unpinned = result["unfreeze_unpinned"]
        assert unpinned["error"] == "no error" and unpinned["moved"]
        assert unpinned["dtypes"] == {"torch.float32"} and unpinned["state_dtypes"] == {"torch.float32"}  # masters
        full = result["unfreeze_32"]
        assert full["error"] == "no error" and full["moved"] and full["dtypes"] == {"torch.float32"}


def test_backbone_finetuning_on_the_trainer(results: list) -> None:
    for result in results:
        assert "modules frozen at setup are trainable now (Sequential: 0, 3)" in result["backbone_pinned"]["error"]
        unpinned = result["backbone_unpinned"]
        assert unpinned["error"] == "no error" and unpinned["moved"] and unpinned["dtypes"] == {"torch.float32"}
