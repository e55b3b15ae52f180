"""Settings refused before any process starts: what a strategy's constructor and the accelerator Lightning hands it
can tell (the extras a setting needs are installed; float8 has a device with float8 matmuls, whatever the plan's size
filter will decide). The recipe loader asks the same questions (``setting_problems``), so a recipe is refused once,
before launch, with every problem at once."""

from dataclasses import dataclass
from typing import Any, List, Literal

from lightning_mixedfsdp.compat import torchao as torchao_compat
from lightning_mixedfsdp.compat.extras import missing_message
from lightning_mixedfsdp.config import MixedFSDPConfig


@dataclass(frozen=True)
class SettingProblem:
    """One setting that cannot run, with its fix."""

    kind: Literal["missing_package", "device"]
    """``missing_package``: an optional package the setting needs is not installed (refused at construction, as an
    ``ImportError``); ``device``: the accelerator cannot run it (refused once Lightning hands the accelerator over)."""
    message: str

    def __str__(self) -> str:
        return self.message


def setting_problems(config: MixedFSDPConfig, device_type: str) -> List[SettingProblem]:
    """What cannot run with these settings on ``device_type`` (``cpu``, ``cuda``, ...), each with its fix."""
    problems: List[SettingProblem] = []
    recipe = config.float8.recipe
    if recipe is not None and not config.float8.emulate and device_type != "cuda":
        message = (
            f"float8.recipe={recipe!r} needs float8 matmuls, which the {device_type.upper()} lacks (a CUDA GPU of"
            " compute capability 8.9 or later: L4, L40S, H100, H200, B200). Set float8.emulate=True to emulate"
            " them in the compute dtype (float8's numerics, no speed gain), or leave float8 off."
        )
        problems.append(SettingProblem("device", message))
    if recipe is not None and not torchao_compat.torchao_installed():
        problems.append(
            SettingProblem("missing_package", missing_message("torchao", f"float8.recipe={recipe!r}", "float8"))
        )
    if config.memory.quantize_base is not None and not torchao_compat.torchao_installed():
        base = f"memory.quantize_base={config.memory.quantize_base!r}"
        problems.append(SettingProblem("missing_package", missing_message("torchao", base, "qlora")))
    return problems


def check_extras(config: MixedFSDPConfig, owner: str) -> None:
    """Refuse settings whose optional packages are missing (an ImportError naming ``owner``, with the install
    line), before any process starts."""
    missing = [str(p) for p in setting_problems(config, "cuda") if p.kind == "missing_package"]
    if missing:
        raise ImportError(f"{owner}: " + " ".join(missing))


def check_accelerator(config: MixedFSDPConfig, device_type: str, owner: str) -> None:
    """Refuse settings that cannot run on the accelerator Lightning chose (a ValueError naming ``owner``)."""
    problems = [str(p) for p in setting_problems(config, device_type) if p.kind == "device"]
    if problems:
        raise ValueError(f"{owner}: " + " ".join(problems))


def accelerator_device_type(accelerator: Any) -> str:
    """The device type of a Lightning accelerator (``cpu``, ``cuda``, ``mps``), by Lightning's own classes."""
    from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator

    for kind, name in ((CUDAAccelerator, "cuda"), (CPUAccelerator, "cpu"), (MPSAccelerator, "mps")):
        if isinstance(accelerator, kind):
            return name
    from lightning.pytorch.accelerators import CPUAccelerator as TrainerCPU
    from lightning.pytorch.accelerators import CUDAAccelerator as TrainerCUDA

    if isinstance(accelerator, TrainerCUDA):
        return "cuda"
    return "cpu" if isinstance(accelerator, TrainerCPU) else type(accelerator).__name__.lower()
