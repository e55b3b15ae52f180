"""Training-state bytes per rank, predicted from a plan: params, grads and AdamW states, sharded and replicated.

FSDP2 shards each param's dim 0 over the shard ranks (``torch.chunk``: the first ranks hold ``ceil(rows / shards)``
rows); replicated params are whole on every rank. Grads take the param's storage dtype and exist for trainable params
only; AdamW keeps two states in the param's dtype, except for a trainable bf16 param whose updates are written back
stochastically or compensated (``bf16_updates``): :data:`ADAMW_BF16_STATE_BYTES` per element. A 4-bit base weight takes
its NF4 bytes (about 0.26x of bf16). With ``offload="cpu"`` the sharded params, grads and states are host bytes;
replicated ones stay on the device. The all-gather working set is what FSDP2 holds unsharded at once: the largest unit's
params gathered (in their compute dtype, a 4-bit weight in 4 bits) twice over (the unit computing and the next one
prefetched), the root's params (gathered once per step), plus one 4-bit weight dequantized for its matmul. Activations
depend on batch and sequence and are not included.
"""

import math
from dataclasses import dataclass, replace
from typing import AbstractSet, Any, Dict, Optional

import torch

from lightning_mixedfsdp.planning.types import ROOT, ParamPlan, ShardPlan

ADAMW_BF16_STATE_BYTES = {"nearest": 4, "stochastic": 6, "kahan": 8}
"""AdamW's state bytes per element of a trainable bf16 param, by ``bf16_updates``: torch's two bf16 moments; a bf16
first and an fp32 second moment; the same and a bf16 compensation (``apply/bf16_updates.py`` keeps them)."""

STAGING_BYTES = 2**30
"""Per rank: the shards of 4-bit weights a load reads in their nominal dtype before quantizing them."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank (rank 0 of the shard dim)."""

    params: int
    grads: int
    optimizer: int
    replicated: int
    """Of the total: the bytes replicated params take beyond an even share (their overhead over full sharding)."""
    host: int = 0
    """Of the total: the bytes offloaded to host memory (``offload="cpu"``)."""
    gathered: int = 0
    """The all-gather working set on the device, beyond the training state."""
    states: str = "AdamW states"
    """What the optimizer bytes are (``Muon + AdamW`` when Muon takes some params)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Bytes on the device: the training state not offloaded, and the all-gather working set."""
        return self.total - self.host + self.gathered

    def fits(self, gpu_bytes: float) -> bool:
        return self.device <= gpu_bytes

    def rows(self) -> Dict[str, int]:
        return {"params": self.params, "grads": self.grads, self.states: self.optimizer, "total": self.total}


def estimate_memory(
    plan: ShardPlan, shard_ranks: int, data_parallel_ranks: int, muon: AbstractSet[str] = frozenset()
) -> MemoryEstimate:
    """Per-rank bytes of ``plan`` with params sharded over ``shard_ranks`` (replicated over the rest of the
    ``data_parallel_ranks``, HSDP); the params named in ``muon`` hold Muon's one state (its momentum buffer, in the
    param's dtype), the others AdamW's two."""
    params = grads = optimizer = replicated = host = 0
    offloaded_frozen = (
        {name for group in plan.sharded_groups if not plan.trains(group) for name in group.params}
        if plan.offload_frozen is not None
        else set()
    )
    for param in plan.params.values():
        local = _local_bytes(param, shard_ranks)
        state = local * (4 if param.requires_grad else 1)
        params += local
        if param.requires_grad:
            grads += local
            bf16 = param.key.storage == torch.bfloat16 and not param.quantized
            if param.name in muon:
                optimizer += local
            else:
                optimizer += local // 2 * ADAMW_BF16_STATE_BYTES[plan.bf16_updates] if bf16 else 2 * local
        if param.replicated:
            share = param.nbytes / data_parallel_ranks
            replicated += int((param.nbytes - share) * (4 if param.requires_grad else 1))
        elif plan.offload is not None or param.name in offloaded_frozen:
            host += state
    states = "Muon + AdamW" if muon else "AdamW states"
    return MemoryEstimate(params, grads, optimizer, replicated, host, _gathered_bytes(plan), states)


def _gathered_bytes(plan: ShardPlan) -> int:
    per_unit: Dict[str, int] = {}
    for group in plan.sharded_groups:
        gathered = sum(_gathered_param_bytes(plan.params[name]) for name in group.params)
        per_unit[group.unit] = per_unit.get(group.unit, 0) + gathered
    root = per_unit.pop(ROOT, 0)  # all-gathered once per step and kept until backward ends
    dequantized = [math.prod(p.shape) * p.key.compute.itemsize for p in plan.params.values() if p.quantized]
    return root + 2 * max(per_unit.values(), default=0) + max(dequantized, default=0)


def unsharded_step_bytes(plan: ShardPlan) -> int:
    """What a pipeline stage holds beyond its training state during a step: every sharded param unsharded (in its
    compute dtype) and every trainable one's unsharded grad (accumulated in its reduce dtype: FSDP2 upcasts an
    accumulated grad to the reduce dtype while sync is off) from the first micro-batch's forward to the step's one
    reduce-scatter, since gradient sync and resharding are off across the micro-batches (torch's schedules and
    torchtitan alike). Replicated params are whole already."""
    total = 0
    for param in plan.params.values():
        if param.replicated:
            continue
        total += _gathered_param_bytes(param)
        if param.requires_grad:
            total += math.prod(param.shape) * param.key.reduce.itemsize
    return total


def _gathered_param_bytes(param: ParamPlan) -> int:
    if param.quantized:
        return param.nbytes
    return math.prod(param.shape) * param.key.compute.itemsize


def _local_bytes(param: ParamPlan, shard_ranks: int) -> int:
    if param.replicated or not param.shape:
        return param.nbytes
    rows = math.ceil(param.shape[0] / shard_ranks)
    return rows * (param.nbytes // param.shape[0])


@dataclass(frozen=True)
class IOEstimate:
    """Bytes and host memory per rank at the two ends of a run: ``load_full_weights`` of an HF folder (every rank
    reads its own shards' byte ranges) and ``export_safetensors`` (streamed, rank 0 writes)."""

    load_read_per_rank: int
    """What the busiest rank reads: its shard of every sharded tensor, every replicated one whole."""
    load_host_peak: int
    """Host memory a load holds at once beyond the shards: the largest local slice read (read into host memory,
    then copied to the device)."""
    export_written: int
    """What rank 0 writes (every other rank writes nothing)."""
    export_host_peak: int
    """Host memory an export holds at once on rank 0: the largest full tensor in the export's dtype (it is gathered,
    written and dropped before the next)."""


def estimate_io(plan: ShardPlan, shard_ranks: int, export_dtype: Optional[torch.dtype] = None) -> IOEstimate:
    """:class:`IOEstimate` of ``plan`` with params sharded over ``shard_ranks``; the checkpoint read holds each tensor
    in its storage dtype, the export in ``export_dtype`` (the plan's fp32 tensors in fp32)."""
    export_dtype = export_dtype or plan.bulk.compute or torch.bfloat16
    fp32 = set(plan.fp32_names)
    # a 4-bit weight is read in its nominal dtype (as a pretrained folder holds it) and quantized after
    local = [_local_bytes(replace(param, quantized=None), shard_ranks) for param in plan.params.values()]
    exported = [
        math.prod(param.shape) * (torch.float32 if name in fp32 else export_dtype).itemsize
        for name, param in plan.params.items()
    ]
    # 4-bit weights are read into staging shards of their nominal dtype, up to STAGING_BYTES at a time
    staged = sum(size for size, param in zip(local, plan.params.values(), strict=True) if param.quantized)
    return IOEstimate(
        load_read_per_rank=sum(local),
        load_host_peak=max(max(local, default=0), min(staged, STAGING_BYTES)),
        export_written=sum(exported),
        export_host_peak=max(exported, default=0),
    )


@dataclass(frozen=True)
class ActivationShape:
    """What a decoder's activations scale with (an HF config's sizes)."""

    hidden: int
    intermediate: int
    layers: int
    kv_hidden: int
    """Key/value width: key-value heads x head dim."""
    vocab: int

    @classmethod
    def of_config(cls, config: Any) -> "ActivationShape":
        # an image-text model's language model makes the sequence's activations (its tower's are per image)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            kv_heads * head_dim,
            config.vocab_size,
        )

    def tensor_parallel_share(self, size: int) -> "ActivationShape":
        """What one of ``size`` tensor-parallel ranks holds: the key/value heads and the MLP's hidden units split,
        the hidden-width activations whole on each (no sequence parallelism), the logits whole (the head stays
        whole)."""
        return replace(self, kv_hidden=self.kv_hidden // size, intermediate=self.intermediate // size)


def activation_bytes(
    shape: ActivationShape, seq_len: int, batch: int, context_parallel: int = 1, checkpointing: bool = True
) -> int:
    """An estimate of one training step's activation bytes per rank, for bf16 compute and attention that keeps no
    score matrix (flash or ring attention): per token of this rank's part of the sequence (``seq_len`` split over
    ``context_parallel`` ranks), each decoder layer saves its inputs to the norms and projections, q, k, v, the
    attention output and the MLP's three intermediate vectors (6 hidden + 2 key/value + 3 intermediate widths, in
    bf16); with ``checkpointing`` it keeps each layer's input only and one layer's full set during its recompute.
    The logits and the loss's fp32 copies add about 10 bytes per vocabulary entry and token. Measured activations on
    CPU: ``benchmarks/context_parallel.py``."""
    tokens = batch * math.ceil(seq_len / context_parallel)
    per_layer = (6 * shape.hidden + 2 * shape.kv_hidden + 3 * shape.intermediate) * 2
    layers = (shape.layers * shape.hidden * 2 + per_layer) if checkpointing else shape.layers * per_layer
    return tokens * (layers + 10 * shape.vocab)


def longest_sequence(
    shape: ActivationShape, free_bytes: float, batch: int, context_parallel: int, multiple: int = 1024
) -> int:
    """The longest sequence (a multiple of ``multiple`` tokens) whose activations, by :func:`activation_bytes` with
    checkpointing, fit in ``free_bytes`` per rank; 0 when none does."""
    per_token = activation_bytes(shape, context_parallel, batch, context_parallel) / batch
    if free_bytes <= 0:
        return 0
    tokens = int(free_bytes / (batch * per_token)) * context_parallel
    return tokens - tokens % multiple


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, microbatches: int, per_rank: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once (its peak): GPipe runs every forward first (all
    ``microbatches``); 1F1B starts the backwards once the last stage has its first micro-batch (``num_stages -
    stage``, at most ``microbatches``); Interleaved1F1B's warm-up holds ``(v - 1) x p + 2 x (p - 1 - rank) + 1`` of
    its ``v`` chunks' micro-batches on rank ``stage % p`` (Megatron's count), shared by its ``v`` stages."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, num_stages - stage)
    ranks = num_stages // per_rank
    rank = stage % ranks
    warmup = (per_rank - 1) * ranks + 2 * (ranks - 1 - rank) + 1
    return math.ceil(min(per_rank * microbatches, warmup) / per_rank)


def stage_activation_bytes(
    shape: ActivationShape, blocks: int, last: bool, seq_len: int, micro_batch: int, checkpointing: bool = True
) -> int:
    """:func:`activation_bytes` of one micro-batch through a stage of ``blocks`` layers; the logits and the loss's
    copies only on the ``last`` stage."""
    per_layer = (6 * shape.hidden + 2 * shape.kv_hidden + 3 * shape.intermediate) * 2
    layers = (blocks * shape.hidden * 2 + per_layer) if checkpointing else blocks * per_layer
    return micro_batch * seq_len * (layers + (10 * shape.vocab if last else 0))
