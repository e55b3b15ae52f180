"""Run a function on N local processes and bring each rank's result back (the tests and the benchmarks).

Processes see MASTER_ADDR/PORT, WORLD_SIZE, RANK and LOCAL_RANK, so Lightning treats them as externally launched.
A rank that raises, hangs past the timeout or dies without reporting raises in the parent with its traceback;
callers assert on the returned results, so a crashed rank can never pass.
"""

import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, List

DEFAULT_TIMEOUT_S = 120


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> List[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank return values."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                dead = [r for r in missing if processes[r].exitcode is not None]
                if dead or time.monotonic() > deadline:
                    reason = f"died with exit codes {[processes[r].exitcode for r in dead]}" if dead else "hung"
                    raise AssertionError(
                        f"{fn.__name__}: ranks {missing} did not report within {timeout}s ({reason})"
                    ) from None
                continue
            if status == "error":
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    import torch
    import torch.distributed as dist
    from lightning_utilities.core.apply_func import apply_to_collection

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        # plain bytes of CPU tensors: a tensor sent through shared memory needs its sender alive until it is
        # received, and the parent compares results with CPU references whatever device the ranks used
        queue.put((rank, "ok", pickle.dumps(apply_to_collection(result, torch.Tensor, lambda t: t.detach().cpu()))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    # a deterministic exit: no interpreter teardown racing gloo threads
    queue.close()
    queue.join_thread()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
