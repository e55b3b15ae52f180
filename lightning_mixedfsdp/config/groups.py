"""The option groups, one concern each, as ``MixedFSDPConfig`` nests them (torchtitan's ``JobConfig`` layout): each a
dataclass whose fields carry their type (``Literal`` choices), a docstring, and the metadata their checks read. A
new option is one field here; its type check comes with it, and a check the type cannot say is one line of the
group's ``semantic_problems``."""

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Literal, Mapping, Optional, Union, get_args

from lightning_mixedfsdp.compat.transformers import EXPERTS_STYLE, SPLIT_STYLE
from lightning_mixedfsdp.config.options import ABOVE, FIX, MINIMUM, PATTERNS, OptionGroup

# suffixes: LlamaRMSNorm, T5LayerNorm, Qwen3NextRMSNormGated / MambaRMSNormGated, every HF rotary embedding
DEFAULT_KEEP_FP32_MODULES = ("RMSNorm", "RMSNormGated", "LayerNorm", "RotaryEmbedding")
DEFAULT_NORM_RULES = ("RMSNorm", "LayerNorm")
# Mamba / GatedDeltaNet decay logs: models compute exp(-exp(A_log)) in fp32 but rarely declare them fp32. Their
# time-step biases (dt_bias, -7..-2 as initialised) sit where bf16 numbers are 0.016-0.03 apart, so AdamW's first
# updates (about lr per element) round away; Mamba's skip weight D (1.0 at init) loses them the same way. Mamba-1
# keeps its time-step bias as the bias of a Linear, ``dt_proj.bias`` (log(expm1(dt)) for dt in 1e-3..0.1: -6.9..-2.3,
# the same range as dt_bias). D and dt_proj.bias are matched only inside HF's Mamba mixers (``mixer`` in
# Mamba/Mamba2/Nemotron-H, ``mamba`` in the hybrids), so an unrelated param of that name stays in the bulk dtype.
# MoE router correction biases (DeepSeek-V3's e_score_correction_bias, torchtitan's expert_bias): an aux-loss-free
# update of 1e-3 near a bias of 7 is below bf16's spacing there (0.03) and would be lost entirely (docs/dtypes.md)
DEFAULT_KEEP_FP32_PARAMS = (
    r"(^|\.)A_log$",
    r"(^|\.)dt_bias$",
    r"(^|\.)(mixer|mamba)\.D$",
    r"(^|\.)(mixer|mamba)\.dt_proj\.bias$",
    r"(^|\.)(e_score_correction_bias|expert_bias)$",
)

# the outermost modules HF multimodal models run only for inputs that have their modality: Llava, Gemma 3, Llama 4,
# Mistral 3 (vision_tower / vision_model, multi_modal_projector), Qwen2/2.5/3-VL (visual, its merger inside),
# Idefics3 / SmolVLM (vision_model, connector), Qwen2-Audio and Voxtral (audio_tower), Gemma 3n (embed_vision,
# embed_audio); matched against the last part of a module's name
DEFAULT_CONDITIONAL_MODULES = (
    r"(^|\.)(vision_tower|vision_model|visual|vision_encoder|image_encoder)$",
    r"(^|\.)(multi_modal_projector|mm_projector|connector)$",
    r"(^|\.)(audio_tower|audio_model|audio_encoder|embed_vision|embed_audio)$",
)

StorageChoice = Literal["auto", "keep", "bf16", "fp32"]
DtypeChoice = Literal["auto", "bf16", "fp32"]
Bf16UpdateChoice = Literal["nearest", "stochastic", "kahan"]
BufferSyncMode = Literal["none", "broadcast", "average"]
NonfiniteCheck = Literal["raise", "device_assert"]
QuantizeBase = Literal["nf4"]
Float8Recipe = Literal["tensorwise", "rowwise"]
Offload = Literal["cpu"]
RotateMethod = Literal["allgather", "alltoall"]
ReplicateSync = Literal["every_step", "local_sgd", "diloco"]
PipelineSchedule = Literal["1F1B", "GPipe", "Interleaved1F1B"]
"""torch.distributed.pipelining's schedules built and tested here (its class names without ``Schedule``)."""
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B",)
"""Schedules that run several stages on each rank."""
OuterState = Literal["cpu", "device"]
MeshSize = Union[Literal["auto"], int]
"""A mesh degree: an int >= 1, or ``"auto"`` (Lightning's word for what the other degrees leave)."""

_SELECTIVE = re.compile(r"selective:([1-9][0-9]*)")


@dataclass
class Dtypes(OptionGroup):
    """Which dtype each tensor is stored, computed and reduced in: the bulk, and the rules that keep params fp32."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {
        "storage": "storage",
        "compute_dtype": "compute",
        "reduce_dtype": "reduce",
        "keep_fp32_modules": "keep_fp32_modules",
        "keep_fp32_params": "keep_fp32_params",
        "honor_hf_keep_in_fp32": "honor_hf_keep_in_fp32",
        "cast_buffers": "cast_buffers",
        "pin_frozen_modules": "pin_frozen_modules",
        "bf16_updates": "bf16_updates",
        "fp32_compute_modules": "fp32_compute_modules",
    }

    storage: StorageChoice = "auto"
    """Storage dtype of the non-pinned params: ``"auto"`` (from the Lightning precision flag), ``"keep"`` (as the
    model arrives, mixed or not), ``"fp32"`` or ``"bf16"``. Pinned (keep-fp32) params are always stored in fp32."""

    compute: DtypeChoice = "auto"
    """Dtype the non-pinned params are all-gathered and computed in: ``"auto"`` (bf16 for the bf16 precision flags,
    each group's own storage dtype for ``"32-true"``), ``"bf16"`` or ``"fp32"``. Pinned params compute in fp32 and
    their outputs are cast back to this dtype."""

    reduce: DtypeChoice = "auto"
    """Dtype of the gradient reduce-scatter of the non-pinned params: ``"auto"`` (the compute dtype, FSDP's default),
    ``"bf16"`` or ``"fp32"``. Pinned params always reduce in fp32."""

    keep_fp32_modules: List[str] = field(
        default_factory=lambda: list(DEFAULT_KEEP_FP32_MODULES), metadata={PATTERNS: "names"}
    )
    """Modules whose params and buffers stay fp32. A plain name is a class-name suffix (``"RMSNorm"`` matches
    ``LlamaRMSNorm``, ``"RotaryEmbedding"`` every HF rotary embedding); a dotted name is a qualified class path matched
    exactly (``"my_pkg.layers.Router"``). Set ``[]`` to pin none."""

    keep_fp32_params: List[str] = field(
        default_factory=lambda: list(DEFAULT_KEEP_FP32_PARAMS), metadata={PATTERNS: "regex"}
    )
    """Regular expressions searched in qualified param and buffer names; matches stay fp32. The default keeps
    ``A_log`` and ``dt_bias`` (Mamba, GatedDeltaNet), Mamba's ``D`` and Mamba-1's ``dt_proj.bias`` (inside a module
    named ``mixer`` or ``mamba``, as in HF's Mamba models and hybrids) and MoE router correction biases
    (``e_score_correction_bias``, ``expert_bias``) fp32, whatever dtype the model builds them in; a list of your own
    replaces it."""

    honor_hf_keep_in_fp32: bool = True
    """Keep the params and buffers named by HF ``_keep_in_fp32_modules`` fp32 under every precision flag
    (transformers itself applies that list only for fp16). ``_keep_in_fp32_modules_strict`` is always honoured."""

    cast_buffers: bool = False
    """Cast the floating buffers no rule covers to the bulk storage dtype, as Lightning's own ``bf16-true`` does. Off:
    a buffer keeps the dtype the model's own construction gives it (see the buffer rule in docs/dtypes.md)."""

    pin_frozen_modules: bool = True
    """Store and compute fully frozen submodules (e.g. a vision tower) in the compute dtype, their floating buffers
    included, so an fp32 buffer cannot promote bf16 activations back to fp32. Keep-fp32 params stay fp32."""

    bf16_updates: Bf16UpdateChoice = "nearest"
    """How an optimizer step's fp32 result is written into a trainable param stored in bf16 (``bf16-true``, no fp32
    master): ``"nearest"`` rounds to nearest (updates under half the param's spacing are lost); ``"stochastic"``
    rounds at random, up with the probability of the distance (the expected value is fp32's; 6 bytes of AdamW state
    per element: a bf16 first and an fp32 second moment); ``"kahan"`` keeps each rounding's loss in a bf16 buffer
    and adds it to the next update (8 bytes). ``torch.optim.AdamW``, ``Adam`` and ``SGD`` only; keep-fp32, frozen
    and 4-bit params are untouched. Refused where the trained params have fp32 masters already."""

    fp32_compute_modules: List[str] = field(default_factory=list, metadata={PATTERNS: "regex"})
    """``nn.Linear`` modules that compute in fp32 while stored in the bulk dtype: a regex searched in qualified module
    names (``"^lm_head$"``) or a class name as ``keep_fp32_modules`` takes it. The module stays stored, sharded and
    all-gathered as its group is; its forward upcasts the gathered weight and its input, multiplies in fp32 and
    returns fp32 (an LM head's logits: RL's token probabilities). A head tied to the input embedding computes its
    matmul in fp32 and leaves the embedding's lookup and storage as they are. Default ``[]``."""

    def semantic_problems(self) -> List[str]:
        if self.storage == "bf16" and self.compute == "fp32":
            return [
                "storage='bf16' with compute='fp32' conflict: fp32 compute of bf16 weights gains no precision; use"
                " storage='fp32' (fp32 master weights) or compute='bf16'."
            ]
        return []


@dataclass
class Sharding(OptionGroup):
    """How the model is cut into FSDP units and what each unit does around its forward: activation checkpointing,
    compile, resharding, and which small groups are replicated instead of sharded."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {
        name: name
        for name in (
            "wrap_units",
            "conditional_modules",
            "reshard_after_forward",
            "replicate_below_bytes",
            "activation_checkpointing",
            "compile",
            "recompute_keep_fp32_modules",
        )
    }

    wrap_units: Optional[List[str]] = field(default=None, metadata={PATTERNS: "names"})
    """Class names (suffix or qualified, like ``keep_fp32_modules``) that become FSDP units. ``None`` (auto): HF
    ``_no_split_modules`` when the model declares them, else the children of the outermost ``nn.ModuleList``s
    (blocks, not the experts inside them)."""

    conditional_modules: Optional[List[str]] = field(default=None, metadata={PATTERNS: "regex"})
    """Modules that run for some inputs only (a vision tower, its projector, an audio encoder): regular expressions
    searched in module names, the outermost match taken. ``None`` (auto): the towers and projectors of HF multimodal
    models, by the names they give them (:data:`DEFAULT_CONDITIONAL_MODULES`); ``[]``: none. Ranks that see different
    inputs (images on one, text on another) run different modules, so such a module is never an FSDP unit of its own:
    its params ride in the unit around it, which every rank runs (its minority dtypes, the tower's fp32 norms, are
    replicated), and the trainable ones that did not run on a rank reduce zeros there."""

    reshard_after_forward: Optional[bool] = None
    """Free the all-gathered params of non-root groups after forward and all-gather them again in backward.
    ``None``: True, except under pipeline parallelism, where it is False: every micro-batch runs its own forward, and
    resharding would all-gather each group again per micro-batch (the stage keeps its params whole between its
    forwards and backwards instead)."""

    def resolved_reshard_after_forward(self, pipeline_parallel_size: int) -> bool:
        """``reshard_after_forward`` with ``None`` resolved for a run of ``pipeline_parallel_size`` stages."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return pipeline_parallel_size == 1

    replicate_below_bytes: int = field(default=1 << 20, metadata={MINIMUM: 0, FIX: "use 0 to shard every group"})
    """Minority-dtype groups smaller than this (bytes, per FSDP unit) are replicated instead of sharded: a 1 MiB
    group costs one latency-bound all-gather per use when sharded and ~4 MiB of param+grad+AdamW state per rank when
    replicated. ``0`` shards every group that a module boundary can separate."""

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

    @property
    def checkpoint_every(self) -> int:
        """Checkpoint every N-th unit; 0 for none (valid settings parse)."""
        return parse_activation_checkpointing(self.activation_checkpointing)

    def semantic_problems(self) -> List[str]:
        problems = []
        try:
            parse_activation_checkpointing(self.activation_checkpointing)
        except ValueError as err:
            problems.append(str(err))
        if self.wrap_units is not None and len(self.wrap_units) == 0:
            problems.append("wrap_units=[] names no unit; use None for automatic units or list class names.")
        return problems


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


@dataclass
class Float8(OptionGroup):
    """Float8 training of the bulk's Linear layers (torchao's ``convert_to_float8_training``). Off unless ``recipe``
    is set; ``float8="tensorwise"`` is short for ``float8={"recipe": "tensorwise"}``."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {
        "float8_emulate": "emulate",
        "float8_skip_small": "skip_small",
        "float8_include": "include",
        "float8_exclude": "exclude",
    }
    MAIN_FIELD: ClassVar[Optional[str]] = "recipe"

    recipe: Optional[Float8Recipe] = None
    """``"tensorwise"`` or ``"rowwise"`` scaling. The plan picks the layers: trainable ``nn.Linear`` modules of the
    bulk dtype whose dims suit float8 GEMMs; never keep-fp32 or frozen ones, routers and gates, the output head, or
    (``skip_small``) layers too small to gain. Needs a GPU with float8 matmuls (compute capability 8.9+: H100, L40S,
    B200) unless ``emulate``, and torchao (``pip install 'lightning-mixedfsdp[float8]'``). ``None``: off."""

    emulate: bool = False
    """Emulate float8 matmuls in the compute dtype (torchao's ``emulate``): the numerics of float8 scaling on any
    device, at no speed gain. For tests, and for CPUs and GPUs without float8 matmuls."""

    skip_small: bool = True
    """Leave out Linear layers too small to gain from float8, by torchao's thresholds measured on H100 (tensorwise:
    in_features <= 4096 and out_features <= 1024; rowwise: out_features <= 2048, in_features <= 1024, or both <= 4096
    and 2048): the casts to float8 cost more than the faster matmul saves. ``False``: every eligible layer."""

    include: List[str] = field(default_factory=list, metadata={PATTERNS: "regex"})
    """Regular expressions searched in Linear module names: matches are converted even when they are routers, gates,
    the output head or small (never keep-fp32, frozen, or with dims not divisible by 16)."""

    exclude: List[str] = field(default_factory=list, metadata={PATTERNS: "regex"})
    """Regular expressions searched in Linear module names: matches stay in the compute dtype."""

    def semantic_problems(self) -> List[str]:
        if self.recipe is None and (self.include or self.exclude or self.emulate):
            return [
                "include, exclude and emulate need a float8 recipe; set float8.recipe='tensorwise' (or 'rowwise'),"
                " or leave them unset."
            ]
        return []


@dataclass
class Memory(OptionGroup):
    """Less device memory per rank: the frozen base in 4 bits (QLoRA), the sharded state in host memory."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {
        "quantize_base": "quantize_base",
        "offload": "offload",
        "offload_frozen": "offload_frozen",
    }

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
    params) stay on the device with their grads and states. On CUDA the strategy's process group gets a gloo backend
    for host tensors beside NCCL. ``None``: off."""

    offload_frozen: Optional[Offload] = None
    """``"cpu"``: only the FSDP units whose params are all frozen (a distillation teacher, a DPO reference, a frozen
    tower) keep their shards in host memory, copied to the device for each of their forwards; the trained units stay
    on the device, and no optimizer state moves. ``offload="cpu"`` already offloads them. ``None``: off."""


@dataclass
class Buffers(OptionGroup):
    """How persistent buffers stay equal on the data-parallel ranks (FSDP2 leaves them alone)."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {"buffer_sync": "sync", "buffer_sync_names": "names"}
    MAIN_FIELD: ClassVar[Optional[str]] = "sync"

    sync: BufferSyncMode = "broadcast"
    """``"broadcast"`` rank 0's before each forward (DDP's ``broadcast_buffers``, the default: a buffer the model
    updates stays in step, for one small broadcast per forward, and none for a model without persistent buffers, such
    as Llama), ``"average"`` the mean of the floating buffers after each optimizer step (for an aux-loss-free router
    bias updated from each rank's expert load), or ``"none"``."""

    names: Optional[List[str]] = field(default=None, metadata={PATTERNS: "regex"})
    """Regular expressions searched in buffer names: exactly the matching buffers are synced, non-persistent ones
    included. ``None``: every persistent buffer."""


@dataclass
class Parallelism(OptionGroup):
    """Every parallel degree: the data-parallel shard and replicate ranks, tensor parallelism, context parallelism
    (each sequence split across ranks) and expert parallelism (each MoE layer's experts split across ranks). The
    strategies' ``data_parallel_size``, ``tensor_parallel_size`` and ``data_parallel_replicate_size`` arguments set
    the first three (Lightning's names); their product with ``context_parallel_size`` is the world size."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {
        name: name
        for name in (
            "data_parallel_size",
            "data_parallel_replicate_size",
            "tensor_parallel_size",
            "context_parallel_size",
            "context_parallel_rotate",
            "expert_parallel_size",
            "expert_parallel_plan",
            "replicate_sync",
            "sync_every",
            "outer_lr",
            "outer_momentum",
            "outer_nesterov",
            "outer_state",
            "pipeline_parallel_size",
            "pipeline_schedule",
            "pipeline_microbatches",
            "pipeline_stages_per_rank",
            "pipeline_split",
        )
    }

    data_parallel_size: MeshSize = field(default="auto", metadata={MINIMUM: 1})
    """Ranks each param is sharded over (FSDP's shard dim, mesh dim ``dp_shard``). ``"auto"``: every rank the other
    degrees leave."""

    data_parallel_replicate_size: int = field(default=1, metadata={MINIMUM: 1, FIX: "use 1 for plain FSDP"})
    """HSDP: replicas of the sharded model (e.g. one per node; mesh dim ``dp_replicate``), whose gradients are
    all-reduced. ``1``: plain FSDP."""

    tensor_parallel_size: MeshSize = field(default=1, metadata={MINIMUM: 1})
    """Tensor parallelism by your ``parallelize_fn`` (mesh dim ``tensor_parallel``). ``"auto"``: the devices of a node
    (Lightning's default); ``1``: off."""

    context_parallel_size: int = field(default=1, metadata={MINIMUM: 1, FIX: "use 1 to leave context parallelism off"})
    """Context parallelism: every sequence is split over this many ranks (mesh dim ``context_parallel``), each
    holding ``1/context_parallel_size`` of its tokens and activations; attention runs as ring attention (the
    key/value parts travel around the ranks). Every rank of a group gets the same batch, and params are sharded over
    the data-parallel shard ranks times these. The sequence length must divide by ``2 x context_parallel_size``.
    ``1``: off."""

    context_parallel_rotate: RotateMethod = "allgather"
    """How ring attention moves the key/value parts: ``"allgather"`` (all parts at once, torch's default) or
    ``"alltoall"`` (one neighbour at a time, less memory)."""

    expert_parallel_size: int = field(default=1, metadata={MINIMUM: 1, FIX: "use 1 to leave expert parallelism off"})
    """Expert parallelism: each MoE layer's experts split over this many ranks (mesh dim ``expert_parallel``), each
    holding and computing ``num_experts / expert_parallel_size`` of them; tokens reach their experts by all-to-all
    (transformers' own EP plan and styles). It splits the data-parallel shard ranks, so it must divide them; the
    experts are FSDP-sharded over the ranks holding the same ones (``expert_data_parallel``). ``1``: off."""

    expert_parallel_plan: Optional[Dict[str, str]] = None
    """The expert-parallel plan in transformers' format, names relative to the model set up with ``*`` for layer
    numbers: ``{"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.experts.gate_up_proj":
    "grouped_gemm", ...}``. ``None``: the plan the HF model declares (``config.base_model_ep_plan``)."""

    replicate_sync: ReplicateSync = "every_step"
    """How HSDP's replicas (``data_parallel_replicate_size``) stay in step: ``"every_step"`` (every gradient
    all-reduced across them every step), ``"local_sgd"`` (each replica takes ``sync_every`` optimizer steps alone,
    then the replicas' params are averaged) or ``"diloco"`` (then the replicas' pseudo-gradients, the global copy
    minus their params, are averaged and applied to the global copy by Nesterov SGD, which every replica takes). Between
    syncs nothing crosses the replicate dim; the shard dim keeps FSDP's every-step reduce-scatter."""

    sync_every: int = field(default=20, metadata={MINIMUM: 1})
    """Optimizer steps between syncs of ``local_sgd`` and ``diloco`` (DiLoCo's H): a sync follows the optimizer step
    of steps H, 2H, ..."""

    outer_lr: float = field(default=0.7, metadata={ABOVE: 0})
    """DiLoCo's outer learning rate (its paper's 0.7)."""

    outer_momentum: float = field(default=0.9, metadata={MINIMUM: 0})
    """DiLoCo's outer momentum (0.9); below 1."""

    outer_nesterov: bool = True
    """DiLoCo's outer step with Nesterov momentum."""

    outer_state: OuterState = "cpu"
    """Where DiLoCo's fp32 global copy and momentum live (each rank its own shard's): ``"cpu"`` (host memory, as
    INTELLECT-1 kept it) or ``"device"``."""

    pipeline_parallel_size: int = field(
        default=1, metadata={MINIMUM: 1, FIX: "use 1 to leave pipeline parallelism off"}
    )
    """Pipeline parallelism: the model's blocks split into stages over this many ranks (mesh dim ``pipeline``,
    outermost: between nodes on GPUs), micro-batches flowing through them; each stage is sharded as usual over its
    own data-parallel ranks. Train with ``strategy.pipeline_step``. ``1``: off."""

    pipeline_schedule: PipelineSchedule = "1F1B"
    """The order stages run micro-batches in, by torch's names: ``"1F1B"`` (one forward, one backward: at most
    ``pipeline_parallel_size - stage`` micro-batches in flight), ``"GPipe"`` (every forward, then every backward:
    all micro-batches in flight) or ``"Interleaved1F1B"`` (several stages per rank, a smaller bubble)."""

    pipeline_microbatches: Optional[int] = field(default=None, metadata={MINIMUM: 1})
    """Micro-batches each batch is split into (they must divide it). ``None``: ``pipeline_parallel_size x
    pipeline_stages_per_rank``, the fewest the schedules take. More shrink the bubble; raise this instead of
    gradient accumulation."""

    pipeline_stages_per_rank: Optional[int] = field(default=None, metadata={MINIMUM: 1})
    """Stages each rank holds (``v``). ``None``: 2 for ``Interleaved1F1B``, else 1."""

    pipeline_split: Optional[List[str]] = None
    """Names of the modules that begin a stage after the first (``["model.layers.4"]`` makes two stages of an
    8-layer model; ``pipeline_parallel_size x pipeline_stages_per_rank - 1`` names). ``None``: balanced stages, the
    embedding and the final norm with the head each counted as one block."""

    @property
    def stages_per_rank(self) -> int:
        """``pipeline_stages_per_rank`` resolved."""
        if self.pipeline_stages_per_rank is not None:
            return self.pipeline_stages_per_rank
        return 2 if self.pipeline_schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def microbatches(self) -> int:
        """``pipeline_microbatches`` resolved."""
        if self.pipeline_microbatches is not None:
            return self.pipeline_microbatches
        return self.pipeline_parallel_size * self.stages_per_rank

    def semantic_problems(self) -> List[str]:
        problems = pipeline_problems(self)
        if isinstance(self.outer_momentum, float) and self.outer_momentum >= 1:
            problems.append(f"outer_momentum={self.outer_momentum!r} must be below 1 (DiLoCo's is 0.9).")
        return problems + self._expert_plan_problems()

    def _expert_plan_problems(self) -> List[str]:
        styles = (EXPERTS_STYLE, SPLIT_STYLE)
        plan: Any = self.expert_parallel_plan
        if not isinstance(plan, Mapping):
            return []
        return [
            f"expert_parallel_plan[{name!r}]={style!r} is not supported; use one of {list(styles)}."
            for name, style in plan.items()
            if style not in styles
        ]


def pipeline_problems(parallelism: "Parallelism") -> List[str]:
    """The pipeline options that do not fit each other or the other degrees, each with its fix."""
    size, schedule = parallelism.pipeline_parallel_size, parallelism.pipeline_schedule
    if not isinstance(size, int) or size == 1 or schedule not in get_args(PipelineSchedule):
        return []
    problems = []
    stages = parallelism.stages_per_rank if isinstance(parallelism.pipeline_stages_per_rank, (int, type(None))) else 1
    if schedule in MULTI_STAGE_SCHEDULES and stages < 2:
        problems.append(
            f"pipeline_schedule={schedule!r} runs several stages per rank and pipeline_stages_per_rank={stages};"
            " set pipeline_stages_per_rank=2 (or more), or use pipeline_schedule='1F1B'."
        )
    if schedule not in MULTI_STAGE_SCHEDULES and stages > 1:
        problems.append(
            f"pipeline_schedule={schedule!r} runs one stage per rank and pipeline_stages_per_rank={stages}; use"
            " pipeline_schedule='Interleaved1F1B' for several, or pipeline_stages_per_rank=1."
        )
    micro = parallelism.pipeline_microbatches
    if isinstance(micro, int) and schedule != "GPipe" and micro < size:
        problems.append(
            f"pipeline_microbatches={micro} is fewer than {schedule} needs (at least pipeline_parallel_size="
            f"{size}: every stage must have a micro-batch in flight); raise it to {size} or more."
        )
    rounds = max(1, micro // size) if isinstance(micro, int) else 1
    if isinstance(micro, int) and schedule in MULTI_STAGE_SCHEDULES and micro % rounds:
        fit = rounds * size
        problems.append(
            f"pipeline_microbatches={micro} does not split into {schedule}'s {rounds} rounds of"
            f" pipeline_parallel_size={size} micro-batches each; use a multiple of {size}, e.g. {fit}."
        )
    others = {
        "context_parallel_size": parallelism.context_parallel_size != 1,
        "replicate_sync": parallelism.replicate_sync != "every_step",
    }
    for name, set_ in others.items():
        if set_:
            problems.append(
                f"pipeline_parallel_size={size} with {name}={getattr(parallelism, name)!r} is not supported yet:"
                " pipeline stages compose with FSDP, HSDP, tensor and expert parallelism (data_parallel_size,"
                " data_parallel_replicate_size, tensor_parallel_size, expert_parallel_size) here;"
                f" leave {name} at its default or set pipeline_parallel_size=1."
            )
    return problems


@dataclass
class Diagnostics(OptionGroup):
    """What the strategy reports and checks while it sets up and trains."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {
        name: name for name in ("print_report", "check_dtype_leaks", "nonfinite_check")
    }

    print_report: bool = False
    """Log the dtype report on rank 0 when a model is set up (the ``lightning_mixedfsdp`` logger, INFO; it prints to
    stderr unless your application configured logging)."""

    check_dtype_leaks: bool = False
    """On the first forward, warn once listing every module whose floating output is not in the compute dtype."""

    nonfinite_check: NonfiniteCheck = "raise"
    """How ``fabric.clip_gradients(..., error_if_nonfinite=True)`` (Fabric's default) reports a non-finite grad norm.
    ``"raise"``: Lightning's contract, a ``RuntimeError`` at the clip, before any grad is scaled, that you can catch
    and train on (e.g. skip the batch); on a GPU the check waits for the norm, one host sync per clip.
    ``"device_assert"``: no host sync; on a GPU the check is a device-side assert, which stops every kernel queued
    after it and leaves the process unable to use the GPU (restart from the last checkpoint). On a CPU both raise."""


@dataclass
class Weights(OptionGroup):
    """How weights are initialised, loaded and exported."""

    FLAT_NAMES: ClassVar[Mapping[str, str]] = {"init_meta_params": "init_meta_params"}

    init_meta_params: bool = True
    """For a model built on the meta device: initialise it on rank 0 by the model's own init (the values a single
    process with the same seed gets) and stream it into the shards. ``False`` only allocates the shards, for a load
    that follows (see ``lightning_mixedfsdp.load_full_weights``)."""

    export_chunk_bytes: int = field(
        default=256 * 2**20, metadata={MINIMUM: 1, FIX: "give the bytes one rank may hold at once, e.g. 268435456"}
    )
    """The most an export gathers on each rank at once: a larger tensor (fused experts, an embedding) is gathered
    and written in slices of about this many bytes."""


@dataclass
class FaultTolerance(OptionGroup):
    """Fault-tolerant replica groups (torchft): each group is one ordinary launch whose ranks shard as usual; across
    groups every gradient is averaged through torchft's ``Manager``, a step commits only where that reduction
    succeeded, and a group that dies and restarts heals from a live one. A mapping of these fields is accepted
    wherever this class is."""

    replica_id: Optional[int] = field(default=None, metadata={MINIMUM: 0, FIX: "use 0 to num_replica_groups - 1"})
    """This launch's replica group, ``0 <= replica_id < num_replica_groups`` (required). A restarted group keeps its
    id."""

    num_replica_groups: Optional[int] = field(default=None, metadata={MINIMUM: 1})
    """How many replica groups the job runs (required): the data splits into that many parts times each group's
    data-parallel ranks, and group ``replica_id`` draws its own part, whether or not the others are alive."""

    lighthouse: Optional[str] = None
    """The torchft lighthouse's URL (``http://host:29510``); ``None``: ``$TORCHFT_LIGHTHOUSE``. Start it yourself with
    ``torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000`` from the torchft the trainers import."""

    min_replicas: int = field(default=1, metadata={MINIMUM: 1})
    """Fewest replica groups a step may commit with; a step with fewer participants is discarded."""

    timeout_s: float = field(default=60.0, metadata={ABOVE: 0, FIX: "give seconds, e.g. 60"})
    """Seconds a cross-group reduction, commit vote or heal transfer may take before the step is discarded."""

    quorum_timeout_s: float = field(default=60.0, metadata={ABOVE: 0, FIX: "give seconds, e.g. 60"})
    """Seconds a step waits for the lighthouse to form a quorum."""

    connect_timeout_s: float = field(default=10.0, metadata={ABOVE: 0, FIX: "give seconds, e.g. 10"})
    """Seconds to reach the lighthouse (and a peer's manager) before setup fails with the URL."""

    def semantic_problems(self) -> List[str]:
        problems = []
        groups, replica = self.num_replica_groups, self.replica_id
        if groups is None:
            problems.append(
                "num_replica_groups is missing; set it to the number of replica groups the job launches (e.g. 2)."
            )
        if replica is None:
            problems.append(
                "replica_id is missing; give each launch its group's id, 0 to num_replica_groups - 1"
                " (e.g. strategy.fault_tolerance.replica_id=1)."
            )
        elif (
            isinstance(groups, int) and isinstance(replica, int) and 0 <= replica and groups >= 1 and replica >= groups
        ):
            problems.append(
                f"replica_id={replica!r} is not below num_replica_groups={groups!r}; use 0 to {groups - 1}, or"
                " raise num_replica_groups."
            )
        if self.lighthouse is not None and not str(self.lighthouse).strip():
            problems.append(
                "lighthouse is empty; give the lighthouse's URL (http://host:29510) or None for $TORCHFT_LIGHTHOUSE."
            )
        return problems
