"""Run a function on N local processes and bring each rank's result back: what the tests and the benchmarks launch.

Processes see MASTER_ADDR/PORT, WORLD_SIZE, RANK and LOCAL_RANK, so Lightning treats them as externally launched.
A rank that raises, hangs past the timeout or dies without reporting raises in the parent with its traceback;
callers assert on the returned results, so a crashed rank can never pass.

Ranks start from a fork server that imported torch, Lightning, transformers and this package once (``forkserver``
with those modules preloaded): a launch then costs the fork, not 4-6 s of imports per rank. Each rank gets the
caller's environment as it is at the launch. ``MIXED_FSDP_TEST_START=spawn`` starts every rank from scratch instead.
"""

import dataclasses
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

DEFAULT_TIMEOUT_S = 120
START_ENV = "MIXED_FSDP_TEST_START"
ACCELERATOR_ENV = "MIXED_FSDP_TEST_ACCELERATOR"
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "lightning.fabric",
    "lightning.pytorch",
    "transformers",
    "lightning_mixedfsdp",
    "lightning_mixedfsdp.recipes.run.runner",
)
"""What the fork server imports once (a module that is not installed is skipped)."""

_context: Optional[Any] = None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
) -> List[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank return values. ``fresh``: each rank a new
    interpreter (``spawn``), for a measurement of a process's own memory that the fork server's pages must not
    blur."""
    context = multiprocessing.get_context("spawn") if fresh else _start_context()
    queue = context.Queue()
    port = free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, args, queue, environment), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(fn.__name__, processes, queue, world_size, timeout)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _collect(name: str, processes: List[Any], queue: Any, world_size: int, timeout: float) -> List[Any]:
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            missing = sorted(set(range(world_size)) - set(results))
            dead = [r for r in missing if processes[r].exitcode is not None]
            if dead or time.monotonic() > deadline:
                reason = f"died with exit codes {[processes[r].exitcode for r in dead]}" if dead else "hung"
                raise AssertionError(f"{name}: ranks {missing} did not report within {timeout}s ({reason})") from None
            continue
        if status == "error":
            raise AssertionError(f"{name} failed on rank {rank}:\n{payload}")
        results[rank] = pickle.loads(payload)
    return [results[rank] for rank in range(world_size)]


def start_context() -> Any:
    """The multiprocessing context ranks start from: the fork server with ``PRELOAD`` imported (started once)."""
    return _start_context()


def _start_context() -> Any:
    global _context
    if _context is None:
        method = os.environ.get(START_ENV, "forkserver")
        _context = multiprocessing.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload(list(PRELOAD))
    return _context


def _worker(
    fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any, environment: Dict[str, str]
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        # plain bytes of CPU tensors: a tensor sent through shared memory needs its sender alive until it is
        # received, and the parent compares results with CPU references whatever device the ranks used
        queue.put((rank, "ok", pickle.dumps(_on_cpu(result))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    # a deterministic exit: no interpreter teardown racing gloo threads
    queue.close()
    queue.join_thread()
    os._exit(0)


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor in it detached and on the CPU (nested dicts, lists, tuples and dataclasses)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _on_cpu(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((key, _on_cpu(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_on_cpu(item) for item in value)
    if isinstance(value, tuple):  # a named tuple
        return type(value)(*(_on_cpu(item) for item in value))
    return value


def free_port() -> int:
    """A TCP port nothing listens on now (for a launch's MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerator_for(world_size: int) -> str:
    """Where a test of ``world_size`` ranks runs: ``$MIXED_FSDP_TEST_ACCELERATOR`` (``cpu``, ``cuda`` or ``auto``, the
    default). ``auto`` takes CUDA (NCCL) when there is a GPU per rank, else the CPU (gloo): no test needs a GPU."""
    choice = os.environ.get(ACCELERATOR_ENV, "auto")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    return choice
