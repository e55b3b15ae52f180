"""Replica groups as separate launches, the way a user runs them: a lighthouse in the calling process, each group's
ranks as processes with their own MASTER_PORT (what torchrun gives each launch), killed with SIGKILL and restarted
by the caller. The ranks run a worker module as ``python -m <module>`` would (``runpy``), in processes forked from
the tests' fork server (torch, Lightning and transformers imported once: a group's start costs the fork, not seconds
of imports per rank), and report through JSON lines."""

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from lightning_mixedfsdp.compat.torchft import lighthouse_server
from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
from lightning_mixedfsdp.testing.launch import free_port, start_context


def start_lighthouse(min_replicas: int = 1) -> Any:
    """torchft's lighthouse: quorums every 50 ms, a group silent for 1 s is dead, a new quorum waits 0.5 s for
    joiners. ``min_replicas``: no quorum forms with fewer groups (every step then waits for all of them, whatever
    their speed)."""
    return lighthouse_server(
        min_replicas=min_replicas, join_timeout_ms=500, quorum_tick_ms=50, heartbeat_timeout_ms=1000
    )


class Group:
    """One replica group's launch: ``world`` rank processes."""

    def __init__(
        self,
        replica_id: Optional[int],
        lighthouse: Optional[str],
        folder: Path,
        module: str,
        world: int = 2,
        extra: Sequence[str] = (),
        root: Optional[Path] = None,
    ) -> None:
        """``world`` ranks of ``python -m module`` from ``root`` (the current folder by default), with ``extra``
        arguments."""
        root = root or Path.cwd()
        port = free_port()
        self.replica_id = replica_id
        self.processes: List[Any] = []
        for rank in range(world):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
                "NODE_RANK": "0",
                "OMP_NUM_THREADS": "1",
            }
            argv = [module, "--folder", str(folder), *extra]
            if replica_id is not None and lighthouse is not None:
                argv += ["--replica-id", str(replica_id), "--lighthouse", lighthouse]
            output = str(folder / f"g{replica_id}_r{rank}.stderr")
            process = start_context().Process(target=_run_module, args=(argv, env, str(root), output), daemon=False)
            process.start()
            self.processes.append(process)

    def kill(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        for process in self.processes:
            process.join(timeout=30)

    def exit_codes(self) -> List[Optional[int]]:
        return [process.exitcode for process in self.processes]

    def wait(self, timeout: float) -> List[int]:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
        codes = self.exit_codes()
        if None in codes:
            raise TimeoutError(f"replica group {self.replica_id}: ranks still running after {timeout}s: {codes}")
        return codes  # type: ignore[return-value]


def _run_module(argv: List[str], env: Dict[str, str], root: str, output: str) -> None:
    """One rank: ``python -m argv[0] argv[1:]`` in ``root`` with ``env``, stdout and stderr appended to ``output``;
    the process exits with the module's exit code (1 and the traceback on an exception)."""
    import runpy
    import sys
    import traceback

    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(root)
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh interpreter
    descriptor = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.argv = list(argv)
    code = 0
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown racing gloo's or torchft's threads


def records(folder: Path, replica_id: int, rank: int) -> List[Dict[str, Any]]:
    path = folder / f"g{replica_id}_r{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def steps(folder: Path, replica_id: int, rank: int = 0, since_pid: Optional[int] = None) -> List[Dict[str, Any]]:
    return [
        r
        for r in records(folder, replica_id, rank)
        if r["event"] == "step" and (since_pid is None or r["pid"] == since_pid)
    ]


def wait_until(condition: Callable[[], bool], what: str, timeout: float, groups: List[Group], folder: Path) -> None:
    """Poll ``condition``; fail with every rank's stderr tail when it does not come, or a rank dies unasked."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stderr_tails(folder)}")
        for group in groups:
            if any(code not in (None, 0) for code in group.exit_codes()):
                raise AssertionError(f"group {group.replica_id} died while waiting for {what}\n{stderr_tails(folder)}")
        time.sleep(0.1)


def stderr_tails(folder: Path, lines: int = 30) -> str:
    tails = []
    for path in sorted(folder.glob("*.stderr")):
        text = path.read_text().splitlines()[-lines:]
        tails.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(tails)


def read_step(path: Path) -> Optional[int]:
    """The step number a steering file holds (``stop``, ``save``), or None while it is absent or being written."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def fault_tolerant_strategy(
    replica_id: Optional[int], lighthouse: Optional[str], replicate: int = 1, **options: Any
) -> Any:
    """The Fabric strategy of one replica group (``replica_id`` of 2), or of a plain launch when ``replica_id`` is
    None: bf16 blocks with their fp32 norms sharded (200 bytes: the blocks' norms are sharded groups, the final norm
    replicated), full activation checkpointing, ``options`` over those."""
    fault_tolerance: Optional[Dict[str, Any]] = None
    if replica_id is not None:
        fault_tolerance = dict(
            replica_id=replica_id,
            num_replica_groups=2,
            lighthouse=lighthouse,
            timeout_s=20,
            quorum_timeout_s=60,
            connect_timeout_s=5,
        )
    return MixedFSDP2Strategy(
        fault_tolerance=fault_tolerance,
        data_parallel_replicate_size=replicate,
        **{"replicate_below_bytes": 200, "activation_checkpointing": "full", **options},
    )


def build_fabric(
    replica_id: Optional[int],
    lighthouse: Optional[str],
    model: Callable[[], Any],
    world: int = 2,
    replicate: int = 1,
    options: Optional[Dict[str, Any]] = None,
) -> Any:
    """A launched Fabric (bf16-true on the CPU), the ``model()`` it set up and an AdamW over it."""
    import torch
    from lightning.fabric import Fabric

    strategy = fault_tolerant_strategy(replica_id, lighthouse, replicate, **(options or {}))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-true")
    fabric.launch()
    with fabric.init_module():
        built = model()
    built = fabric.setup_module(built)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(built.parameters(), lr=3e-3))
    return fabric, built, optimizer
