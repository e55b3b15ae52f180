"""What ``mixed_fsdp2`` does where it deliberately differs from Lightning's ``ModelParallelStrategy``: one test per
entry of ``differences.py`` (docs/configuration.md, "Differences from ModelParallelStrategy"), each asserting our
behaviour on real processes and files, where the ported Lightning test mocks internals or asserts Lightning's."""

from pathlib import Path
from re import escape
from typing import Any, Dict
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mixedfsdp.fabric import MixedFSDP2Strategy as FabricStrategy
from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy as TrainerStrategy
from lightning_mixedfsdp.testing import run_distributed


class FeedForward(nn.Module):
    """Lightning's test model (tests_fabric/strategies/test_model_parallel_integration.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def _tensor_parallel(model: nn.Module, device_mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
    parallelize_module(model, device_mesh["tensor_parallel"], plan)
    return model


@pytest.mark.parametrize("strategy_class", [FabricStrategy, TrainerStrategy])
def test_messages_name_our_class(strategy_class: type, tmp_path: Path) -> None:
    name = strategy_class.__name__
    module = "fabric" if strategy_class is FabricStrategy else "pytorch"
    with mock.patch(f"lightning.{module}.strategies.model_parallel._TORCH_GREATER_EQUAL_2_4", False):
        with pytest.raises(ImportError, match=f"{name} requires PyTorch 2.4 or higher"):
            strategy_class()
    strategy = strategy_class()
    with pytest.raises(TypeError, match=escape(f"`{name}.save_checkpoint(..., storage_options=...)` is not supported")):
        if strategy_class is FabricStrategy:
            strategy.save_checkpoint(path=tmp_path, state=Mock(), storage_options=Mock())
        else:
            strategy.save_checkpoint(checkpoint=Mock(), filepath=tmp_path, storage_options=Mock())
    assert not any(tmp_path.iterdir())  # refused before anything was written
    if strategy_class is FabricStrategy:
        with pytest.raises(ValueError, match=escape(f"Got {name}.load_checkpoint(..., state=None")):
            strategy.load_checkpoint(path=tmp_path, state=None)


def test_no_backward_sync_restores_gradient_sync_either_way() -> None:
    from torch.distributed.fsdp import FSDPModule

    strategy = FabricStrategy()
    fsdp_layer = Mock(spec=FSDPModule)
    module = Mock()
    module.modules = Mock(return_value=[fsdp_layer, nn.Linear(2, 2)])
    with strategy._backward_sync_control.no_backward_sync(module, True):
        fsdp_layer.set_requires_gradient_sync.assert_called_with(False, recurse=False)
    fsdp_layer.set_requires_gradient_sync.assert_called_with(True, recurse=False)
    with strategy._backward_sync_control.no_backward_sync(module, False):
        fsdp_layer.set_requires_gradient_sync.assert_called_with(True, recurse=False)
    fsdp_layer.set_requires_gradient_sync.assert_called_with(True, recurse=False)  # Lightning's: False


@pytest.mark.parametrize("precision", ["16-true"])  # Lightning's connector refuses "16-mixed" itself
def test_fp16_is_refused_with_the_fix(precision: str) -> None:
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    fix = r"use 'bf16-mixed' or 'bf16-true' instead"
    with pytest.raises(ValueError, match=rf"MixedFSDP2Strategy: precision='{precision}' is not supported; .*{fix}"):
        Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(), precision=precision)
    with pytest.raises(ValueError, match=rf"MixedFSDP2Strategy: precision='{precision}' is not supported; .*{fix}"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=TrainerStrategy(), precision=precision)


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))


class _Model(nn.Module):
    """Lightning's ``test_meta_device_materialization`` model."""

    def __init__(self, covered: bool) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(4, 4) if covered else _NoInit(), nn.Linear(4, 4))
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("buffer", torch.rand(2))

    def reset_parameters(self) -> None:
        self.buffer.fill_(1.0)


def _launched(strategy: Any) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    return fabric


def _one_rank(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    out: Dict[str, Any] = {}
    # parallelize_fn: called once with the model and the strategy's mesh; what it returns is planned and sharded
    calls = []

    def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
        calls.append((model, device_mesh))
        return model

    fabric = _launched(FabricStrategy(parallelize))
    model = FeedForward()
    sharded = fabric.setup_module(model)
    out["parallelize"] = {
        "calls": len(calls),
        "same_model": calls[0][0] is model,
        "same_mesh": calls[0][1] is fabric.strategy.device_mesh,
        "sharded": isinstance(sharded.module, FSDPModule) and isinstance(model.w1.weight, DTensor),
    }
    with pytest.raises(TypeError, match="The `parallelize_fn` must return a `nn.Module` instance, but got: NoneType"):
        _launched(FabricStrategy(lambda m, _: None)).setup_module(FeedForward())
    # meta init: a module no init covers is refused, naming it and the fix; a covered model is materialised
    fabric = _launched(FabricStrategy())
    with fabric.init_module(empty_init=True):
        uncovered = _Model(covered=False)
    with pytest.raises(RuntimeError, match=r"layer1\.0\.weight \(_NoInit\).*a `reset_parameters\(\)` method"):
        fabric.setup_module(uncovered)
    with fabric.init_module(empty_init=True):
        covered = _Model(covered=True)
    covered = fabric.setup_module(covered)
    out["materialised"] = not any(t.is_meta for t in (*covered.parameters(), *covered.buffers()))
    out["buffer"] = covered.buffer.tolist()
    out["saves"] = _atomic_saves(Path(folder))

    # the Trainer: a LightningModule without configure_model trains, its child sharded by the plan
    class NoConfigureModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = FeedForward()

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.net(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = NoConfigureModel()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=TrainerStrategy(), max_steps=2, logger=False, enable_checkpointing=False
    )
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(4, 32), batch_size=2))
    out["trainer"] = {"steps": trainer.global_step, "sharded": isinstance(module.net, FSDPModule)}
    return out


def _atomic_saves(folder: Path) -> Dict[str, Any]:

    out: Dict[str, Any] = {}
    full = _launched(FabricStrategy(save_distributed_checkpoint=False))
    sharded = _launched(FabricStrategy())
    model = full.setup_module(FeedForward())
    sharded_model = sharded.setup_module(FeedForward())
    # a full save into a folder that is no checkpoint: refused, as Lightning does
    user_folder = folder / "not-a-checkpoint"
    user_folder.mkdir()
    (user_folder / "notes.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        full.save(user_folder, {"model": model})
    # a sharded save into that folder: the checkpoint lands in it and the user's file stays (Lightning: the same)
    sharded.save(user_folder, {"model": sharded_model})
    out["user_file_kept"] = (user_folder / "notes.txt").read_text() == "mine"
    out["sharded_in_user_folder"] = (user_folder / "meta.pt").is_file()
    # and again over it: still kept (Lightning's in-place save too; ours replaced the folder atomically)
    sharded.save(user_folder, {"model": sharded_model})
    out["user_file_kept_again"] = (user_folder / "notes.txt").read_text() == "mine"
    # a full save over that sharded checkpoint would remove the user's file: refused, with the fix
    with pytest.raises(IsADirectoryError, match=r"would remove files it did not write: \['notes.txt'\]"):
        full.save(user_folder, {"model": model})
    # over a sharded checkpoint of our own and over a file: replaced
    own = folder / "own"
    sharded.save(own, {"model": sharded_model})
    full.save(own, {"model": model})
    out["sharded_replaced_by_file"] = own.is_file()
    full.save(own, {"model": model})
    sharded.save(own, {"model": sharded_model})
    out["file_replaced_by_sharded"] = own.is_dir() and (own / "meta.pt").is_file()
    out["leftovers"] = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
    return out


def _tensor_parallel_auto(rank: int, world_size: int) -> Dict[str, Any]:
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor

    fabric = Fabric(
        accelerator="cpu", devices=2, strategy=FabricStrategy(_tensor_parallel, tensor_parallel_size="auto")
    )
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = FeedForward()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    mesh = fabric.strategy.device_mesh
    batch = torch.rand(2, 32)
    batches = fabric.all_gather(batch)
    losses = []
    for _ in range(3):
        loss = model(batch).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
        "param_meshes": {tuple(p.device_mesh.mesh_dim_names) for p in model.parameters() if isinstance(p, DTensor)},
        "tp_inputs_equal": bool(torch.equal(batches[0], batches[1])),
        "losses": losses,
    }


def _default_mesh(rank: int, world_size: int) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy())
    fabric.launch()
    return fabric.strategy.device_mesh.mesh_dim_names, tuple(fabric.strategy.device_mesh.shape)


class NormedFeedForward(nn.Module):
    """Lightning's test model behind an fp32 LayerNorm: the norm is replicated, the Linears FSDP-sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.norm(x))


def _clip_by_norm(rank: int, world_size: int, precision: str) -> Dict[str, Any]:
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor

    fabric = Fabric(accelerator="cpu", devices=2, precision=precision, strategy=FabricStrategy())
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(NormedFeedForward())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(model(torch.rand(4, 32, device=fabric.device)).sum())

    def norm() -> float:
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        return torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])).item()

    before = norm()
    returned = fabric.clip_gradients(model, optimizer, max_norm=before / 10).item()
    placements = {type(p).__name__ + str(getattr(p, "placements", "")) for p in model.parameters()}
    return {"before": before, "returned": returned, "after": norm(), "placements": placements}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_clip_gradients_by_norm_reaches_the_requested_norm_over_mixed_placements(precision: str) -> None:
    for result in run_distributed(_clip_by_norm, 2, precision):
        # under the bf16 flags the fp32 LayerNorm is a replicated group beside the sharded bf16 Linears
        mixed = {"DTensor(Shard(dim=0),)", "DTensor(Replicate(),)"}
        assert result["placements"] == ({"DTensor(Shard(dim=0),)"} if precision == "32-true" else mixed)
        assert result["returned"] == pytest.approx(result["before"], rel=1e-5)  # the norm before clipping
        # a tenth of the norm, up to the grads' own rounding (bf16-true stores bf16 grads)
        tolerance = 1e-2 if precision == "bf16-true" else 1e-5
        assert result["after"] == pytest.approx(result["before"] / 10, rel=tolerance)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return run_distributed(_one_rank, 1, str(tmp_path_factory.mktemp("differences")), timeout=240)[0]


def test_parallelize_fn_is_called_with_the_mesh_and_its_module_is_sharded(one_rank: Dict[str, Any]) -> None:
    assert one_rank["parallelize"] == {"calls": 1, "same_model": True, "same_mesh": True, "sharded": True}


def test_a_meta_module_without_an_init_is_refused_and_the_rest_materialised(one_rank: Dict[str, Any]) -> None:
    assert one_rank["materialised"] and one_rank["buffer"] == [1.0, 1.0]


def test_atomic_saves_over_existing_paths_keep_user_files(one_rank: Dict[str, Any]) -> None:
    saves = one_rank["saves"]
    assert saves["user_file_kept"] and saves["sharded_in_user_folder"] and saves["user_file_kept_again"]
    assert saves["sharded_replaced_by_file"] and saves["file_replaced_by_sharded"]
    assert saves["leftovers"] == []  # no temp or set-aside copies left behind


def test_the_trainer_shards_children_without_configure_model(one_rank: Dict[str, Any]) -> None:
    assert one_rank["trainer"] == {"steps": 2, "sharded": True}


def test_tensor_parallelism_with_lightnings_auto_sizes() -> None:
    (default_rank0, _) = run_distributed(_default_mesh, 2)
    assert default_rank0 == (("data_parallel", "tensor_parallel"), (2, 1))  # ours: data parallel over every rank
    for result in run_distributed(_tensor_parallel_auto, 2):
        # "auto" as Lightning: tensor parallel over the node's devices, one data-parallel rank
        assert result["mesh"] == (("data_parallel", "tensor_parallel"), (1, 2))
        # the plan shards with FSDP over the (one-rank) data-parallel dim too: 2-D DTensors
        assert result["param_meshes"] == {("data_parallel", "tensor_parallel")}
        assert result["tp_inputs_equal"]
        assert result["losses"][-1] < result["losses"][0]
