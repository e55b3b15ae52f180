"""Runs Lightning's `standalone` multi-GPU test bodies on CPU processes, many bodies per launch.

In Lightning a standalone test is one pytest process per rank (torchrun, or Lightning's launcher re-running the
pytest command), each with its own ``tmp_path``, and a fresh process group per test. Here:

- ``@cpu_processes(world_size)`` (placed where ``RunIf(standalone=True, min_cuda_gpus=N)`` was) keeps the test
  function, unchanged, as the *body*, and gives pytest a thin test in its place that looks the body's result up;
- the first such test of a (side, world size) launches ``run_distributed`` once for every selected test of that side
  and size (``side`` is ``lightning`` or ``mixed``: which strategy class the body gets); each body runs on every rank
  with its own per-rank ``tmp_path`` (as with one pytest process per rank) and its own process group;
- the harness owns the process group: before each body it initialises a fresh gloo group on its own TCP store
  (Lightning's ``_init_dist_connection`` then reuses it, as it reuses any initialised group), and after the body it
  waits for every rank through the store (not through gloo, so a body that failed on one rank cannot desynchronise
  the collectives of the next), destroys the group and resets dynamo, the environment and the rank globals;
- a rank whose body raised destroys its process groups and shuts down its gloo connections at once, which fails a
  peer blocked in a collective the failed rank will never join ("Connection closed by peer"); as a backstop
  collectives time out after ``COLLECTIVE_TIMEOUT`` instead of torch's 30 minutes, so a stuck rank fails that body,
  not the whole launch;
- each rank appends every body's result to a file as soon as it has it, so a launch that dies still reports the
  bodies before the crash, and the crash fails the body it happened in (and the ones after it).
"""

import functools
import importlib
import inspect
import json
import os
import re
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

COLLECTIVE_TIMEOUT = timedelta(seconds=45)
# a rank waits this long for its peers to finish a body (a peer stuck in a collective needs COLLECTIVE_TIMEOUT)
BODY_SYNC_TIMEOUT = timedelta(seconds=90)
MARKER = "contract_cpu_processes"


class BodyFailed(Exception):
    """A body failed on some rank. Deliberately not an AssertionError: Lightning's
    ``xfail(raises=AssertionError, reason="Test left zombie thread")`` must not swallow a real failure."""


def cpu_processes(world_size: int):
    """Decorator: the test runs as a body on ``world_size`` CPU processes, in the launch shared by its side."""

    def decorate(fn):
        @functools.wraps(fn)
        def test(*args: Any, **kwargs: Any) -> None:
            handle = kwargs.get("distributed")
            if not isinstance(handle, BodyResult):
                raise RuntimeError(f"{fn.__name__} needs the `distributed` fixture of tests/lightning_contract")
            handle.check()

        test._contract_body = fn  # what the worker calls
        return pytest.mark.contract_cpu_processes(world_size=world_size)(test)

    return decorate


def side_of(strategy_class: Optional[type]) -> str:
    if strategy_class is None:
        return "lightning"  # tests that use no ModelParallelStrategy class run once, in Lightning's launch
    return "mixed" if strategy_class.__module__.startswith("lightning_mixedfsdp") else "lightning"


@dataclass
class Job:
    nodeid: str
    module: str
    name: str
    kwargs: Dict[str, Any]
    arg_names: Tuple[str, ...]


def _skipped(item: pytest.Item) -> bool:
    if any(True for _ in item.iter_markers("skip")):
        return True
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition", True)
        if isinstance(condition, bool) and condition:
            return True
    return False


def _job(item: pytest.Item) -> Job:
    function = item.obj
    body = function._contract_body
    params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
    names = tuple(inspect.signature(body).parameters)
    return Job(item.nodeid, function.__module__, function.__name__, params, names)


def _key(item: pytest.Item) -> Tuple[str, int]:
    params = item.callspec.params if hasattr(item, "callspec") else {}
    world_size = item.get_closest_marker(MARKER).kwargs["world_size"]
    return side_of(params.get("ModelParallelStrategy")), world_size


@contextmanager
def _cpu_only_unless_a_gpu_per_rank(world_size: int) -> Iterator[None]:
    """The bodies run on gloo, and Lightning's tests ask for ``accelerator="auto"`` with ``devices=N``: on a machine
    with fewer GPUs than ranks (one lent GPU), "auto" would pick CUDA and Lightning would refuse the device count.
    Hide the GPUs from the launched ranks then, so the port runs on the CPU as on a machine without one."""
    from lightning_mixedfsdp.testing import accelerator_for

    if accelerator_for(world_size) != "cpu" or not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class Launches:
    """Session cache: one ``run_distributed`` per (side, world size), over the selected tests of that key."""

    def __init__(self, session: pytest.Session, root: Path) -> None:
        self._session = session
        self._root = root
        self._results: Dict[Tuple[str, int], Dict[str, Dict[int, dict]]] = {}
        self._errors: Dict[Tuple[str, int], str] = {}
        self.timings: Dict[Tuple[str, int], float] = {}

    def result(self, item: pytest.Item) -> Tuple[Dict[int, dict], Optional[str], int]:
        key = _key(item)
        if key not in self._results:
            self._launch(key)
        return self._results[key].get(item.nodeid, {}), self._errors.get(key), key[1]

    def _launch(self, key: Tuple[str, int]) -> None:
        from lightning_mixedfsdp.testing import run_distributed

        side, world_size = key
        items = [i for i in self._session.items if i.get_closest_marker(MARKER) and _key(i) == key and not _skipped(i)]
        jobs = [_job(i) for i in items]
        directory = self._root / f"{side}-ws{world_size}"
        directory.mkdir(parents=True, exist_ok=True)
        timeout = 60 + len(jobs) * (BODY_SYNC_TIMEOUT.total_seconds() + 30)
        start = time.monotonic()
        try:
            with _cpu_only_unless_a_gpu_per_rank(world_size):
                run_distributed(_run_bodies, world_size, jobs, str(directory), timeout=timeout)
        except AssertionError as error:  # a rank died or hung: what it reported before still counts
            self._errors[key] = str(error)
        self.timings[key] = time.monotonic() - start
        results: Dict[str, Dict[int, dict]] = {}
        for rank in range(world_size):
            path = directory / f"results-rank{rank}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    results.setdefault(record["nodeid"], {})[rank] = record
        self._results[key] = results


class BodyResult:
    """What a ported test gets as ``distributed``: its body's per-rank outcome."""

    def __init__(self, launches: Launches, item: pytest.Item) -> None:
        self._launches = launches
        self._item = item

    def check(self) -> None:
        per_rank, launch_error, world_size = self._launches.result(self._item)
        failures: Dict[str, List[int]] = {}  # the same traceback on several ranks is shown once
        for rank in range(world_size):
            record = per_rank.get(rank)
            if record is None:
                failures.setdefault("no result (the launch died or hung before or in this body)", []).append(rank)
            elif record["status"] != "ok":
                failures.setdefault(record["status"], []).append(rank)
        if failures:
            message = "\n".join(f"ranks {ranks} of {world_size}:\n{text}" for text, ranks in failures.items())
            if len(failures) > 1:
                message = (
                    "(a rank whose traceback ends in gloo's 'Connection closed by peer' or 'Read error' was blocked in"
                    " a collective when another rank failed: that other rank's traceback is the cause)\n" + message
                )
            if launch_error and any(per_rank.get(r) is None for r in range(world_size)):
                message += f"\n--- launch error ---\n{launch_error}"
            raise BodyFailed(message)


# --------------------------------------------------------------------------------------------------- worker side


def _run_bodies(rank: int, world_size: int, jobs: List[Job], directory: str) -> int:
    import gc

    import lightning.fabric.wrappers
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from lightning.fabric.utilities.rank_zero import rank_zero_only as rank_zero_only_fabric
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as rank_zero_only_pytorch
    from lightning_utilities.core.rank_zero import rank_zero_only as rank_zero_only_utilities

    # what the fork server imported lives as long as the process: the collection after each body walks only what
    # the bodies made (a full one over the imports takes 0.7 s)
    gc.freeze()
    # subgroups (device meshes, FSDP) take torch's default timeout: shorten it as for the default group
    c10d.default_pg_timeout = COLLECTIVE_TIMEOUT
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0,
        timeout=BODY_SYNC_TIMEOUT,
    )
    root = Path(directory)
    results = root / f"results-rank{rank}.jsonl"
    environment = dict(os.environ)
    cwd = os.getcwd()
    rank_functions = (rank_zero_only_pytorch, rank_zero_only_fabric, rank_zero_only_utilities)
    ranks = [getattr(fn, "rank", None) for fn in rank_functions]
    for index, job in enumerate(jobs):
        tmp_path = root / f"rank{rank}" / f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', job.name)}"
        tmp_path.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        status = "not run"
        try:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"body{index}/", store),
                rank=rank,
                world_size=world_size,
                timeout=COLLECTIVE_TIMEOUT,
            )
            os.chdir(tmp_path)  # bodies that write to the working directory (lightning_logs) write here
            body = getattr(importlib.import_module(job.module), job.name)._contract_body
            values = {"distributed": None, "tmp_path": tmp_path, **job.kwargs}
            body(**{name: values[name] for name in job.arg_names if name in values})
            status = "ok"
        except BaseException:
            status = traceback.format_exc()
        if status != "ok":
            # close this rank's gloo connections now: a peer blocked in a collective this rank will never join
            # fails at once ("Connection closed by peer") instead of after COLLECTIVE_TIMEOUT. Destroying the groups
            # is not enough: a group object still referenced somewhere (a compiled graph, a device mesh) keeps its
            # sockets open, so the connected sockets are shut down too (not the store's, not listeners)
            _release_process_groups()
            _shut_down_peer_connections(int(os.environ["MASTER_PORT"]))
        seconds = time.monotonic() - start
        # every rank finished this body (or failed it): synchronise through the store, not through gloo
        store.set(f"done/{index}/{rank}", "1")
        try:
            store.wait([f"done/{index}/{r}" for r in range(world_size)], BODY_SYNC_TIMEOUT)
        except Exception:
            status = status if status != "ok" else f"peers did not finish this body:\n{traceback.format_exc()}"
        with results.open("a") as file:
            file.write(json.dumps({"nodeid": job.nodeid, "status": status, "seconds": seconds}) + "\n")
        # a fresh process group and fresh globals for the next body, as a new standalone test process would have
        os.chdir(cwd)
        _release_process_groups()
        os.environ.clear()
        os.environ.update(environment)
        for fn, value in zip(rank_functions, ranks, strict=True):
            if value is not None:
                fn.rank = value
        torch.use_deterministic_algorithms(False)
        lightning.fabric.wrappers._in_fabric_backward = False
    return len(jobs)


def _release_process_groups() -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch._dynamo.reset()  # compiled graphs hold modules, meshes and groups
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _shut_down_peer_connections(store_port: int) -> None:
    """Shut down every connected TCP socket of this process except the store's (gloo's pairs of this rank)."""
    import socket

    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:  # borrowed: detached below, never closed here (the fd belongs to its C++ owner)
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # a listener: shutting gloo's down aborts the process
            try:
                ports = {sock.getsockname()[1], sock.getpeername()[1]}
            except OSError:
                continue  # not connected
            if store_port not in ports:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()
