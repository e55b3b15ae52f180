"""The plan's data: every param's dtypes and FSDP group, every floating buffer's dtype, and the groups in the order
they are applied. Plain frozen dataclasses and enums; the planner (``planner.py``) makes them, the report
(``report.py``) prints them, apply, materialise, load and export read them."""

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch

from lightning_mixedfsdp.config import BulkDtypes, short_dtype
from lightning_mixedfsdp.model.names import is_within
from lightning_mixedfsdp.model.quantized import NF4, nf4_nbytes
from lightning_mixedfsdp.planning.experts import ExpertPlan
from lightning_mixedfsdp.planning.float8 import Float8Choice
from lightning_mixedfsdp.planning.matching import KeepRule

ROOT = ""
"""The root module's canonical name."""


class ReplicationReason(str, Enum):
    """Why a group of params is replicated on every data-parallel rank instead of sharded."""

    INSEPARABLE = "inseparable"
    """No module boundary separates the params from those of another dtype (a bare fp32 param beside bf16 ones)."""
    SMALL = "small"
    """The group is below ``replicate_below_bytes``: one all-reduce costs less than an all-gather per use."""
    CONDITIONAL = "runs for some inputs"
    """A minority dtype inside a module that runs for some inputs only (a tower's fp32 norms): a group of its own
    would all-gather on the ranks that run it and not on the others."""


class BufferSource(str, Enum):
    """What set a floating buffer's planned dtype, in order of precedence."""

    KEEP_FP32 = "keep-fp32 rule"
    FROZEN = "frozen module"
    CAST = "cast_buffers"
    CONSTRUCTED = "HF construction in the compute dtype"
    BUILT = "as built"


@dataclass(frozen=True)
class DtypeKey:
    """What FSDP needs uniform within a group: storage (original), compute (all-gather), reduce and output dtype."""

    storage: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    output: Optional[torch.dtype] = None

    def __str__(self) -> str:
        text = f"{short_dtype(self.storage)}/{short_dtype(self.compute)}/{short_dtype(self.reduce)}"
        return f"{text}->{short_dtype(self.output)}" if self.output is not None else text


@dataclass(frozen=True)
class ShardGroup:
    """One ``fully_shard`` call (``replicated=False``) or one replicated set of params (``replicated=True``)."""

    name: str
    unit: str
    """The wrap unit the group belongs to (``""`` for the root)."""
    modules: Tuple[str, ...]
    """Canonical module names; a sharded group with several is one list-form ``fully_shard([...])``. For a replicated
    group these are the modules whose inputs/outputs are cast to the key's compute/output dtype (empty when no
    module boundary separates the params)."""
    key: DtypeKey
    params: Tuple[str, ...]
    replicated: bool = False
    is_root: bool = False
    reason: Optional[ReplicationReason] = None
    """Why a group is replicated (None for a sharded group)."""
    expert: bool = False
    """An experts module under expert parallelism: sharded over the ranks holding the same experts."""


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shape: Tuple[int, ...]
    key: DtypeKey
    requires_grad: bool
    group: str
    replicated: bool
    rule: Optional[KeepRule]
    """The keep-fp32 rule that pinned the param to fp32, if one did."""
    init_dtype: Optional[torch.dtype] = None
    """The dtype its init runs in when the model was built on the meta device: as built (random draws depend on the
    dtype), fp32 when a keep-fp32 rule pins it even if it was built under a bf16 default dtype (``init_module()``)."""
    quantized: Optional[str] = None
    """The 4-bit format of a frozen base weight (``"nf4"``); ``key.storage`` is then its nominal dtype, the dtype it
    dequantizes to and computes in. None: stored in ``key.storage``."""

    @property
    def nbytes(self) -> int:
        if self.quantized == NF4:
            return nf4_nbytes(math.prod(self.shape), self.key.storage)
        return math.prod(self.shape) * self.key.storage.itemsize

    @property
    def storage_name(self) -> str:
        """The storage as the report prints it: ``nf4`` for a quantized weight, else the dtype's short name."""
        return self.quantized or short_dtype(self.key.storage)


@dataclass(frozen=True)
class BufferPlan:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    source: BufferSource
    """What set the dtype."""
    rule: Optional[KeepRule] = None
    """The keep-fp32 rule, when ``source`` is :attr:`BufferSource.KEEP_FP32`."""
    init_dtype: Optional[torch.dtype] = None
    """The dtype its init runs in for a model built on the meta device (see :attr:`ParamPlan.init_dtype`)."""

    @property
    def set_by(self) -> str:
        """What set the dtype, as the report prints it: the keep-fp32 rule, or the source."""
        return str(self.rule) if self.rule is not None else self.source.value


@dataclass(frozen=True)
class ShardPlan:
    """Every param's dtypes and group, every buffer's dtype, and the groups in application order (children first,
    root last)."""

    bulk: BulkDtypes
    params: Dict[str, ParamPlan]
    groups: Tuple[ShardGroup, ...]
    buffers: Dict[str, BufferPlan]
    units: Tuple[str, ...] = ()
    """The wrap units, children before parents (the root is implicit)."""
    keep_fp32_modules: Tuple[str, ...] = ()
    """Modules matched by a keep-fp32 class rule: they compute in fp32 on purpose."""
    warnings: Tuple[str, ...] = ()
    experts: Optional[ExpertPlan] = None
    """Expert parallelism: the experts modules, their split params and the plan handed to transformers."""
    non_persistent_buffers: FrozenSet[str] = frozenset()
    """Planned buffers that no state dict holds (a rotary ``inv_freq``): rebuilt, never saved or loaded."""
    not_quantized: Dict[str, str] = field(default_factory=dict)
    """With ``quantize_base``: every frozen ``nn.Linear`` weight left in its dtype, with the reason."""
    offload: Optional[str] = None
    """``"cpu"``: the sharded groups' params, grads and optimizer states live in host memory."""
    offload_frozen: Optional[str] = None
    """``"cpu"``: the sharded groups with no trainable param keep their params in host memory."""
    bf16_updates: str = "nearest"
    """How the optimizer's result is written into trainable bf16 params: ``nearest``, ``stochastic``, ``kahan``."""
    float8_recipe: Optional[str] = None
    """The float8 recipe (``"tensorwise"``, ``"rowwise"``), or None."""
    float8: Dict[str, Float8Choice] = field(default_factory=dict)
    """With a float8 recipe: every ``nn.Linear`` module's decision, with its reason."""
    float8_left_experts: Tuple[str, ...] = ()
    """With a float8 recipe: the fused MoE experts modules, which stay in the compute dtype."""
    replica_groups: Optional[int] = None
    """Fault tolerance: the torchft replica groups every gradient is also averaged across, each group's in its own
    reduce dtype; None: off."""
    context_parallel: int = 1
    """Ranks each sequence is split over (ring attention); params are sharded over the shard ranks times these."""
    conditional_modules: Tuple[str, ...] = ()
    """Modules that run for some inputs only (a vision tower, a projector): never units; their params ride in the
    unit around them, which reduces zeros for the trainable ones a rank did not run (``planning/conditional.py``)."""
    fp32_compute: Dict[str, str] = field(default_factory=dict)
    """``dtypes.fp32_compute_modules``: each ``nn.Linear`` module that computes in fp32 while stored in its group's
    dtype, with the entry that matched it (``apply/fp32_compute.py``)."""
    frozen_pinned: Tuple[str, ...] = ()
    """Frozen params held as a frozen module's are (its compute dtype: no fp32 master, no fp32 reduce) where a
    trainable param would get other dtypes: made trainable after setup they would train without what the precision
    promises, so doing so is refused at the next forward (``apply/unfreeze.py``)."""

    def trains(self, group: ShardGroup) -> bool:
        """Whether any of ``group``'s params requires grad at setup."""
        return any(self.params[name].requires_grad for name in group.params)

    def cross_replica_reductions(self) -> Dict[torch.dtype, int]:
        """With fault tolerance: the all-reduces across replica groups per step, by reduce dtype (one per trainable
        sharded group, one per replicated bucket); empty without."""
        if self.replica_groups is None:
            return {}
        counts: Dict[torch.dtype, int] = {}
        for group in self.sharded_groups:
            if any(self.params[p].requires_grad for p in group.params):
                counts[group.key.reduce] = counts.get(group.key.reduce, 0) + 1
        for dtype in {self.params[p].key.reduce for p in self.replicated_params if self.params[p].requires_grad}:
            counts[dtype] = counts.get(dtype, 0) + 1
        return counts

    @property
    def float8_modules(self) -> Tuple[str, ...]:
        """The Linear layers converted to float8 training."""
        return tuple(name for name, choice in self.float8.items() if choice.converted)

    @property
    def quantized_params(self) -> Tuple[str, ...]:
        """The frozen base weights stored in 4 bits."""
        return tuple(name for name, p in self.params.items() if p.quantized is not None)

    @property
    def sharded_groups(self) -> Tuple[ShardGroup, ...]:
        return tuple(g for g in self.groups if not g.replicated)

    @property
    def replicated_groups(self) -> Tuple[ShardGroup, ...]:
        return tuple(g for g in self.groups if g.replicated)

    @property
    def replicated_params(self) -> Tuple[str, ...]:
        return tuple(p for g in self.replicated_groups for p in g.params)

    @property
    def mixed_dtype_groups(self) -> Tuple[str, ...]:
        """Sharded groups whose trainable params differ in storage, compute or reduce dtype: one ``fully_shard`` call
        each only where torch groups mixed dtypes natively (``planner.fsdp_groups_can_mix_dtypes``). Frozen params may
        differ on every torch: FSDP2 asks one dtype of the params it reduces."""
        return tuple(g.name for g in self.sharded_groups if len(self._trainable_dtypes(g)) > 1)

    def _trainable_dtypes(self, group: ShardGroup) -> set:
        keys = (self.params[name].key for name in group.params if self.params[name].requires_grad)
        return {(key.storage, key.compute, key.reduce) for key in keys}

    @property
    def checkpoint_layout(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """What a checkpoint of the model holds per tensor: global shape and dtype of every param and planned
        buffer, except the 4-bit frozen base weights (a checkpoint never holds them: the base comes from its own
        source, the pretrained folder or the seed). Placements and groups are not part of it (DCP stores global
        tensors), so the layout is the same whichever groups the plan chose."""
        layout = {name: (p.shape, p.key.storage) for name, p in self.params.items() if p.quantized is None}
        layout.update({n: (b.shape, b.dtype) for n, b in self.buffers.items() if n not in self.non_persistent_buffers})
        return layout

    @property
    def storage_dtypes(self) -> Dict[str, torch.dtype]:
        """Every param's and floating buffer's planned dtype by canonical name: what a load casts each tensor to."""
        dtypes = {name: p.key.storage for name, p in self.params.items()}
        dtypes.update({name: b.dtype for name, b in self.buffers.items()})
        return dtypes

    @property
    def init_dtypes(self) -> Dict[str, torch.dtype]:
        """Every param's and floating buffer's init dtype by canonical name, for a model built on the meta device."""
        tensors: List[Any] = [*self.params.values(), *self.buffers.values()]
        return {t.name: t.init_dtype for t in tensors if t.init_dtype is not None}

    @property
    def fp32_names(self) -> Tuple[str, ...]:
        """Params kept fp32 by a rule and buffers planned in fp32: what an export keeps in fp32."""
        params = [n for n, p in self.params.items() if p.rule is not None]
        return (*params, *(n for n, b in self.buffers.items() if b.dtype == torch.float32))

    @property
    def keep_fp32_manifest(self) -> Dict[str, str]:
        """Every param and buffer a keep-fp32 rule pinned, with the rule (``module:RMSNorm``): what checkpoints and
        exports record, so a resume under other rules can say what changed."""
        tensors: List[Any] = [*self.params.values(), *self.buffers.values()]
        return {t.name: str(t.rule) for t in tensors if t.rule is not None}

    def predicted_collectives(self, reshard_after_forward: bool = True, hsdp: bool = False) -> Dict[str, int]:
        """Collectives of one forward+backward with gradient sync, once FSDP is lazily initialised.

        The root group is not resharded after forward (FSDP's default), so it all-gathers once per step. HSDP adds
        one all-reduce per trainable sharded group over the replicate dim. Replicated params add one all-reduce per
        reduce dtype.
        """
        with_params = [g for g in self.sharded_groups if g.params]
        trainable = [g for g in with_params if any(self.params[p].requires_grad for p in g.params)]
        non_root = [g for g in with_params if not g.is_root]
        replicated_dtypes = {self.params[p].key.reduce for p in self.replicated_params if self.params[p].requires_grad}
        all_gathers = len(with_params) + (len(non_root) if reshard_after_forward else 0)
        predicted = {
            "all_gather": all_gathers,
            "reduce_scatter": len(trainable),
            "all_reduce": (len(trainable) if hsdp else 0) + len(replicated_dtypes),
        }
        if self.replica_groups is not None:
            predicted["cross_replica_all_reduce"] = sum(self.cross_replica_reductions().values())
        if self.experts is not None:
            all_to_alls = self.experts.all_to_alls_per_step()
            predicted["all_to_all"] = all_to_alls["forward"] + all_to_alls["backward"]
        return predicted

    @property
    def outermost_units(self) -> Tuple[str, ...]:
        """Units not nested in another unit, in the plan's order (children before parents: last block first)."""
        return tuple(u for u in self.units if not any(u != o and is_within(u, o) for o in self.units))

    def expert_bytes(self, expert_shard_ranks: int = 1) -> Tuple[int, int]:
        """(all expert params' bytes, the bytes one rank stores: split over the EP ranks, then FSDP-sharded over the
        ``expert_shard_ranks`` holding the same experts)."""
        if self.experts is None:
            return 0, 0
        total = sum(self.params[p].nbytes for m in self.experts.modules for p in self.params_in(m))
        return total, total // (self.experts.size * expert_shard_ranks)

    def params_in(self, module: str) -> List[str]:
        """The params inside ``module`` (canonical names)."""
        return [n for n in self.params if is_within(n, module)]
