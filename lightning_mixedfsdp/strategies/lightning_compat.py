"""Every private Lightning API the strategies use, each behind one small function, checked on lightning 2.6.5 and
2.6.6 (``pyproject.toml`` pins ``lightning>=2.6,<2.7``).

Private hooks the strategies override rather than call (both ``ModelParallelStrategy`` classes): ``setup_environment``
is public; ``_get_process_group_backend`` (``mixin.py``: gloo beside NCCL under CPU offload) is private, and
``_setup_distributed`` calls it to create the process group."""

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Dict, Iterable, Iterator, Optional

from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

# Fabric's hook for ``no_backward_sync``; strategies subclass it (``lightning.fabric.strategies.strategy``).
BackwardSyncControl = _BackwardSyncControl


def lightning_metadata_filename() -> str:
    """The file of a Lightning sharded checkpoint that holds everything but the model and optimizers
    (``lightning.fabric.utilities.load._METADATA_FILENAME``); ``checkpoint/atomic.py`` names it without importing
    Lightning, and a test checks the two agree."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return str(_METADATA_FILENAME)


def rich_available() -> bool:
    """Whether the Trainer's default progress bar is Rich's (``lightning.pytorch.utilities.imports._RICH_AVAILABLE``:
    rich installed in the version Lightning needs); tqdm's otherwise. The runner's bar makes the same choice."""
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return bool(_RICH_AVAILABLE)


def unwrap_fabric_module(module: nn.Module) -> Optional[nn.Module]:
    """The user's module inside Fabric's ``_FabricModule`` (its private ``_forward_module``, which Lightning's own
    strategies unwrap the same way); None for any other module. Registered with ``model/names.py`` when the strategies
    are imported, so the torch-only code below them unwraps Fabric's modules without knowing Lightning."""
    from lightning.fabric.wrappers import _FabricModule

    return module._forward_module if isinstance(module, _FabricModule) else None


def fabric_module_strategy(module: nn.Module) -> Optional[Any]:
    """The strategy that set up a Fabric module (``_FabricModule._strategy``, lightning 2.6.5 and 2.6.6); None for any
    other module."""
    from lightning.fabric.wrappers import _FabricModule

    return module._strategy if isinstance(module, _FabricModule) else None


def has_dtensor_modules(value: object) -> bool:
    """Whether ``value`` is a module with DTensor params: Lightning's own test for "the distributed model" of a
    checkpoint's state (``lightning.fabric.strategies.model_parallel._has_dtensor_modules``), looked up at call time
    so that what Lightning's save decides and what we decide stay the same."""
    from lightning.fabric.strategies import model_parallel

    return bool(model_parallel._has_dtensor_modules(value))


def optimizers_to_device(optimizers: Iterable[Any], device: Any) -> None:
    """Move optimizer states to ``device``, as Lightning's own strategies do at the end of ``setup``
    (``lightning.fabric.utilities.optimizer._optimizers_to_device``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_module_device_mesh(lightning_module: nn.Module, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (``LightningModule._device_mesh``; Lightning's own strategy sets
    it in ``setup_environment``, so ``configure_model`` can reach the mesh)."""
    lightning_module._device_mesh = mesh


class TrainerStepCounter:
    """The Trainer's position (its optimizer-step count, ``trainer.global_step``, and the loop's counters that follow
    it) as a stateful object, so that a fault-tolerant heal gives a restarted replica group the live group's step:
    ``max_steps`` ends every group at the same step, validation runs at the same steps, and the data stream, which
    reads the micro-batches consumed (:func:`micro_batches_consumed`), goes on from the healed step.

    A heal moves every counter by the steps between the two groups (not to the live group's values: a restarted
    loop adds its own corrections on resume). Private, Lightning 2.6.5 and 2.6.6: the epoch loop's
    ``automatic_optimization.optim_progress.optimizer`` (or, under manual optimization,
    ``manual_optimization.optim_step_progress``), ``scheduler_progress``, ``batch_progress`` and
    ``_batches_that_stepped``, the counters Lightning's own checkpoint restores."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def state_dict(self) -> Dict[str, int]:
        """The serving group's steps, and the micro-batches it consumed (before the one in flight, when the heal is
        served from inside a step's first forward)."""
        return {
            "completed": int(_step_progress(self._trainer).total.completed),
            "micro_batches": micro_batches_consumed(self._trainer),
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Move this group's counters by the distance to the live group's: its next batch is then the one its own
        stream holds where the live group is."""
        loop = self._trainer.fit_loop.epoch_loop
        steps = state["completed"] - int(_step_progress(self._trainer).total.completed)
        batches = state["micro_batches"] - micro_batches_consumed(self._trainer)
        if steps:
            _step_progress(self._trainer).increment_by(steps)
            module = self._trainer.lightning_module
            if module is None or module.automatic_optimization:
                loop.automatic_optimization.optim_progress.optimizer.zero_grad.increment_by(steps)
            loop.scheduler_progress.increment_by(steps)
            loop._batches_that_stepped += steps
        if batches:
            loop.batch_progress.increment_by(batches)


def _step_progress(trainer: Any) -> Any:
    loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        return loop.automatic_optimization.optim_progress.optimizer.step
    return loop.manual_optimization.optim_step_progress


def undo_optimizer_step(trainer: Any) -> None:
    """Inside ``Strategy.optimizer_step`` of a step that was not taken (a discarded fault-tolerant step): the step
    is not counted. Lightning counted it ready before calling the strategy and counts it completed after, and counts
    the batch as having stepped at the batch's end, so each is taken back here, ahead (Lightning 2.6.5 and 2.6.6:
    ``automatic.py`` ``_optimizer_step``, ``training_epoch_loop.py`` ``on_advance_end``). The batch stays consumed."""
    progress = _step_progress(trainer)
    for tracker in (progress.total, progress.current):
        tracker.ready -= 1
        tracker.completed -= 1
    trainer.fit_loop.epoch_loop._batches_that_stepped -= 1


def micro_batches_consumed(trainer: Any) -> int:
    """The training micro-batches consumed so far, discarded steps' included, restored by a resume and moved by a
    heal: where a resumable data stream goes on. ``fit_loop.epoch_loop.batch_progress.total.processed`` (Lightning
    2.6.5 and 2.6.6): it counts the batch a checkpoint was saved at the end of, before and after the loop's restart
    completes it, and not the batch in flight."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)


@contextmanager
def optimizer_state_keyed_by_name(enabled: bool = True) -> Iterator[None]:
    """Inside, Lightning's DCP save and load (``lightning.fabric.strategies.model_parallel._save_checkpoint`` and
    ``_load_checkpoint``, which call torch's ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` with fixed
    options) key optimizer state and param groups by param name (``flatten_optimizer_state_dict=True``, as
    torchtitan saves): pipeline stages hold different params, and param groups keyed by index would collide across
    them in one checkpoint. Both module attributes are looked up by Lightning at each call (lightning 2.6.5, 2.6.6);
    they are restored on exit."""
    if not enabled:
        yield
        return
    import torch.distributed.checkpoint.state_dict as torch_state_dict

    get, put = torch_state_dict.get_optimizer_state_dict, torch_state_dict.set_optimizer_state_dict

    def by_name(options: Any) -> Any:
        return replace(options or torch_state_dict.StateDictOptions(), flatten_optimizer_state_dict=True)

    def get_by_name(model: Any, optimizers: Any, *, submodules: Any = None, options: Any = None) -> Any:
        return get(model, optimizers, submodules=submodules, options=by_name(options))

    def put_by_name(model: Any, optimizers: Any, optim_state_dict: Any, *, options: Any = None) -> Any:
        return put(model, optimizers, optim_state_dict, options=by_name(options))

    torch_state_dict.get_optimizer_state_dict = get_by_name
    torch_state_dict.set_optimizer_state_dict = put_by_name
    try:
        yield
    finally:
        torch_state_dict.get_optimizer_state_dict, torch_state_dict.set_optimizer_state_dict = get, put
