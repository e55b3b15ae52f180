"""Each example runs as written (tiny sizes): the HF example and README's quick start launching their own processes
like a user would, the Fabric and Trainer examples on 2 ranks forked from the tests' fork server (started as torchrun
starts them: the script finds its processes launched); the four run together (``tests/launch_together.py``), each
test reads its own."""

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lightning_mixedfsdp.testing import run_distributed
from tests.launch_together import run_together

ROOT = Path(__file__).resolve().parents[1]


def _run(command: List[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True, timeout=300)


def _script_on_ranks(rank: int, world_size: int, command: List[str], cwd: str) -> str:
    """``python script args`` as this rank (``runpy``, ``__main__``): what it printed."""
    import contextlib
    import io
    import os
    import runpy

    os.chdir(cwd)
    sys.argv = list(command)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        runpy.run_path(command[0], run_name="__main__")
    return printed.getvalue()


def _run_on_ranks(command: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """The script on 2 forked ranks, reported as its command would be: rank 0's output, or the failing rank's
    traceback with exit code 1."""
    try:
        printed = run_distributed(_script_on_ranks, 2, command, str(cwd), timeout=300)[0]
    except AssertionError as failed:
        return subprocess.CompletedProcess(command, 1, "", str(failed))
    return subprocess.CompletedProcess(command, 0, printed, "")


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("examples")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start (Fabric)", 1)[1]
    (folder / "quick_start.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    (folder / "export").mkdir()
    commands = {
        "fabric": (_run_on_ranks, ["examples/fabric_quickstart.py", "--steps", "6"], ROOT),
        "trainer": (_run_on_ranks, ["examples/trainer_lightning_module.py", "--steps", "6"], ROOT),
        "hf": (_run, ["examples/hf_transformers.py", "--steps", "3", "--export", str(folder / "export")], ROOT),
        "readme": (_run, [str(folder / "quick_start.py")], folder),
    }
    out: Dict[str, Any] = run_together(
        {n: (lambda r=run, c=command, w=cwd: r(c, w)) for n, (run, command, cwd) in commands.items()}
    )
    out["folder"] = folder
    return out


def _output(examples: Dict[str, Any], name: str) -> str:
    completed = examples[name]
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout + completed.stderr


def test_fabric_quickstart_trains_with_fp32_norms_on_two_processes(examples: Dict[str, Any]) -> None:
    _output(examples, "fabric")
    out = examples["fabric"].stdout
    assert "mixed_fsdp2 dtype plan" in out
    first = float(out.split("step   0  loss ")[1].split()[0])
    last = float(out.split("final loss ")[1].split(";")[0])
    assert last < first, out
    assert "norm weight dtype torch.float32, wq dtype torch.bfloat16" in out


def test_trainer_example_trains_with_a_replicated_fp32_a_log(examples: Dict[str, Any]) -> None:
    out = _output(examples, "trainer")
    assert "final loss" in out and "A_log torch.float32, norm torch.float32" in out


def test_hf_example_keeps_the_models_keep_in_fp32_norms_fp32(examples: Dict[str, Any]) -> None:
    out = _output(examples, "hf")
    export = examples["folder"] / "export"
    assert "hf:_keep_in_fp32_modules[norm]" in out
    assert "final loss" in out and "model.norm torch.float32" in out
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()


def test_readme_quick_start_runs_as_written(examples: Dict[str, Any]) -> None:
    _output(examples, "readme")
    assert "mixed_fsdp2 dtype plan" in examples["readme"].stdout
