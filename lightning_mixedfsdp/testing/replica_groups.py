"""Replica groups as separate launches, the way a user runs them: a lighthouse in the calling process, each group's
ranks as processes with their own MASTER_PORT (what torchrun gives each launch), killed with SIGKILL and restarted
by the caller. The ranks run a worker module (``python -m <module>``) and report through JSON lines."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from lightning_mixedfsdp.compat.torchft import lighthouse_server
from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
from lightning_mixedfsdp.testing.launch import free_port


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
        self.processes: List[subprocess.Popen] = []
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
                # after a compat torch's folder (.ci/compat), which must come before the venv's torch
                "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(root)) if p),
                "OMP_NUM_THREADS": "1",
            }
            command = [sys.executable, "-m", module, "--folder", str(folder), *extra]
            if replica_id is not None and lighthouse is not None:
                command += ["--replica-id", str(replica_id), "--lighthouse", lighthouse]
            stderr = (folder / f"g{replica_id}_r{rank}.stderr").open("a")
            self.processes.append(subprocess.Popen(command, env=env, cwd=root, stdout=stderr, stderr=stderr))

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in self.processes:
            process.wait(timeout=30)

    def exit_codes(self) -> List[Optional[int]]:
        return [process.poll() for process in self.processes]

    def wait(self, timeout: float) -> List[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for process in self.processes:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        return codes


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
