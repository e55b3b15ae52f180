"""GRPO's generator processes (``rl.generation: ranks``) as processes: started by trainer rank 0 in a clean
environment, waited for while they join (their exits watched meanwhile), named with their exit code and the traceback
each leaves when one has exited, and stopped with the run's temporary folder removed. What travels between them and
the trainers is ``generator_ranks.py``'s."""

import atexit
import datetime
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from lightning_mixedfsdp.compat.torch import rendezvous_store, standalone_gloo_group

GENERATOR_MODULE = "lightning_mixedfsdp.recipes.run.generator_process"
LAUNCH_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
"""The trainers' launch variables, left out of a generator's environment: it is a world of its own."""
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "LSB_", "LSF_")
"""Variables of launchers and schedulers that Lightning's cluster environments read (torchrun's agent store under
``TORCHELASTIC_USE_AGENT_STORE`` made a generator's world of one wait for a store that is not there), left out too."""
JOIN_POLL_S = 1.0
"""How often trainer rank 0 looks at the generator processes while it waits for them to join."""
ERROR_FILE = "generator_{rank}_error.txt"
"""The traceback a generator process leaves in the run's temporary folder before it exits on an error."""


class GeneratorDied(RuntimeError):
    """A generator process exited while the trainers needed it."""


def generator_environment(environment: Mapping[str, str]) -> Dict[str, str]:
    """``environment`` without the trainers' launch variables and any launcher's or scheduler's."""
    return {
        name: value
        for name, value in environment.items()
        if name not in LAUNCH_ENVIRONMENT and not name.startswith(LAUNCHER_PREFIXES)
    }


class GeneratorProcesses:
    """Trainer rank 0's generator processes and the temporary folder they read the recipe from."""

    def __init__(self, count: int, timeout_s: float) -> None:
        self.count, self.timeout_s = count, timeout_s
        self.processes: List[subprocess.Popen] = []
        self.folder: Optional[Path] = None

    def start(self, recipe: Any) -> Any:
        """Start the generators on ``recipe`` and wait for each to join their process group (watching for exits:
        :class:`GeneratorDied`); the group."""
        store = rendezvous_store("127.0.0.1", 0, 1 + self.count, True, self.timeout_s)
        self.folder = Path(tempfile.mkdtemp(prefix="generator_ranks_"))  # removed at close
        atexit.register(self.terminate)  # an exception Lightning hands to no hook: stopped at the process's exit
        recipe_file = self.folder / "recipe.pkl"
        recipe_file.write_bytes(pickle.dumps(recipe))
        environment = generator_environment(os.environ)
        for rank in range(1, 1 + self.count):
            command = [sys.executable, "-m", GENERATOR_MODULE, str(recipe_file), f"127.0.0.1:{store.port}",
                       str(rank), str(1 + self.count)]  # fmt: skip
            self.processes.append(subprocess.Popen(command, env=environment))
        joined = [f"joined/{rank}" for rank in range(1, 1 + self.count)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                store.wait(joined, datetime.timedelta(seconds=JOIN_POLL_S))
                break
            except RuntimeError:  # not all of them yet (torch's DistStoreError on the wait's timeout)
                self.check("while starting")
                if time.monotonic() > deadline:
                    raise GeneratorDied(f"{self.who()} did not join within {self.timeout_s:.0f} s") from None
        self._store = store  # the group's store lives as long as the group
        return standalone_gloo_group(store, 0, 1 + self.count, self.timeout_s)

    def check(self, when: str) -> None:
        """Raise :class:`GeneratorDied` naming each generator process that has exited, with its exit code and the
        traceback it left."""
        dead = [(rank, process) for rank, process in enumerate(self.processes, 1) if process.poll() is not None]
        if dead:
            raise GeneratorDied("; ".join(self._death(rank, process, when) for rank, process in dead))

    def _death(self, rank: int, process: subprocess.Popen, when: str) -> str:
        code = process.returncode
        try:
            signal_name = f" ({signal.Signals(-code).name})" if code < 0 else ""
        except ValueError:  # not a signal this platform names
            signal_name = ""
        said = f"generator rank {rank} (pid {process.pid}) exited {when} with exit code {code}{signal_name}"
        error = self.folder / ERROR_FILE.format(rank=rank) if self.folder is not None else None
        if error is not None and error.exists():
            said += f"; its traceback:\n{error.read_text()}"
        else:
            said += "; it left no traceback (killed, or out of memory): see its output above and the system's log"
        return said

    def who(self) -> str:
        return f"generator rank(s) {list(range(1, 1 + self.count))}"

    def wait(self, timeout_s: float) -> None:
        """Wait for every process to exit by itself (told to stop), up to ``timeout_s`` each."""
        for process in self.processes:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass

    def terminate(self) -> None:
        """Stop every generator process still running (SIGTERM, then SIGKILL after 10 s) and remove the folder."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
