"""Every torchft API the library uses, each behind one small function: the ``Manager`` of a fault-tolerant replica
group, the process group it reduces across groups with, and its all-reduce.

torchft is optional (``pip install 'lightning-mixedfsdp[ft]'``): nothing here imports it until called. Checked on
torchft 0.2.0 (public: ``torchft.Manager``, ``torchft.ProcessGroupGloo``, ``torchft.ProcessGroupNCCL``,
``Manager.allreduce/start_quorum/should_commit/participating_rank/num_participants/current_step/state_dict/
load_state_dict/register_state_dict_fn/shutdown``). Not used: 0.2.0's ``DistributedDataParallel`` wrapper, whose
future chain crashes a survivor when a peer dies inside an all-reduce (``assert fut._fut``), and the asynchronous
quorum, whose thread reads the state dict for a heal while FSDP2 runs forward and backward.
"""

from datetime import timedelta
from typing import Any, Callable, Dict

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.extras import optional_import

LIGHTHOUSE_LINE = "torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000"
"""The command that starts a lighthouse (the ``torchft_lighthouse`` script of the torchft the trainers import)."""


def check_torchft(owner: str) -> None:
    """Raise an ImportError naming ``owner`` with the install line when torchft cannot be imported."""
    with optional_import("torchft", f"{owner}: fault_tolerance"):
        import torchft  # noqa: F401


def make_manager(
    device: torch.device,
    replica_id: str,
    lighthouse: str,
    min_replicas: int,
    group_rank: int,
    group_world_size: int,
    timeout_s: float,
    quorum_timeout_s: float,
    connect_timeout_s: float,
    load_state_dict: Callable[[Dict[str, Any]], None],
    state_dict: Callable[[], Dict[str, Any]],
) -> Any:
    """torchft's ``Manager`` for this rank of a replica group, with a synchronous quorum (a heal lands before the
    step's forward), over gloo on a CPU and NCCL on a GPU. The group's TCPStore is the launcher's (MASTER_ADDR and
    MASTER_PORT), as torchft expects."""
    with optional_import("torchft", "fault_tolerance"):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=timeout_s)
    process_group = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    return Manager(
        pg=process_group,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timedelta(seconds=connect_timeout_s),
        rank=group_rank,
        world_size=group_world_size,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
    )


def all_reduce_average(manager: Any, tensor: Tensor) -> None:
    """Average ``tensor`` in place over the participating replica groups and wait for it. A failure (a peer died
    inside it) is recorded by the manager, which then discards the step at the commit vote; it never raises here."""
    manager.allreduce(tensor).wait()


def lighthouse_server(min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int) -> Any:
    """torchft's lighthouse in this process (``torchft.coordination.LighthouseServer``), on a free port; its
    ``address()`` is the URL the replica groups join, ``shutdown()`` stops it. For tests and benchmarks."""
    with optional_import("torchft", "a lighthouse"):
        from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
