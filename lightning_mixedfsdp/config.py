"""The one configuration object of the strategy: a typed dataclass, dtype resolution and up-front validation.

Every choice is parsed here, once: the precision flag (:func:`check_precision`), the dtype names and the
activation-checkpointing mode (:func:`parse_activation_checkpointing`).
"""

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Literal, NamedTuple, Optional, Union, get_args

import torch

# suffixes: LlamaRMSNorm, T5LayerNorm, Qwen3NextRMSNormGated / MambaRMSNormGated, every HF rotary embedding
DEFAULT_KEEP_FP32_MODULES = ("RMSNorm", "RMSNormGated", "LayerNorm", "RotaryEmbedding")
DEFAULT_NORM_RULES = ("RMSNorm", "LayerNorm")
# Mamba / GatedDeltaNet decay logs: models compute exp(-exp(A_log)) in fp32 but rarely declare them fp32; MoE router
# correction biases (DeepSeek-V3's e_score_correction_bias, torchtitan's expert_bias): an aux-loss-free update of 1e-3
# near a bias of 7 is below bf16's spacing there (0.03) and would be lost entirely
DEFAULT_KEEP_FP32_PARAMS = (r"(^|\.)A_log$", r"(^|\.)(e_score_correction_bias|expert_bias)$")

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true"]
StorageChoice = Literal["auto", "keep", "bf16", "fp32"]
DtypeChoice = Literal["auto", "bf16", "fp32"]
BufferSyncMode = Literal["none", "broadcast", "average"]
NonfiniteCheck = Literal["raise", "device_assert"]
QuantizeBase = Literal["nf4"]
Float8Recipe = Literal["tensorwise", "rowwise"]
Offload = Literal["cpu"]

SUPPORTED_PRECISIONS: tuple = get_args(PrecisionFlag)
DTYPES: Dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The dtypes a config or recipe names, by the short names it uses."""
_SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# Lightning precision flag -> (storage, compute) for the non-pinned bulk; None means "as the model arrives"
_PRECISION_TO_BULK = {
    "32-true": (None, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}
_SELECTIVE = re.compile(r"selective:([1-9][0-9]*)")


class MixedFSDPConfigError(ValueError):
    """Raised with every problem of a :class:`MixedFSDPConfig` at once."""


@dataclass
class FaultTolerance:
    """Fault-tolerant replica groups (torchft): each group is one ordinary launch whose ranks shard as usual; across
    groups every gradient is averaged through torchft's ``Manager``, a step commits only where that reduction
    succeeded, and a group that dies and restarts heals from a live one. A mapping of these fields is accepted
    wherever this class is."""

    replica_id: Optional[int] = None
    """This launch's replica group, ``0 <= replica_id < num_replica_groups`` (required). A restarted group keeps its
    id."""

    num_replica_groups: Optional[int] = None
    """How many replica groups the job runs (required): the data splits into that many parts times each group's
    data-parallel ranks, and group ``replica_id`` draws its own part, whether or not the others are alive."""

    lighthouse: Optional[str] = None
    """The torchft lighthouse's URL (``http://host:29510``); ``None``: ``$TORCHFT_LIGHTHOUSE``. Start it yourself with
    ``torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000`` from the torchft the trainers import."""

    min_replicas: int = 1
    """Fewest replica groups a step may commit with; a step with fewer participants is discarded."""

    timeout_s: float = 60.0
    """Seconds a cross-group reduction, commit vote or heal transfer may take before the step is discarded."""

    quorum_timeout_s: float = 60.0
    """Seconds a step waits for the lighthouse to form a quorum."""

    connect_timeout_s: float = 10.0
    """Seconds to reach the lighthouse (and a peer's manager) before setup fails with the URL."""

    @classmethod
    def from_input(cls, value: "Union[FaultTolerance, Mapping[str, Any]]") -> "FaultTolerance":
        """A ``FaultTolerance`` from itself or a mapping of its fields (unknown names are refused with the valid
        ones)."""
        if isinstance(value, FaultTolerance):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise MixedFSDPConfigError(
                f"fault_tolerance got unknown field(s) {unknown}. Valid fields: {sorted(known)}."
            )
        return cls(**dict(value))

    def problems(self) -> List[str]:
        """Every problem of these settings, each with its fix; empty when valid."""
        problems = []
        groups = self.num_replica_groups
        if groups is None:
            problems.append(
                "fault_tolerance.num_replica_groups is missing; set it to the number of replica groups the job"
                " launches (e.g. 2)."
            )
        elif not _is_int(groups) or groups < 1:
            problems.append(f"fault_tolerance.num_replica_groups={groups!r} must be an int >= 1.")
        replica = self.replica_id
        if replica is None:
            problems.append(
                "fault_tolerance.replica_id is missing; give each launch its group's id, 0 to num_replica_groups - 1"
                " (e.g. strategy.fault_tolerance.replica_id=1)."
            )
        elif not _is_int(replica) or replica < 0:
            problems.append(
                f"fault_tolerance.replica_id={replica!r} must be an int >= 0 (0 to num_replica_groups - 1)."
            )
        elif isinstance(groups, int) and groups >= 1 and replica >= groups:
            problems.append(
                f"fault_tolerance.replica_id={replica!r} is not below num_replica_groups={groups!r}; use 0 to"
                f" {groups - 1}, or raise num_replica_groups."
            )
        if not _is_int(self.min_replicas) or self.min_replicas < 1:
            problems.append(f"fault_tolerance.min_replicas={self.min_replicas!r} must be an int >= 1.")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                problems.append(f"fault_tolerance.{name}={value!r} must be a number of seconds > 0.")
        if self.lighthouse is not None and not str(self.lighthouse).strip():
            problems.append(
                "fault_tolerance.lighthouse is empty; give the lighthouse's URL (http://host:29510) or None for"
                " $TORCHFT_LIGHTHOUSE."
            )
        return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class MixedFSDPConfig:
    """How ``mixed_fsdp2`` decides dtypes and FSDP groups. Usable as an OmegaConf structured config."""

    storage: StorageChoice = "auto"
    """Storage dtype of the non-pinned params: ``"auto"`` (from the Lightning precision flag), ``"keep"`` (as the
    model arrives, mixed or not), ``"fp32"`` or ``"bf16"``. Pinned (keep-fp32) params are always stored in fp32."""

    compute_dtype: DtypeChoice = "auto"
    """Dtype the non-pinned params are all-gathered and computed in: ``"auto"`` (bf16 for the bf16 precision flags,
    each group's own storage dtype for ``"32-true"``), ``"bf16"`` or ``"fp32"``. Pinned params compute in fp32 and
    their outputs are cast back to this dtype."""

    reduce_dtype: DtypeChoice = "auto"
    """Dtype of the gradient reduce-scatter of the non-pinned params: ``"auto"`` (the compute dtype, FSDP's default),
    ``"bf16"`` or ``"fp32"``. Pinned params always reduce in fp32."""

    keep_fp32_modules: List[str] = field(default_factory=lambda: list(DEFAULT_KEEP_FP32_MODULES))
    """Modules whose params and buffers stay fp32. A plain name is a class-name suffix (``"RMSNorm"`` matches
    ``LlamaRMSNorm``, ``"RotaryEmbedding"`` every HF rotary embedding); a dotted name is a qualified class path matched
    exactly (``"my_pkg.layers.Router"``). Set ``[]`` to pin none."""

    keep_fp32_params: List[str] = field(default_factory=lambda: list(DEFAULT_KEEP_FP32_PARAMS))
    """Regular expressions searched in qualified param and buffer names; matches stay fp32. The default keeps
    ``A_log`` (Mamba, GatedDeltaNet) and MoE router correction biases (``e_score_correction_bias``,
    ``expert_bias``) fp32, whatever dtype the model builds them in; a list of your own replaces it."""

    honor_hf_keep_in_fp32: bool = True
    """Keep the params and buffers named by HF ``_keep_in_fp32_modules`` fp32 under every precision flag
    (transformers itself applies that list only for fp16). ``_keep_in_fp32_modules_strict`` is always honoured."""

    cast_buffers: bool = False
    """Cast the floating buffers no rule covers to the bulk storage dtype, as Lightning's own ``bf16-true`` does. Off:
    a buffer keeps the dtype the model's own construction gives it (see the buffer rule in docs/dtypes.md)."""

    wrap_units: Optional[List[str]] = None
    """Class names (suffix or qualified, like ``keep_fp32_modules``) that become FSDP units. ``None`` (auto): HF
    ``_no_split_modules`` when the model declares them, else the children of the outermost ``nn.ModuleList``s
    (blocks, not the experts inside them)."""

    activation_checkpointing: str = "none"
    """Activation checkpointing of the wrap units, applied before sharding as torchtitan does: ``"none"``, ``"full"``
    (every unit) or ``"selective:N"`` (every N-th unit). Checkpointing the user applies (``checkpoint_wrapper``, HF
    ``gradient_checkpointing_enable()``, ``torch.utils.checkpoint``) works with every option."""

    compile: bool = False
    """``torch.compile`` each wrap unit before sharding (torchtitan's per-block compile)."""

    recompute_keep_fp32_modules: bool = False
    """Recompute the fp32 math of keep-fp32 modules (inputs cast up, compute, outputs cast down) in backward, keeping
    only their bf16 inputs: less activation memory than uniform bf16 (an HF RMSNorm saves an fp32 copy of its input
    even in bf16), bit for bit the same math, at the cost of the recompute (about 10 % of an eager step of a 1.1B
    Llama on an H100, 2 % compiled). Off, autograd still keeps the bf16 input instead of its fp32 upcast: the memory
    of uniform bf16, no recompute. Inside activation checkpointing neither applies."""

    reshard_after_forward: bool = True
    """Free the all-gathered params of non-root groups after forward and all-gather them again in backward."""

    replicate_below_bytes: int = 1 << 20
    """Minority-dtype groups smaller than this (bytes, per FSDP unit) are replicated instead of sharded: a 1 MiB
    group costs one latency-bound all-gather per use when sharded and ~4 MiB of param+grad+AdamW state per rank when
    replicated. ``0`` shards every group that a module boundary can separate."""

    pin_frozen_modules: bool = True
    """Store and compute fully frozen submodules (e.g. a vision tower) in the compute dtype, their floating buffers
    included, so an fp32 buffer cannot promote bf16 activations back to fp32. Keep-fp32 params stay fp32."""

    check_dtype_leaks: bool = False
    """On the first forward, warn once listing every module whose floating output is not in the compute dtype."""

    init_meta_params: bool = True
    """For a model built on the meta device: initialise it on rank 0 by the model's own init (the values a single
    process with the same seed gets) and stream it into the shards. ``False`` only allocates the shards, for a load
    that follows (see ``lightning_mixedfsdp.load_full_weights``)."""

    buffer_sync: BufferSyncMode = "broadcast"
    """How persistent buffers stay equal on the data-parallel ranks (FSDP2 leaves them alone): ``"broadcast"`` rank
    0's before each forward (DDP's ``broadcast_buffers``, the default: a buffer the model updates stays in step, for
    one small broadcast per forward, and none for a model without persistent buffers, such as Llama), ``"average"``
    the mean of the floating buffers after each optimizer step (for an aux-loss-free router bias updated from each
    rank's expert load), or ``"none"``."""

    buffer_sync_names: Optional[List[str]] = None
    """Regular expressions searched in buffer names: exactly the matching buffers are synced, non-persistent ones
    included. ``None``: every persistent buffer."""

    nonfinite_check: NonfiniteCheck = "raise"
    """How ``fabric.clip_gradients(..., error_if_nonfinite=True)`` (Fabric's default) reports a non-finite grad norm.
    ``"raise"``: Lightning's contract, a ``RuntimeError`` at the clip, before any grad is scaled, that you can catch
    and train on (e.g. skip the batch); on a GPU the check waits for the norm, one host sync per clip.
    ``"device_assert"``: no host sync; on a GPU the check is a device-side assert, which stops every kernel queued
    after it and leaves the process unable to use the GPU (restart from the last checkpoint). On a CPU both raise."""

    quantize_base: Optional[QuantizeBase] = None
    """Store the frozen base weights in 4 bits (QLoRA): ``"nf4"`` quantizes the weight of every frozen ``nn.Linear``
    (a peft LoRA model's base layers) to torchao's ``NF4Tensor``, which FSDP2 all-gathers in 4 bits. Never quantized:
    trainable params (the adapters), keep-fp32 params, the output head, tied weights, experts, and weights whose
    rows per shard do not fill whole NF4 blocks (the dtype report says which and why). Needs torchao
    (``pip install 'lightning-mixedfsdp[qlora]'``). ``None``: off."""

    offload: Optional[Offload] = None
    """``"cpu"``: the sharded params, their grads and the optimizer states live in host memory (FSDP2's
    ``CPUOffloadPolicy``); each unit's params are copied to the device for its forward and backward, its grads back
    after the reduce-scatter, and the optimizer steps on the host. Replicated params (small or inseparable keep-fp32
    params) stay on the device with their grads and states. ``None``: off."""

    float8: Optional[Float8Recipe] = None
    """Float8 training of the bulk's Linear layers (torchao's ``convert_to_float8_training``): ``"tensorwise"`` or
    ``"rowwise"`` scaling. The plan picks the layers: trainable ``nn.Linear`` modules of the bulk dtype whose dims
    suit float8 GEMMs; never keep-fp32 or frozen ones, routers and gates, the output head, or (``float8_skip_small``)
    layers too small to gain. Needs a GPU with float8 matmuls (compute capability 8.9+: H100, L40S, B200) unless
    ``float8_emulate``, and torchao (``pip install 'lightning-mixedfsdp[float8]'``). ``None``: off."""

    float8_emulate: bool = False
    """Emulate float8 matmuls in the compute dtype (torchao's ``emulate``): the numerics of float8 scaling on any
    device, at no speed gain. For tests, and for CPUs and GPUs without float8 matmuls."""

    float8_skip_small: bool = True
    """Leave out Linear layers too small to gain from float8, by torchao's thresholds measured on H100 (tensorwise:
    in_features <= 4096 and out_features <= 1024; rowwise: out_features <= 2048, in_features <= 1024, or both <= 4096
    and 2048): the casts to float8 cost more than the faster matmul saves. ``False``: every eligible layer."""

    float8_include: List[str] = field(default_factory=list)
    """Regular expressions searched in Linear module names: matches are converted even when they are routers, gates,
    the output head or small (never keep-fp32, frozen, or with dims not divisible by 16)."""

    float8_exclude: List[str] = field(default_factory=list)
    """Regular expressions searched in Linear module names: matches stay in the compute dtype."""

    fault_tolerance: Optional[FaultTolerance] = None
    """Fault-tolerant replica groups with torchft (:class:`FaultTolerance`, or a mapping of its fields): a dead
    group costs the others seconds, and it heals from a live one when it restarts. Needs torchft
    (``pip install 'lightning-mixedfsdp[ft]'``) and a lighthouse you start. ``None``: off."""

    print_report: bool = False
    """Log the dtype report on rank 0 when a model is set up (the ``lightning_mixedfsdp`` logger, INFO; it prints to
    stderr unless your application configured logging)."""

    expert_parallel_size: int = 1
    """Expert parallelism: each MoE layer's experts split over this many ranks (mesh dim ``expert_parallel``), each
    holding and computing ``num_experts / expert_parallel_size`` of them; tokens reach their experts by all-to-all
    (transformers' own EP plan and styles). It splits the data-parallel shard ranks, so it must divide them; the
    experts are FSDP-sharded over the ranks holding the same ones (``expert_data_parallel``). ``1``: off."""

    expert_parallel_plan: Optional[Dict[str, str]] = None
    """The expert-parallel plan in transformers' format, names relative to the model set up with ``*`` for layer
    numbers: ``{"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.experts.gate_up_proj":
    "grouped_gemm", ...}``. ``None``: the plan the HF model declares (``config.base_model_ep_plan``)."""

    def __post_init__(self) -> None:
        # a recipe block or a strategy keyword gives the fault-tolerance settings as a mapping
        if isinstance(self.fault_tolerance, Mapping):
            self.fault_tolerance = FaultTolerance.from_input(self.fault_tolerance)

    def problems(self) -> List[str]:
        """Every problem of this config, each with its fix; empty when valid."""
        problems = []
        for name, choices in (
            ("storage", get_args(StorageChoice)),
            ("compute_dtype", get_args(DtypeChoice)),
            ("reduce_dtype", get_args(DtypeChoice)),
            ("buffer_sync", get_args(BufferSyncMode)),
            ("nonfinite_check", get_args(NonfiniteCheck)),
        ):
            value = getattr(self, name)
            if value not in choices:
                problems.append(f"{name}={value!r} is not supported; use one of {list(choices)}.")
        for name, optional_choices in (
            ("quantize_base", get_args(QuantizeBase)),
            ("offload", get_args(Offload)),
            ("float8", get_args(Float8Recipe)),
        ):
            value = getattr(self, name)
            if value is not None and value not in optional_choices:
                problems.append(f"{name}={value!r} is not supported; use one of {list(optional_choices)} or None.")
        regex_fields = ("keep_fp32_params", "buffer_sync_names", "float8_include", "float8_exclude")
        for name in ("keep_fp32_modules", "wrap_units", *regex_fields):
            for index, pattern in enumerate(getattr(self, name) or []):
                if not isinstance(pattern, str) or not pattern.strip():
                    problems.append(f"{name}[{index}]={pattern!r} is empty; remove it or give a name.")
        for name in regex_fields:
            for index, pattern in enumerate(getattr(self, name) or []):
                if isinstance(pattern, str) and pattern.strip():
                    try:
                        re.compile(pattern)
                    except re.error as err:
                        problems.append(f"{name}[{index}]={pattern!r} is not a valid regex ({err}); fix or escape it.")
        try:
            parse_activation_checkpointing(self.activation_checkpointing)
        except ValueError as err:
            problems.append(str(err))
        if self.wrap_units is not None and len(self.wrap_units) == 0:
            problems.append("wrap_units=[] names no unit; use None for automatic units or list class names.")
        if not isinstance(self.replicate_below_bytes, int) or self.replicate_below_bytes < 0:
            problems.append(
                f"replicate_below_bytes={self.replicate_below_bytes!r} must be an int >= 0; use 0 to shard every group."
            )
        if not isinstance(self.expert_parallel_size, int) or self.expert_parallel_size < 1:
            problems.append(
                f"expert_parallel_size={self.expert_parallel_size!r} must be an int >= 1; use 1 to leave expert"
                " parallelism off."
            )
        problems.extend(_expert_plan_problems(self.expert_parallel_plan))
        if self.float8 is None and (self.float8_include or self.float8_exclude or self.float8_emulate):
            problems.append(
                "float8_include, float8_exclude and float8_emulate need a float8 recipe; set float8='tensorwise'"
                " (or 'rowwise'), or leave them unset."
            )
        if self.fault_tolerance is not None and not isinstance(self.fault_tolerance, FaultTolerance):
            problems.append(
                f"fault_tolerance={self.fault_tolerance!r} must be None, a FaultTolerance or a mapping of its fields"
                " (replica_id, num_replica_groups, lighthouse, min_replicas, timeouts)."
            )
        elif self.fault_tolerance is not None:
            problems.extend(self.fault_tolerance.problems())
            if self.buffer_sync == "average":
                problems.append(
                    "buffer_sync='average' averages buffers within one replica group only, so under fault_tolerance"
                    " the groups' buffers would drift apart; use buffer_sync='broadcast' (or 'none')."
                )
        if self.storage == "bf16" and self.compute_dtype == "fp32":
            problems.append(
                "storage='bf16' with compute_dtype='fp32' conflict: fp32 compute of bf16 weights gains no precision;"
                " use storage='fp32' (fp32 master weights) or compute_dtype='bf16'."
            )
        return problems

    def validate(self) -> "MixedFSDPConfig":
        """Raise :class:`MixedFSDPConfigError` listing every problem at once; return ``self`` when valid."""
        problems = self.problems()
        if problems:
            listed = "\n".join(f"  - {p}" for p in problems)
            raise MixedFSDPConfigError(f"MixedFSDPConfig has {len(problems)} problem(s):\n{listed}")
        return self

    @property
    def checkpoint_every(self) -> int:
        """Checkpoint every N-th unit; 0 for none (the config is validated, so this parses)."""
        return parse_activation_checkpointing(self.activation_checkpointing)

    def bulk_dtypes(self, precision: str, owner: str = "mixed_fsdp2") -> "BulkDtypes":
        """The bulk dtypes for a Lightning precision flag, which is checked here (``owner`` names who was given it):
        the one place flags are validated and dtypes resolved."""
        return resolve_bulk_dtypes(
            self.storage, self.compute_dtype, self.reduce_dtype, check_precision(precision, owner)
        )

    @classmethod
    def from_input(
        cls, config: "Optional[Union[MixedFSDPConfig, Mapping[str, Any]]]", fields: Dict[str, Any], owner: str
    ) -> "MixedFSDPConfig":
        """A strategy's config: a config object (or a mapping of its fields, e.g. an OmegaConf block) with keyword
        ``fields`` over it, validated once; ``owner`` is the class that was given them."""
        if config is not None and not isinstance(config, (MixedFSDPConfig, Mapping)):
            raise TypeError(f"{owner}(config={config!r}) must be a MixedFSDPConfig or a mapping of its fields.")
        base = dict(config) if isinstance(config, Mapping) else asdict(config or cls())
        if fields.get("wrap_units") == "auto":
            fields = {**fields, "wrap_units": None}
        return cls.from_kwargs(**{**base, **fields}).validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "MixedFSDPConfig":
        """Build from keyword arguments, rejecting unknown names with the list of valid ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise MixedFSDPConfigError(
                f"MixedFSDPConfig got unknown field(s) {unknown}. Valid fields: {sorted(known)}."
            )
        return cls(**kwargs)


def _expert_plan_problems(plan: Any) -> List[str]:
    from lightning_mixedfsdp._transformers_compat import EXPERTS_STYLE, SPLIT_STYLE

    if plan is None:
        return []
    styles = (EXPERTS_STYLE, SPLIT_STYLE)
    if not hasattr(plan, "items") or not plan:
        return [f"expert_parallel_plan={plan!r} must be a non-empty mapping of names to {list(styles)}, or None."]
    return [
        f"expert_parallel_plan[{name!r}]={style!r} is not supported; use one of {list(styles)}."
        for name, style in plan.items()
        if style not in styles
    ]


def parse_activation_checkpointing(mode: str) -> int:
    """``"none"`` -> 0, ``"full"`` -> 1, ``"selective:N"`` -> N (checkpoint every N-th unit)."""
    if mode == "none":
        return 0
    if mode == "full":
        return 1
    selective = _SELECTIVE.fullmatch(str(mode))
    if selective is None:
        raise ValueError(
            f"activation_checkpointing={mode!r} is not supported; use 'none', 'full' or 'selective:N' (every N-th"
            " unit, N >= 1)."
        )
    return int(selective.group(1))


def precision_problem(precision: Any) -> Optional[str]:
    """Why ``precision`` cannot be used with mixed_fsdp2, with the fix; None when it can."""
    if precision in SUPPORTED_PRECISIONS:
        return None
    return (
        f"precision={precision!r} is not supported; use one of {list(SUPPORTED_PRECISIONS)}. fp16 needs a sharded"
        " gradient scaler that FSDP2 does not provide; use 'bf16-mixed' or 'bf16-true' instead."
    )


def check_precision(precision: Any, owner: str) -> PrecisionFlag:
    """``precision`` when supported, else a ValueError naming ``owner`` (the class that was given it)."""
    problem = precision_problem(precision)
    if problem is not None:
        raise ValueError(f"{owner}: {problem}")
    return precision


class BulkDtypes(NamedTuple):
    """Resolved dtypes of the non-pinned params; ``None`` means "each param's own dtype"."""

    storage: Optional[torch.dtype]
    compute: Optional[torch.dtype]
    reduce: Optional[torch.dtype]

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> "BulkDtypes":
        """One dtype for storage, compute and reduce: a load or export in ``dtype``."""
        return cls(dtype, dtype, dtype)

    @property
    def init_dtype(self) -> Optional[torch.dtype]:
        """The default dtype ``init_module()`` builds params in: the bulk storage dtype when it is bf16, as
        Lightning's ``bf16-true`` does (keep-fp32 params are then cast up by the plan, as HF's
        ``from_config(dtype=bf16)`` does); None keeps torch's default."""
        return self.storage if self.storage == torch.bfloat16 else None


def resolve_bulk_dtypes(
    storage: StorageChoice, compute_dtype: DtypeChoice, reduce_dtype: DtypeChoice, precision: PrecisionFlag
) -> BulkDtypes:
    """Combine the config's dtype fields with a checked precision flag; explicit fields win over the flag."""
    flag_storage, flag_compute = _PRECISION_TO_BULK[precision]
    resolved_storage = flag_storage if storage == "auto" else None if storage == "keep" else DTYPES[storage]
    resolved_compute = flag_compute if compute_dtype == "auto" else DTYPES[compute_dtype]
    resolved_reduce = resolved_compute if reduce_dtype == "auto" else DTYPES[reduce_dtype]
    return BulkDtypes(resolved_storage, resolved_compute, resolved_reduce)


def short_dtype(dtype: Optional[torch.dtype]) -> str:
    """``fp32``, ``bf16``, ...: a dtype as configs and reports name it; ``-`` for none."""
    return _SHORT_NAMES.get(dtype, str(dtype).replace("torch.", "")) if dtype is not None else "-"
