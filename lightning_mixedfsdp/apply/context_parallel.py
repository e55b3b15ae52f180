"""Context parallelism applied: every sequence split over the context-parallel ranks, attention run as ring attention
(the key/value parts travel around the ranks), head-tail load balanced for causal attention (rank ``r`` holds chunks
``r`` and ``2cp-1-r`` of ``2cp``, so every rank does the same causal work).

:class:`ContextParallel` is what a training loop uses: ``split(...)`` splits the tensors it names for the next
forward, and attention runs as ring attention until that forward's backward ends; ``loss(...)`` turns this rank's
part of a token loss into the whole sequence's mean. ``apply_context_parallel`` does both for a Hugging Face causal LM
at each call of the model, so ``model(input_ids=..., labels=...)`` trains unchanged and ``out.loss`` is the whole
sequence's loss on every rank of the group.

Attention reaches the ring through torch's ``scaled_dot_product_attention`` however the model reaches that function
(``F.scaled_dot_product_attention`` looked up at call time, or a name bound at import): a torch-function mode sees
every call. While a context-parallel forward or backward runs, its query, key and value become sequence-sharded
DTensors and torch's ring attention runs on them (``compat/torch.py`` registers the CPU op's handler, so CPU/gloo runs
it too); any other call is untouched. Attention the model writes out (``q @ k.T``, a mask, softmax) cannot be routed:
every forward under ``split`` counts its ring calls, and one that reached the ring fewer times than the model has
attention modules raises on every rank instead of training on each rank's part of the sequence alone."""

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.apply.recovery import StepTracker
from lightning_mixedfsdp.compat.torch import (
    ATTENTION_SEQUENCE_DIM,
    backward_keeping_modes,
    register_ring_attention,
    set_ring_rotate_method,
)
from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.model.tensors import IGNORE_INDEX

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_TORCH_SDPA = F.scaled_dot_product_attention
"""torch's attention function itself (``torch._C._nn.scaled_dot_product_attention``), as the mode receives it."""

_active: List["ContextParallel"] = []
"""The context parallelism whose forward or backward runs now (a stack: nested calls keep theirs)."""

_routing = threading.local()
"""Whether this thread's torch-function mode stack holds the ring's mode (it is pushed once per thread)."""

_registered = False


class _RingAttentionMode(TorchFunctionMode):
    """Sends every call of torch's attention function to the running pass's ring; every other call is untouched.

    It stays on the stack of the thread that first split a sequence. A backward runs with the modes its thread had
    when it started, so activation checkpointing's recompute reaches the ring too; ``Tensor.backward`` itself passes
    through this mode, and torch takes a mode off the stack while it handles a call, so the backward is started with
    the mode put back. The cost is a Python call per torch function while the mode is on the stack (a few
    microseconds), paid only by processes that split sequences."""

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _TORCH_SDPA and _active:
            return _active[-1].ring_attention(*args, **kwargs)
        if func is Tensor.backward or func is torch.autograd.backward:
            with self:
                return _backward(func, *args, **kwargs)
        return func(*args, **kwargs)


def _backward(func: Any, tensors: Any, *args: Any, **kwargs: Any) -> None:
    """``Tensor.backward(gradient, ...)`` or ``torch.autograd.backward(tensors, grad_tensors, ...)``, run with the
    modes on the stack now."""
    if "gradient" in kwargs:
        kwargs["grad_tensors"] = kwargs.pop("gradient")
    kwargs.pop("grad_variables", None)
    backward_keeping_modes(tensors, *args, **kwargs)


def _route_attention_on_this_thread() -> None:
    global _registered
    if not _registered:
        register_ring_attention()
        _registered = True
    if not getattr(_routing, "on", False):
        _RingAttentionMode().__enter__()  # never exited: see the mode's docstring
        _routing.on = True


def head_tail_positions(length: int, size: int, rank: int, device: Any = None) -> Tensor:
    """The positions of a sequence of ``length`` that context-parallel rank ``rank`` of ``size`` holds, in order:
    chunks ``rank`` and ``2 size - 1 - rank`` of ``2 size`` (torch's ``_HeadTailLoadBalancer``)."""
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


class ContextParallel:
    """One run's context parallelism: the ranks a batch's sequences are split over (``mesh``; None when
    ``context_parallel_size`` is 1, where every method hands tensors back unchanged) and how the ring moves key/value
    parts (``rotate_method``, set again at every pass, so a second run in the same process runs its own)."""

    def __init__(self, mesh: Optional["DeviceMesh"], rotate_method: str = "allgather") -> None:
        self.mesh = mesh
        self.rotate_method = rotate_method
        self.size = mesh.size() if mesh is not None else 1
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.ring_calls = 0
        """Attention calls that ran as ring attention since the pass began (:meth:`activate`)."""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def ring_attention(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """``scaled_dot_product_attention`` on this rank's parts of the sequence, as ring attention."""
        from torch.distributed.tensor import DTensor, Shard

        attn_mask = args[0] if args else kwargs.get("attn_mask")
        is_causal = args[2] if len(args) > 2 else kwargs.get("is_causal", False)
        if attn_mask is not None or not is_causal:
            _leave()  # the pass ends here: attention after it is local again
            raise ValueError(
                "context parallelism runs causal attention with no mask (ring attention), but this attention call"
                f" {'has a mask' if attn_mask is not None else 'is not causal'}: padding, sliding windows and packed"
                " documents are not supported with context_parallel_size > 1. Pad with tokens labelled -100 instead"
                " of a padding mask, or set context_parallel_size=1."
            )
        assert self.mesh is not None
        self.ring_calls += 1
        placements = [Shard(ATTENTION_SEQUENCE_DIM)]
        shards: Any = [DTensor.from_local(t, self.mesh, placements, run_check=False) for t in (query, key, value)]
        out: Any = _TORCH_SDPA(*shards, *args, **kwargs)  # a DTensor: torch's ring attention ran on the shards
        return out.to_local()

    def check_length(self, length: int, what: str = "the sequence") -> None:
        if self.enabled and length % (2 * self.size):
            raise ValueError(
                f"context_parallel_size={self.size}: {what} has {length} tokens, which do not divide into"
                f" 2 x {self.size} = {2 * self.size} chunks (head-tail load balancing); pad it to a multiple of"
                f" {2 * self.size} with tokens labelled -100."
            )

    def positions(self, length: int, device: Any = None) -> Tensor:
        """The global positions of this rank's part of a sequence of ``length`` tokens."""
        self.check_length(length)
        if not self.enabled:
            return torch.arange(length, device=device)
        return head_tail_positions(length, self.size, self.rank, device)

    def shard(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of ``tensor`` along its sequence dim (head-tail order)."""
        if not self.enabled:
            return tensor
        index = self.positions(tensor.shape[dim], tensor.device)
        return tensor.index_select(dim, index).contiguous()

    def gather(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence from every rank's part (``out.logits`` of a context-parallel forward), in order."""
        if not self.enabled:
            return tensor
        import torch.distributed as dist

        assert self.mesh is not None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.mesh.get_group())
        length = tensor.shape[dim] * self.size
        order = torch.cat([head_tail_positions(length, self.size, r, tensor.device) for r in range(self.size)])
        return torch.cat(parts, dim=dim).index_select(dim, torch.argsort(order))

    def split(self, *tensors: Tensor, dims: Optional[Tuple[int, ...]] = None) -> Tuple[Tensor, ...]:
        """This rank's parts of ``tensors`` (each split along its ``dims`` entry, 1 by default: token ids,
        positions, labels shifted over the whole sequence), and attention runs as ring attention from here until the
        backward of the next forward of a model this strategy set up ends (or that forward returns, under no grad).
        Tensors handed in must not require grad."""
        dims = dims or tuple(1 for _ in tensors)
        local = tuple(self.shard(t, d) for t, d in zip(tensors, dims, strict=True))
        self.activate()
        return local

    def activate(self) -> None:
        """Attention runs as ring attention until the running step's backward ends (see :meth:`split`)."""
        if not self.enabled:
            return
        _route_attention_on_this_thread()
        set_ring_rotate_method(self.rotate_method)
        self.ring_calls = 0
        if not _active or _active[-1] is not self:
            _active.append(self)

    def check_forward(self, attention_modules: List[str]) -> None:
        """After a forward under :meth:`split`: raise when its attention reached the ring fewer times than the model
        has ``attention_modules`` (at least once when none are known), since the rest attended only within this
        rank's part of the sequence. Every rank runs the same model, so every rank raises the same."""
        calls, self.ring_calls = self.ring_calls, 0
        if calls >= max(len(attention_modules), 1):
            return
        _leave()
        known = (
            f"the model has {len(attention_modules)} attention modules ({', '.join(attention_modules[:4])}"
            f"{', ...' if len(attention_modules) > 4 else ''})"
            if attention_modules
            else "the model must reach it at least once"
        )
        raise ValueError(
            f"context_parallel_size={self.size}: a forward under split(...) reached ring attention {calls} times, but"
            f" {known}. Attention that does not call torch's scaled_dot_product_attention (written out as q @ k.T,"
            " a mask and softmax, or another kernel) would attend only within each rank's part of the sequence."
            " Call torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) in every attention"
            " layer, or set context_parallel_size=1."
        )

    def loss(self, token_loss_sum: Tensor, token_count: Any) -> Tensor:
        """The whole sequence's mean token loss from this rank's part: ``token_loss_sum`` sums this rank's token
        losses, ``token_count`` counts the trained tokens of the whole sequences (labels not -100, all ranks). Its
        value is the same on every rank of the group; its gradient is this rank's share, scaled so that FSDP's
        average over the group's ranks adds the shares up."""
        local = token_loss_sum / token_count
        if not self.enabled:
            return local
        import torch.distributed as dist

        assert self.mesh is not None
        whole = local.detach().clone()
        dist.all_reduce(whole, group=self.mesh.get_group())
        return whole + self.size * (local - local.detach())


def shifted_labels(labels: Tensor) -> Tensor:
    """Next-token labels over the whole sequence (the last position predicts nothing): shift before splitting."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def apply_ring_attention_span(
    model: nn.Module, tracker: StepTracker, context: ContextParallel, attention_modules: List[str]
) -> List[RemovableHandle]:
    """Ring attention, once a forward started it (:meth:`ContextParallel.split`), ends with the step's backward
    (``tracker``), when a failed step is given up, or with the forward itself when it runs under no grad or raises.
    A forward that ran under ``split`` is checked: its attention must have reached the ring once per module in
    ``attention_modules`` (:meth:`ContextParallel.check_forward`)."""
    tracker.on_backward_end(_leave)
    tracker.on_reset(_leave)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if not _active or _active[-1] is not context:
            return
        if output is None:  # torch passes None when the forward raised
            _leave()
            return
        context.check_forward(attention_modules)
        if not torch.is_grad_enabled():
            _leave()

    return [model.register_forward_hook(after, always_call=True)]


def attention_modules(model: nn.Module) -> List[str]:
    """The attention modules each forward of ``model`` runs, where their class names say so: the innermost modules
    whose class name ends in ``Attention`` (HF's ``LlamaAttention``, the reference model's ``Attention``, most
    hand-written models), outside vision and audio towers (which run only for some inputs). A model named otherwise
    gives none: its forwards must then reach the ring at least once."""
    names: List[str] = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention") or _in_tower(name):
            continue
        inner = any(type(m).__name__.endswith("Attention") for m in module.modules() if m is not module)
        canonical = canonical_name(name)
        if not inner and canonical not in names:
            names.append(canonical)
    return names


def _in_tower(name: str) -> bool:
    return any(part in name for part in ("vision", "visual", "audio"))


def apply_context_parallel(model: nn.Module, context: ContextParallel) -> List[RemovableHandle]:
    """At each call of a Hugging Face causal LM: split ``input_ids``, its positions and its labels (shifted over the
    whole sequence first) along the sequence, run attention as ring attention through the forward and the backward
    (:func:`apply_ring_attention_span` ends it), and make ``out.loss`` the whole sequence's loss (tokens labelled
    -100 counted wherever they fall)."""
    state: Dict[str, Any] = {}

    def before(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict]:
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        ids = kwargs.get("input_ids")
        if not isinstance(ids, Tensor):
            raise ValueError(
                "context parallelism splits input_ids along the sequence: call the model with input_ids= (not"
                " inputs_embeds)."
            )
        context.check_length(ids.shape[1], "input_ids")
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "context parallelism runs causal attention with no padding mask: this attention_mask masks tokens."
                " Pad with tokens labelled -100 and leave attention_mask out, or set context_parallel_size=1."
            )
        positions = kwargs.pop("position_ids", None)
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        kwargs["input_ids"], kwargs["position_ids"] = context.split(ids, positions)
        # a plain mask of ones: transformers then builds no mask from the rank's jumping positions (it would read
        # them as packed documents) and attention stays plain causal over the whole sequence
        kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        kwargs["use_cache"] = False
        labels = kwargs.pop("labels", None)
        state["counted"] = None
        if labels is not None:
            shifted = shifted_labels(labels)
            count = kwargs.get("num_items_in_batch")
            if count is None:
                count = (shifted != IGNORE_INDEX).sum()
            state["counted"] = kwargs["num_items_in_batch"] = count
            kwargs["labels"] = kwargs["shift_labels"] = context.shard(shifted)
        return args, kwargs

    def after(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if state.get("counted") is not None and isinstance(loss, Tensor):
            # this rank's sum over its tokens divided by the whole count: the ranks' losses add up to the whole mean
            output["loss"] = context.loss(loss * state["counted"], state["counted"])
        return output

    return [
        model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]


def _leave() -> None:
    """The running pass ends: attention is local again."""
    if _active:
        _active.pop()


def context_parallel_problems(model: nn.Module, size: int) -> List[str]:
    """What cannot run with its sequences split over ``size`` ranks: sequence mixers that are not attention (their
    state runs along the whole sequence), attention that is not causal SDPA without a mask."""
    if size <= 1:
        return []
    problems = []
    mixers = non_attention_mixers(model)
    if mixers:
        problems.append(
            f"context_parallel_size={size} splits every sequence across ranks, and only attention can run on split"
            f" sequences (as ring attention); these sequence mixers mix tokens another way, which needs the whole"
            f" sequence: {', '.join(mixers[:6])}{' and more' if len(mixers) > 6 else ''}. Leave"
            " context_parallel_size=1 for this model, or use a model whose every sequence mixer is attention."
        )
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation != "sdpa":
        problems.append(
            f"context_parallel_size={size} runs attention through torch's scaled_dot_product_attention, but the model"
            f" uses attn_implementation={implementation!r}; build or load it with attn_implementation='sdpa'."
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if (window is not None and getattr(config, "use_sliding_window", True)) or "sliding_attention" in layer_types:
        problems.append(
            f"context_parallel_size={size} runs plain causal attention over the whole sequence, but the model uses"
            f" sliding-window attention (sliding_window={window}); set context_parallel_size=1 for it."
        )
    return problems


_MIXER_SUFFIXES = ("Mixer", "GatedDeltaNet", "LinearAttention", "ShortConv", "Hyena", "SSM", "Mamba")
"""How the class names of sequence mixers that are not attention end: HF's ``MambaMixer``, ``Mamba2Mixer``,
``Qwen3NextGatedDeltaNet``, ``Lfm2ShortConv``, the reference model's ``Mixer``. Suffixes, so that the containers
named after them (``MambaForCausalLM``, ``MambaModel``) are not taken for mixers."""


def non_attention_mixers(model: nn.Module) -> List[str]:
    """Modules that mix tokens without attention, each named with its class (``layers.1.attention (Mixer)``):
    recurrent or linear-attention mixers by the end of their class name, and convolutions along the sequence (a
    depthwise ``Conv1d``, as Mamba and GatedDeltaNet have) outside them."""
    found: List[str] = []
    described: List[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f in found):
            continue
        kind = type(module).__name__
        depthwise = isinstance(module, nn.Conv1d) and module.groups == module.in_channels > 1
        if kind.endswith(_MIXER_SUFFIXES) or depthwise:
            found.append(name)
            described.append(f"{canonical_name(name) or '<root>'} ({kind})")
    return described
