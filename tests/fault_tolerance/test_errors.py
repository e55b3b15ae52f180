"""One test per fault-tolerance error message: each names what is wrong, quotes the bad value and gives the fix."""

import sys
from typing import Any, Dict

import pytest
import torch
from torch import nn

from lightning_mixedfsdp import FaultTolerance, MixedFSDPConfig, MixedFSDPConfigError
from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
from lightning_mixedfsdp.testing import free_port, run_distributed

pytest.importorskip("torchft")

GOOD: Dict[str, Any] = dict(replica_id=0, num_replica_groups=2, lighthouse="http://127.0.0.1:29510")


def problems_of(**changes: Any) -> str:
    with pytest.raises(MixedFSDPConfigError) as raised:
        MixedFSDPConfig(fault_tolerance={**GOOD, **changes}).validate()  # type: ignore[arg-type]
    return str(raised.value)


def test_missing_replica_id() -> None:
    message = problems_of(replica_id=None)
    assert "fault_tolerance.replica_id is missing; give each launch its group's id, 0 to num_replica_groups - 1" in (
        message
    )


def test_negative_replica_id() -> None:
    assert "fault_tolerance.replica_id=-1 must be an int >= 0" in problems_of(replica_id=-1)


def test_replica_id_not_below_the_groups() -> None:
    message = problems_of(replica_id=2)
    assert "fault_tolerance.replica_id=2 is not below num_replica_groups=2; use 0 to 1" in message


def test_missing_number_of_groups() -> None:
    message = problems_of(num_replica_groups=None)
    assert "fault_tolerance.num_replica_groups is missing; set it to the number of replica groups" in message


def test_bad_min_replicas_and_timeouts_all_at_once() -> None:
    message = problems_of(min_replicas=0, timeout_s=0, connect_timeout_s="soon")
    assert "fault_tolerance.min_replicas=0 must be an int >= 1." in message
    assert "fault_tolerance.timeout_s=0 must be a number > 0; give seconds, e.g. " in message
    assert "fault_tolerance.connect_timeout_s='soon' must be a number > 0; give seconds, e.g. " in message
    assert "3 problem(s)" in message


def test_empty_lighthouse() -> None:
    assert "fault_tolerance.lighthouse is empty; give the lighthouse's URL" in problems_of(lighthouse=" ")


def test_unknown_fault_tolerance_field() -> None:
    with pytest.raises(MixedFSDPConfigError, match=r"fault_tolerance got unknown field\(s\) \['replica'\]. Valid"):
        MixedFSDPConfig(fault_tolerance={"replica": 1})


def test_fault_tolerance_of_the_wrong_type() -> None:
    with pytest.raises(MixedFSDPConfigError, match=r"fault_tolerance=3 must be None, a FaultTolerance or a mapping"):
        MixedFSDPConfig(fault_tolerance=3).validate()  # type: ignore[arg-type]


def test_buffer_averaging_under_fault_tolerance() -> None:
    with pytest.raises(
        MixedFSDPConfigError, match=r"buffers\.sync='average' averages buffers within one replica group"
    ):
        MixedFSDPConfig(fault_tolerance=FaultTolerance(**GOOD), buffer_sync="average").validate()


def test_a_strategy_keyword_and_a_recipe_mapping_make_the_same_settings() -> None:
    strategy = MixedFSDP2Strategy(fault_tolerance=GOOD)
    assert strategy.config.fault_tolerance == FaultTolerance(**GOOD)
    assert MixedFSDPConfig.from_input({"fault_tolerance": GOOD}, {}, "x").fault_tolerance == FaultTolerance(**GOOD)


def test_torchft_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"MixedFSDP2Strategy: fault_tolerance needs torchft, .*\[ft\]'.*torchft=="):
        MixedFSDP2Strategy(fault_tolerance=GOOD)


def test_no_lighthouse_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"MixedFSDP2Strategy: fault_tolerance has no lighthouse: set .*torchft_light"):
        MixedFSDP2Strategy(fault_tolerance={**GOOD, "lighthouse": None})


def test_the_lighthouse_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    MixedFSDP2Strategy(fault_tolerance={**GOOD, "lighthouse": None})


def _refusals(rank: int, world_size: int, url: str) -> Dict[str, Any]:
    """Both refusals that need launched processes, in one launch: an unreachable lighthouse (Fabric's launch), then
    a model that `parallelize_fn` sharded itself (the model setup, on the process group that launch started)."""
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from torch.distributed.fsdp import fully_shard

    from lightning_mixedfsdp.mesh import ParallelDims
    from lightning_mixedfsdp.model_setup import shard_model

    out: Dict[str, Any] = {}
    strategy = MixedFSDP2Strategy(fault_tolerance={**GOOD, "lighthouse": url, "connect_timeout_s": 1})
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    with pytest.raises(ConnectionError) as unreachable:
        fabric.launch()
    out["unreachable"] = str(unreachable.value)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    meshes = ParallelDims.resolve(world_size=world_size, devices_per_node=world_size, owner="test").build_meshes("cpu")
    config = MixedFSDPConfig(fault_tolerance=FaultTolerance(**GOOD)).validate()
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))

    def shard_it_myself(module: nn.Module, mesh: Any) -> nn.Module:
        return fully_shard(module, mesh=meshes.fsdp)

    with pytest.raises(ValueError) as sharded:
        shard_model(
            model, config, config.bulk_dtypes("32-true"), meshes, torch.device("cpu"), shard_it_myself, lambda t: None
        )
    out["sharded_by_parallelize_fn"] = str(sharded.value)
    return out


@pytest.fixture(scope="module")
def refusals() -> Any:
    """The launch's timeout bounds a hang only (a rank left waiting for the lighthouse or for a peer fails it)."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return url, run_distributed(_refusals, 2, url, timeout=240)


def test_an_unreachable_lighthouse_fails_every_rank_with_its_url_and_the_connect_timeout(refusals: Any) -> None:
    url, results = refusals
    for result in results:
        message = result["unreachable"]
        # the refusal of the connect check, with the configured timeout (1 s, not the default 10 s) and its cause
        assert f"the torchft lighthouse at '{url}' is unreachable within 1s (" in message
        assert "Connection refused)" in message
        assert "Start one with `torchft_lighthouse --min_replicas 1" in message


def test_fault_tolerance_refuses_a_model_sharded_by_parallelize_fn(refusals: Any) -> None:
    for result in refusals[1]:
        message = result["sharded_by_parallelize_fn"]
        assert "fault_tolerance reduces every gradient across replica groups through the dtype plan's FSDP" in message
        assert "Remove `fully_shard` from it" in message


def test_the_dtype_report_shows_the_fault_tolerant_dim() -> None:
    from lightning_mixedfsdp import format_plan
    from lightning_mixedfsdp.planning.planner import plan_validated
    from tests.hf_models import tiny_model

    config = MixedFSDPConfig(fault_tolerance=FaultTolerance(**GOOD), replicate_below_bytes=200).validate()
    plan = plan_validated(tiny_model("llama"), config, config.bulk_dtypes("bf16-true"), shard_ranks=2)
    report = format_plan(plan)
    # the blocks' bf16 and fp32 groups, the root's bf16 group, the replicated final norm (fp32)
    assert "fault-tolerant replica dim (torchft): 2 replica groups" in report
    assert "averaged across them in its reduce dtype (3 in bf16, 3 in fp32)" in report
    assert plan.predicted_collectives()["cross_replica_all_reduce"] == 6
    assert (
        "cross_replica_all_reduce"
        not in plan_validated(
            tiny_model("llama"), MixedFSDPConfig(), config.bulk_dtypes("bf16-true")
        ).predicted_collectives()
    )
