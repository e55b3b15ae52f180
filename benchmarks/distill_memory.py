"""Distillation's memory and time (``recipes/objectives/distillation.py``), in three measurements:

1. **The teacher's bytes per rank** (2 ranks, gloo, bf16-true): an HF Llama teacher built from its config, frozen,
   beside a smaller trainable HF Llama student, each set up on its own by ``MixedFSDP2Strategy`` (as the Trainer
   strategy shards the LightningModule's ``model`` and ``teacher`` children: a wholly frozen child is planned frozen,
   in the compute dtype, with no grads and no optimizer state). Three teachers: sharded in bf16; sharded with
   ``quantize_base="nf4"`` (the frozen Linear weights in torchao's NF4); not set up at all, a bf16 copy replicated on
   every rank. Bytes are counted tensor by tensor with each tensor's device (not RSS): at rest, the rank's stored
   shards (a 4-bit weight by its parts); at the peak of the objective's own teacher call
   (``hidden_and_output_weight(teacher, ..., "teacher")`` under ``no_grad``), the shards plus what FSDP holds
   all-gathered (read from its param groups at every module's forward hooks; the output weight's unit stays gathered
   until the loss's backward ends, and the loss reads the weight there, so only a 4-bit one would be copied,
   dequantized). Against that: the teacher's storage bytes / world size, and the largest gathered unit (the wrap unit
   whose sharded groups gather the most bytes, in the compute dtype, a 4-bit weight in 4 bits, from the plan).
2. **The loss's peak memory** (one fresh process per variant, one thread): ``distillation_sums`` a chunk of tokens at
   a time, against the same forward KL and cross-entropy on the whole ``[tokens, vocab]`` logits, forward and
   backward, at a 128k vocabulary. Peak RSS growth: ``VmHWM`` minus the RSS once the inputs exist (after a warm-up
   call at 2 tokens, ``malloc_trim`` and a ``clear_refs`` reset of the high-water mark). Under glibc's defaults and
   with its mmap threshold fixed at 128 KiB (every freed tensor leaves RSS at once): below 32 MiB a freed block may
   stay in glibc's heap, and a chunk's RSS then grows with the chunks run (a few MiB chunks at tiny sizes; not at
   the default sizes, whose chunk tensors are mmapped either way). The inputs are fp32 by default: this CPU (AVX2,
   no AVX512-BF16) multiplies bf16 some 25x slower; ``--loss-dtype bfloat16`` measures the recipe's dtype.
3. **A distillation step's time** against plain training of the same student (HF's label cross-entropy on its
   logits, nothing else), each a forward, backward and AdamW step on fresh tokens, the objective's own path for
   distillation (forward KL, weight 0.5, ``chunk_tokens`` the first of ``--chunk-tokens``), the set-ups taking
   steps in turn in the same launch as 1. (2 ranks), medians of the slower rank's steps.

    python -m benchmarks.distill_memory                 # 2 CPU ranks, about 4 minutes
    python -m benchmarks.distill_memory --parts loss --chunk-tokens 128 1024 --loss-dtype bfloat16

Figures, never asserted: ``tests/test_benchmarks.py`` runs it at tiny sizes for its structure.
"""

import argparse
import ctypes
import gc
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from benchmarks.meta_memory import _status
from benchmarks.qlora_memory import stored_bytes
from lightning_mixedfsdp.testing import run_distributed

SIZES: Dict[str, Dict[str, Dict[str, int]]] = {
    "default": {
        "teacher": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16),
        "student": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8),
    },
    "tiny": {  # NF4 needs shards of whole 16,384-weight blocks
        "teacher": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4),
        "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    },
}
VOCAB = {"default": 32000, "tiny": 512}
TEACHERS: Dict[str, Optional[Dict[str, Any]]] = {
    "bf16, sharded": {},
    "nf4, sharded": {"quantize_base": "nf4"},
    "bf16, replicated": None,  # not set up: a whole copy on every rank
}
PLAIN = "plain training (labels only)"
MiB = 2**20


def llama(size: str, who: str) -> Any:
    from transformers import LlamaConfig

    fields: Dict[str, Any] = dict(SIZES[size][who])
    heads = fields["num_attention_heads"]
    return LlamaConfig(vocab_size=VOCAB[size], num_key_value_heads=heads, max_position_embeddings=2048, **fields)


# -- 1. the teacher's bytes, 3. the step's time (one launch of 2 ranks)


class TeacherBytes:
    """Samples the teacher's bytes on this rank, by device type, at every forward hook of its modules: its stored
    tensors plus what FSDP holds all-gathered at that moment (its groups' all-gather outputs, freed ones left out)."""

    def __init__(self, teacher: nn.Module) -> None:
        self.teacher = teacher
        self.stored = _by_device((t, stored_bytes(t)) for t in [*teacher.parameters(), *teacher.buffers()])
        self.fsdp_params = _fsdp_params(teacher)
        self.samples: List[Tuple[Dict[str, int], bool]] = []
        self.head_ran = False

    def peak_of_call(self, ids: Tensor, positions: Tensor) -> Dict[str, Any]:
        """The objective's teacher call, hooked: the peak of stored + gathered + any copy of the output weight the
        loss reads (from the moment the output projection has run, a copy exists)."""
        from lightning_mixedfsdp.recipes.objectives.distillation import hidden_and_output_weight, output_projection

        head = output_projection(self.teacher)
        handles = []
        for module in self.teacher.modules():
            handles.append(module.register_forward_pre_hook(lambda *_: self._sample()))
            handles.append(module.register_forward_hook(lambda m, *_: self._sample(m is head)))
        try:
            with torch.no_grad():
                _, weight = hidden_and_output_weight(self.teacher, ids, positions, "teacher")
            self._sample()
        finally:
            for handle in handles:
                handle.remove()
        after_call = self.samples[-1][0]
        held = {t.untyped_storage().data_ptr() for p in self.fsdp_params for t in p.all_gather_outputs}
        held.add(head.weight.untyped_storage().data_ptr())  # a teacher that is not sharded: its own weight
        # the weight the loss reads: the gathered (or own) one itself, or a dequantized copy of a 4-bit one
        copied = weight.untyped_storage().data_ptr() not in held
        copy = {weight.device.type: weight.untyped_storage().nbytes() if copied else 0}
        totals = [_add(sample, copy) if after_head else sample for sample, after_head in self.samples]
        peak = max(totals, key=lambda t: sum(t.values()))
        gathered = max(sum(s.values()) - sum(self.stored.values()) for s, _ in self.samples)
        return {
            "stored": self.stored,
            "peak": peak,
            "gathered_at_once": gathered,
            "head_copy": sum(copy.values()),
            "after_call": sum(_add(after_call, copy).values()),  # what the loss then runs beside
        }

    def _sample(self, head_ran: bool = False) -> None:
        self.head_ran = self.head_ran or head_ran
        self.samples.append((_add(self.stored, _gathered(self.fsdp_params)), self.head_ran))


def _by_device(pairs: Any) -> Dict[str, int]:
    from lightning_mixedfsdp.model.tensors import local_tensor

    out: Dict[str, int] = {}
    for tensor, nbytes in pairs:
        kind = local_tensor(tensor).device.type
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _add(a: Dict[str, int], b: Dict[str, int]) -> Dict[str, int]:
    return {kind: a.get(kind, 0) + b.get(kind, 0) for kind in {*a, *b}}


def _fsdp_params(module: nn.Module) -> List[Any]:
    """FSDP2's params of every group under ``module`` (torch's private FSDPParam: its all-gather outputs)."""
    from torch.distributed.fsdp import FSDPModule

    params: List[Any] = []
    for child in module.modules():
        if isinstance(child, FSDPModule):
            group = child._get_fsdp_state()._fsdp_param_group
            params += group.fsdp_params if group is not None else []
    return params


def _gathered(fsdp_params: List[Any]) -> Dict[str, int]:
    storages: Dict[Tuple[str, int], int] = {}
    for param in fsdp_params:
        for tensor in [*param.all_gather_outputs, *getattr(param, "_unsharded_inner_tensors", [])]:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                storages[tensor.device.type, storage.data_ptr()] = storage.nbytes()
    out: Dict[str, int] = {}
    for (kind, _), nbytes in storages.items():
        out[kind] = out.get(kind, 0) + nbytes
    return out


def largest_gathered_unit(plan: Any) -> int:
    """The wrap unit whose sharded groups all-gather the most bytes (the compute dtype; a 4-bit weight in 4 bits)."""
    import math

    per_unit: Dict[str, int] = {}
    for group in plan.sharded_groups:
        for name in group.params:
            param = plan.params[name]
            nbytes = param.nbytes if param.quantized else math.prod(param.shape) * param.key.compute.itemsize
            per_unit[group.unit] = per_unit.get(group.unit, 0) + nbytes
    return max(per_unit.values(), default=0)


def _launch(rank: int, world: int, size: str, seq: int, steps: int, chunk: int, timed: List[str]) -> Dict[str, Any]:
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from transformers import LlamaForCausalLM

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    teacher_config, student_config = llama(size, "teacher"), llama(size, "student")
    fabrics: Dict[str, Any] = {}
    teachers: Dict[str, nn.Module] = {}
    out: Dict[str, Dict[str, Any]] = {}
    for name, options in TEACHERS.items():
        if options is None:  # every rank builds the same copy
            torch.manual_seed(0)
            teacher: Any = LlamaForCausalLM(teacher_config)
            teacher = teacher.to(torch.bfloat16).requires_grad_(False)
            full = sum(stored_bytes(t) for t in [*teacher.parameters(), *teacher.buffers()])
            teachers[name], unit, storage = teacher, 0, full
        else:
            strategy = MixedFSDP2Strategy(**options)
            fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-true")
            fabric.launch()
            torch.manual_seed(0)
            with fabric.init_module(empty_init=True):
                teacher = LlamaForCausalLM(teacher_config).requires_grad_(False)
            fabrics[name] = fabric
            teachers[name] = fabric.setup_module(teacher).module  # called directly, as the LightningModule does
            plan = strategy.plan_of(teachers[name])
            unit, storage = largest_gathered_unit(plan), sum(p.nbytes for p in plan.params.values())
        buffers = sum(stored_bytes(b) for b in teachers[name].buffers())
        out[name] = {"unit": unit, "storage": storage + (buffers if options is not None else 0)}
    # the student: trainable, set up as the recipe's model child
    fabric = fabrics["bf16, sharded"]
    torch.manual_seed(1)
    with fabric.init_module(empty_init=True):
        student = LlamaForCausalLM(student_config)
    student_module: Any = fabric.setup_module(student).module
    optimizer: Any = fabric.setup_optimizers(torch.optim.AdamW(student_module.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(rank)
    vocab = student_config.vocab_size

    def tokens() -> Tuple[Tensor, Tensor]:
        ids = torch.randint(0, vocab, (1, seq), generator=generator)
        return ids, torch.arange(seq).expand_as(ids)

    from lightning_mixedfsdp.recipes.objectives.distillation import release_output_unit

    ids, positions = tokens()
    for name, teacher in teachers.items():
        out[name].update(TeacherBytes(teacher).peak_of_call(ids, positions))
        release_output_unit(teacher)  # as the objective does after the loss's backward
        dist.barrier()

    def step(setup: str) -> float:
        from lightning_mixedfsdp.recipes.objectives.distillation import hidden_and_output_weight, release_output_unit
        from lightning_mixedfsdp.recipes.objectives.divergences import distillation_sums

        ids, positions = tokens()
        dist.barrier()
        started = time.perf_counter()
        if setup == PLAIN:
            loss = student_module(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
        else:  # the objective's path: weight 0.5, forward KL at temperature 1
            with torch.no_grad():
                teacher_hidden, teacher_weight = hidden_and_output_weight(teachers[setup], ids, positions, "teacher")
            hidden, weight = hidden_and_output_weight(student_module, ids, positions, "student")
            sums = distillation_sums(
                hidden[:, :-1], weight, teacher_hidden[:, :-1], teacher_weight, ids[:, 1:], vocab, chunk_tokens=chunk
            )
            loss = (0.5 * sums.divergence + 0.5 * sums.cross_entropy) / sums.tokens
        fabric.backward(loss)
        if setup != PLAIN:
            release_output_unit(teachers[setup])
        optimizer.step()
        optimizer.zero_grad()
        seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's
        return seconds.item()

    if timed:
        step(PLAIN)  # warm-up: AdamW's state (each teacher ran once above)
    times: Dict[str, List[float]] = {setup: [] for setup in timed}
    for index in range(steps):  # one step of each set-up in turn, the order reversed every other round
        for setup in timed if index % 2 == 0 else timed[::-1]:
            times[setup].append(step(setup))
    return {"teachers": out, "times": times}


# -- 2. the loss's peak memory (a fresh process per variant)


ALLOCATORS = {
    "glibc": "glibc's defaults",
    "mmap": "glibc, every allocation over 128 KiB mmapped (M_MMAP_THRESHOLD fixed): freed tensors leave RSS",
}


def _loss_peak(
    rank: int, world: int, variant: str, allocator: str, tokens: int, vocab: int, hidden: int, dtype: str
) -> Dict[str, float]:
    """Peak RSS growth of one forward and backward of the loss at ``tokens`` tokens: ``variant`` is ``"whole"`` or a
    chunk size; ``allocator`` one of ``ALLOCATORS``."""
    libc = ctypes.CDLL("libc.so.6")
    if allocator == "mmap":
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it turns glibc's dynamic threshold off
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int, grad: bool = False) -> Tensor:
        values = (torch.randn(*shape, generator=generator) * shape[-1] ** -0.5).to(getattr(torch, dtype))
        return values.requires_grad_(grad)

    student_weight, teacher_weight = tensor(vocab, hidden, grad=True), tensor(vocab, hidden)

    def inputs(count: int) -> Tuple[Tensor, Tensor, Tensor]:
        labels = torch.randint(0, vocab, (count,), generator=generator)
        return tensor(count, hidden, grad=True), tensor(count, hidden), labels

    def run(student_hidden: Tensor, teacher_hidden: Tensor, labels: Tensor) -> Tuple[float, float]:
        started = time.perf_counter()
        divergence, cross_entropy = loss_sums(
            variant, student_hidden, student_weight, teacher_hidden, teacher_weight, labels
        )
        (0.5 * divergence + 0.5 * cross_entropy).backward()
        return divergence.item() + cross_entropy.item(), time.perf_counter() - started

    run(*inputs(2))  # kernels and allocator warmed up
    student_weight.grad = None
    measured = inputs(tokens)
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _status("VmRSS:")  # the inputs exist
    loss, seconds = run(*measured)
    return {"growth": _status("VmHWM:") - before, "loss": loss, "seconds": seconds}


def loss_sums(
    variant: str,
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
) -> Tuple[Tensor, Tensor]:
    """Forward KL at temperature 1 and the labels' cross-entropy, summed: the objective's chunks, or the whole
    logits (what a model that returns its logits computes)."""
    import torch.nn.functional as F

    from lightning_mixedfsdp.recipes.objectives.divergences import distillation_sums, token_divergences

    vocab = student_weight.shape[0]
    if variant != "whole":
        sums = distillation_sums(
            student_hidden, student_weight, teacher_hidden, teacher_weight, labels, vocab, chunk_tokens=int(variant)
        )
        return sums.divergence, sums.cross_entropy
    student_logits = (student_hidden @ student_weight.t()).float()
    with torch.no_grad():
        teacher_logits = (teacher_hidden @ teacher_weight.t()).float()
    divergence = token_divergences(student_logits, teacher_logits, "forward_kl", 1.0).sum()
    return divergence, F.cross_entropy(student_logits, labels, reduction="sum")


# -- the tables


def _where(by_device: Dict[str, int]) -> str:
    total = sum(by_device.values())
    return ", ".join(f"{kind} {nbytes / total:.0%}" for kind, nbytes in sorted(by_device.items()) if nbytes)


def print_teachers(teachers: Dict[str, Dict[str, Any]], world: int) -> Dict[str, float]:
    print("| teacher | at rest per rank | peak per rank (its call) | where | storage / world | largest gathered unit |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for name, row in teachers.items():
        rest, peak, share = sum(row["stored"].values()), sum(row["peak"].values()), row["storage"] / world
        ratios[name] = peak / (share + row["unit"])
        print(
            f"| {name} | {rest / MiB:.1f} MiB | {peak / MiB:.1f} MiB | {_where(row['peak'])} | {share / MiB:.1f} MiB |"
            f" {row['unit'] / MiB:.1f} MiB |"
        )
    print()
    columns = ["peak / (storage/world + unit)", "the same without the copy", "most gathered at once"]
    print(f"| teacher | {' | '.join(columns)} | output weight copied out | held after its call |")
    print("|---|---|---|---|---|---|")
    for name, row in teachers.items():
        budget = row["storage"] / world + row["unit"]
        uncopied = (sum(row["stored"].values()) + row["gathered_at_once"]) / budget
        print(
            f"| {name} | {ratios[name]:.3f} | {uncopied:.3f} | {row['gathered_at_once'] / MiB:.1f} MiB |"
            f" {row['head_copy'] / MiB:.1f} MiB | {row['after_call'] / MiB:.1f} MiB |"
        )
    return ratios


def print_loss(args: argparse.Namespace) -> Dict[str, Dict[str, Dict[str, float]]]:
    variants = ["whole", *map(str, args.chunk_tokens)]
    sizes = [args.loss_tokens, args.loss_vocab, args.loss_hidden, args.loss_dtype]
    loss: Dict[str, Dict[str, Dict[str, float]]] = {}
    for allocator in args.allocators:
        for variant in variants:  # each in a fresh process (one thread), one after another
            row = run_distributed(_loss_peak, 1, variant, allocator, *sizes, timeout=3600)[0]
            loss.setdefault(allocator, {})[variant] = row
    print(
        f"Loss: forward KL + the labels' cross-entropy over {args.loss_tokens} tokens, vocab {args.loss_vocab}, hidden"
        f" {args.loss_hidden}, {args.loss_dtype} hidden states and weights, forward and backward, one process each\n"
    )
    print("| allocator | loss | peak RSS growth | of the whole logits' | seconds | loss sum |")
    print("|---|---|---|---|---|---|")
    for allocator, rows in loss.items():
        whole = rows["whole"]["growth"]
        for variant, row in rows.items():
            label = (
                "whole [tokens, vocab] logits" if variant == "whole" else f"`distillation_sums`, chunk_tokens={variant}"
            )
            print(
                f"| {allocator} | {label} | {row['growth'] / MiB:.1f} MiB | {row['growth'] / whole:.3f} |"
                f" {row['seconds']:.2f} | {row['loss']:.6g} |"
            )
    print("\n" + "; ".join(f"{name}: {text}" for name, text in ALLOCATORS.items() if name in loss))
    return loss


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["teacher", "loss", "step"], default=["teacher", "loss", "step"])
    parser.add_argument("--size", choices=list(SIZES), default="default", help="the teacher's and student's shapes")
    parser.add_argument("--seq", type=int, default=32, help="tokens per rank in a timed step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each set-up")
    parser.add_argument(
        "--timed", nargs="+", choices=list(TEACHERS), default=["bf16, sharded", "nf4, sharded"], help="teachers timed"
    )
    parser.add_argument("--loss-vocab", type=int, default=131072)
    parser.add_argument("--loss-tokens", type=int, default=1024)
    parser.add_argument("--loss-hidden", type=int, default=256)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[128], help="chunk sizes of the loss")
    parser.add_argument(
        "--loss-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the hidden states' and weights' dtype (the logits are fp32 either way); a CPU without AVX512-BF16 or AMX"
        " multiplies bf16 some 25x slower than fp32",
    )
    parser.add_argument("--allocators", nargs="+", choices=list(ALLOCATORS), default=list(ALLOCATORS))
    args = parser.parse_args(argv)
    results: Dict[str, Any] = {}
    world = 2
    if {"teacher", "step"} & set(args.parts):
        timed = [PLAIN, *args.timed] if "step" in args.parts else []
        launch = run_distributed(
            _launch, world, args.size, args.seq, args.steps, args.chunk_tokens[0], timed, timeout=3600
        )
        teacher, student = llama(args.size, "teacher"), llama(args.size, "student")
        print(
            f"HF Llama teacher (hidden {teacher.hidden_size}, {teacher.num_hidden_layers} layers, vocab"
            f" {teacher.vocab_size}) frozen beside a student (hidden {student.hidden_size}, {student.num_hidden_layers}"
            f" layers), bf16-true, {world} ranks (gloo, CPU)\n"
        )
        if "teacher" in args.parts:
            per_rank = [rank["teachers"] for rank in launch]
            busiest = {name: max(per_rank, key=lambda r: sum(r[name]["peak"].values()))[name] for name in TEACHERS}
            results["teachers"] = busiest
            results["ratios"] = print_teachers(busiest, world)
            print()
        if "step" in args.parts:
            times = {setup: statistics.median(values) for setup, values in launch[0]["times"].items()}
            results["step_s"] = times
            print(f"| step ({args.seq} tokens per rank, forward + backward + AdamW) | median s | against plain |")
            print("|---|---|---|")
            for setup, seconds in times.items():
                label = setup if setup == PLAIN else f"distillation, teacher {setup}"
                print(f"| {label} | {seconds:.3f} | {seconds / times[PLAIN]:.2f}x |")
            print()
    if "loss" in args.parts:
        results["loss"] = print_loss(args)
    return results


if __name__ == "__main__":
    main()
