"""Each example runs as written (tiny sizes), launching its own processes like a user would."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fabric_quickstart_trains_with_fp32_norms_on_two_processes() -> None:
    completed = subprocess.run(
        [sys.executable, "examples/fabric_quickstart.py", "--steps", "6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    out = completed.stdout
    assert "mixed_fsdp2 dtype plan" in out
    first = float(out.split("step   0  loss ")[1].split()[0])
    last = float(out.split("final loss ")[1].split(";")[0])
    assert last < first, out
    assert "norm weight dtype torch.float32, wq dtype torch.bfloat16" in out


def _run_example(*args: str) -> str:
    completed = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout + completed.stderr


def test_trainer_example_trains_with_a_replicated_fp32_a_log() -> None:
    out = _run_example("examples/trainer_lightning_module.py", "--steps", "6")
    assert "final loss" in out and "A_log torch.float32, norm torch.float32" in out


def test_hf_example_keeps_the_models_keep_in_fp32_norms_fp32(tmp_path: Path) -> None:
    out = _run_example("examples/hf_transformers.py", "--steps", "3", "--export", str(tmp_path))
    assert "hf:_keep_in_fp32_modules[norm]" in out
    assert "final loss" in out and "model.norm torch.float32" in out
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()


def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start (Fabric)", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    completed = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "mixed_fsdp2 dtype plan" in completed.stdout
