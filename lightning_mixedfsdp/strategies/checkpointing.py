"""The one save and load sequence both strategies run around Lightning's own, and the exports.

A save: under fault tolerance only the replica group that writes this checkpoint goes on; fault tolerance's state is
added; params whose optimizer state only some ranks hold get a stand-in (``checkpoint/optimizer_state.py``); the
checkpoint is written beside its path and committed by rename (``checkpoint/atomic.py``). A load: an interrupted
commit is recovered; params whose state the checkpoint lacks resume as "no state yet"; the stand-in record and fault
tolerance's entry are taken out of what Lightning returns."""

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mixedfsdp.checkpoint.atomic import PathLike, recovered, save_atomically
from lightning_mixedfsdp.checkpoint.export import AlsoWrite, PipelineStages, export_adapter, export_model
from lightning_mixedfsdp.checkpoint.fingerprint import FINGERPRINT_KEY, fingerprint_differences, frozen_fingerprints
from lightning_mixedfsdp.checkpoint.manifest import MANIFEST_KEY, manifest_differences
from lightning_mixedfsdp.checkpoint.optimizer_state import (
    ABSENT_STATE_KEY,
    AbsentState,
    holds_outer_state,
    optimizer_state_by_name,
    restoring_missing_state,
    standing_in_for_state_ranks_lack,
)
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.fault_tolerance.hooks import NoFaultTolerance
from lightning_mixedfsdp.model_setup import ShardedModels
from lightning_mixedfsdp.planning.types import ShardPlan
from lightning_mixedfsdp.strategies.lightning_compat import optimizer_state_keyed_by_name

WriteCheckpoint = Callable[[Path, Dict[str, Any]], None]
"""Lightning's own save of a state into a path."""


class CheckpointingMixin:
    """Save, load and export for the Fabric and Trainer strategies (mixed in with ``mixin.MixedFSDP2Mixin``)."""

    _config: MixedFSDPConfig
    _fault_tolerance: NoFaultTolerance
    _sharded: ShardedModels
    _making_optimizer_state: bool
    _save_distributed_checkpoint: bool
    global_rank: int
    broadcast: Callable[..., Any]
    barrier: Callable[..., Any]
    plan_of: Callable[[nn.Module], ShardPlan]
    _same_params_group: Callable[[], Any]
    _export_stages: Callable[[nn.Module], Optional[PipelineStages]]

    def _save_checkpoint(
        self,
        path: PathLike,
        state: Dict[str, Any],
        write: WriteCheckpoint,
        absent: Any,
        module: Optional[nn.Module],
    ) -> None:
        """The save sequence; ``absent`` is the context that yields what stands in for missing optimizer state,
        ``module`` the model whose frozen base the checkpoint fingerprints (none: no fingerprint)."""
        if not self._fault_tolerance.writes_checkpoints():  # another live replica group writes this one
            return
        state = self._fault_tolerance.with_state(state)
        fingerprints = frozen_fingerprints(module) if module is not None else {}
        if fingerprints:
            state = {**state, FINGERPRINT_KEY: fingerprints}
        manifest = self._manifest(module)
        if manifest is not None:
            state = {**state, MANIFEST_KEY: manifest}
        by_name = self._config.parallelism.pipeline_parallel_size > 1  # stages hold different params
        with absent as standing_in:
            to_save = {**state, ABSENT_STATE_KEY: standing_in} if standing_in else state
            single_file = not self._save_distributed_checkpoint
            save_atomically(
                path,
                lambda temp: _keyed_by_name(by_name, lambda: write(temp, to_save)),
                single_file,
                self.broadcast,
                self.barrier,
                self.global_rank == 0,
                type(self).__name__,
            )

    def _load_checkpoint(
        self,
        path: PathLike,
        module: Optional[nn.Module],
        optimizers: Dict[str, Optimizer],
        weights_only: Optional[bool],
        read: Callable[[Path], Dict[str, Any]],
        strict: bool,
    ) -> Dict[str, Any]:
        """The load sequence around Lightning's ``read``; returns what Lightning returns, our entries taken out. The
        frozen base is compared with the checkpoint's fingerprint: a different one raises under ``strict``, warns
        otherwise."""
        path = recovered(path, self.broadcast, self.barrier, self.global_rank == 0)
        holds_outer = bool(self._sharded.outer_syncs()) and holds_outer_state(path, weights_only)
        with self._loading_optimizers(path, module, optimizers, weights_only, holds_outer):
            loaded = _keyed_by_name(optimizer_state_by_name(path), lambda: read(path))
        restart_outer_syncs_not_loaded(self._sharded, path, bool(optimizers), type(self).__name__, self.global_rank)
        loaded.pop(ABSENT_STATE_KEY, None)
        self._fault_tolerance.restore_state(loaded)
        saved = loaded.pop(FINGERPRINT_KEY, None)
        if saved is not None and module is not None:
            self._check_frozen_base(path, saved, frozen_fingerprints(module), strict)
        saved_manifest, manifest = loaded.pop(MANIFEST_KEY, None), self._manifest(module)
        if saved_manifest is not None and manifest is not None:
            self._check_manifest(path, saved_manifest, manifest)
        return loaded

    def _manifest(self, module: Optional[nn.Module]) -> Optional[Dict[str, str]]:
        """The keep-fp32 manifest of ``module``'s plan, or of its children's (a LightningModule, whose children the
        Trainer strategy shards one by one), names prefixed; None when this strategy planned none of them."""
        if module is None:
            return None
        try:
            return self.plan_of(module).keep_fp32_manifest
        except KeyError:
            pass
        manifest: Dict[str, str] = {}
        planned = False
        for prefix, child in module.named_children():
            try:
                manifest.update({f"{prefix}.{n}": rule for n, rule in self.plan_of(child).keep_fp32_manifest.items()})
                planned = True
            except KeyError:
                continue
        return manifest if planned else None

    def _check_manifest(self, path: Path, saved: Dict[str, str], current: Dict[str, str]) -> None:
        differences = manifest_differences(saved, current)
        if differences and self.global_rank == 0:
            warnings.warn(
                f"{type(self).__name__}: the keep-fp32 rules pin another set of tensors than when the checkpoint"
                f" {str(path)!r} was saved ({'; '.join(differences)}). Tensors it trained in fp32 and now plans in"
                " bf16 lose their low bits; set dtypes.keep_fp32_params/keep_fp32_modules as they were to keep them.",
                stacklevel=3,
            )

    def _check_frozen_base(self, path: Path, saved: Dict[str, str], current: Dict[str, str], strict: bool) -> None:
        problems = fingerprint_differences(saved, current)
        if not problems:
            return
        message = (
            f"{type(self).__name__}: the model's frozen base is not the one the checkpoint {str(path)!r} was trained"
            f" on ({'; '.join(problems)}). Checkpoints leave the frozen (4-bit) base out: load the pretrained weights"
            " into the model after setup (`lightning_mixedfsdp.load_full_weights(model, '<pretrained folder>')`,"
            " or the recipe's model.pretrained), then load the checkpoint."
        )
        if strict:
            raise ValueError(message + " With strict=False the checkpoint loads with a warning instead.")
        warnings.warn(message, stacklevel=3)

    def _saving_optimizers(self, module: Optional[nn.Module], optimizers: Dict[str, Optimizer]) -> ContextManager:
        """Around Lightning's save: params whose state only some ranks hold get a stand-in on the others; yields the
        record to save under ``ABSENT_STATE_KEY`` (empty: none)."""
        group = self._same_params_group()
        standing_in = standing_in_for_state_ranks_lack(module, optimizers, group) if module and optimizers else None
        return self._making_state(standing_in, outer_state=True)

    def _loading_optimizers(
        self,
        path: Path,
        module: Optional[nn.Module],
        optimizers: Dict[str, Optimizer],
        weights_only: Optional[bool],
        holds_outer_state: bool,
    ) -> ContextManager:
        """Around Lightning's load: params whose state the checkpoint lacks (they never got a grad) resume as "no
        state yet"; the zero-lr steps torch takes to make optimizer state are no training steps; the optimizers'
        templates ask for semi-synchronous replicas' outer state when the checkpoint holds it (DCP refuses a template
        key the checkpoint lacks)."""
        for outer in self._sharded.outer_syncs():
            outer.loaded = False
        restoring = restoring_missing_state(path, module, optimizers, weights_only) if module is not None else None
        return self._making_state(restoring if optimizers else None, outer_state=holds_outer_state)

    @contextmanager
    def _making_state(self, inner: Optional[ContextManager], outer_state: bool = False) -> Iterator[AbsentState]:
        """Inside, torch's zero-lr steps that make optimizer state are no training steps; with ``outer_state`` the
        optimizers' state dicts carry semi-synchronous replicas' outer state (a save, a load of a checkpoint that holds
        it)."""
        self._making_optimizer_state = True
        try:
            with self._sharded.outer_state_in_checkpoint(outer_state):
                if inner is None:
                    yield {}
                else:
                    with inner as value:
                        yield value or {}
        finally:
            self._making_optimizer_state = False

    def export_safetensors(
        self,
        module: nn.Module,
        directory: PathLike,
        dtype: torch.dtype = torch.bfloat16,
        max_shard_bytes: int = 5 * 2**30,
        also_write: Optional[AlsoWrite] = None,
    ) -> Optional[List[Path]]:
        """Consolidate ``module``'s weights into HF-style safetensors in ``dtype``; the tensors the plan keeps in fp32
        (keep-fp32 params, fp32 buffers) stay fp32. Every rank calls it; rank 0 writes, committing the whole export
        at once (``also_write(folder)``: more files of yours in it, on rank 0, e.g. a tokenizer). Each rank holds at
        most about ``weights.export_chunk_bytes`` of a tensor at once."""
        chunk = self._config.weights.export_chunk_bytes
        plan, stages = self.plan_of(module), self._export_stages(module)
        return export_model(module, directory, dtype, plan, max_shard_bytes, chunk, also_write, stages)

    def export_adapter(self, module: nn.Module, directory: PathLike) -> Optional[List[Path]]:
        """Write the active adapter of a PEFT ``module`` in PEFT's own format (``adapter_model.safetensors`` +
        ``adapter_config.json``); ``PeftModel.from_pretrained(base, directory)`` loads it. Every rank calls it."""
        self.plan_of(module)  # set up by this strategy
        return export_adapter(module, directory)


def restart_outer_syncs_not_loaded(
    sharded: ShardedModels, path: Path, with_optimizers: bool, owner: str, global_rank: int
) -> None:
    """After a load, the loaded params are every replica's; an outer sync whose state the load did not carry starts
    afresh from them (a global copy taken before the load would measure the next cycle from the wrong start)."""
    for outer in sharded.outer_syncs():
        if outer.loaded:
            continue
        outer.reset()
        if outer.method == "diloco" and with_optimizers and global_rank == 0:
            warnings.warn(
                f"{owner}: the checkpoint {str(path)!r} holds no outer state for replicate_sync='diloco' (it was saved"
                " by a run that synced every step, or before the outer state was saved), so DiLoCo's global copy is"
                " taken from the loaded params, its momentum starts at zero and the cycle at step 0. Resume from a"
                " checkpoint of this run to continue its outer optimizer.",
                stacklevel=4,
            )


def _keyed_by_name(enabled: bool, action: Callable[[], Any]) -> Any:
    """``action()`` with Lightning's optimizer state keyed by param name when ``enabled`` (pipeline stages)."""
    with optimizer_state_keyed_by_name(enabled):
        return action()
