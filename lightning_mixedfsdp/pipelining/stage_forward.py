"""A model cut down to this rank's pipeline stages, with the forward each stage runs.

The model object stays the user's (its class, its config, its methods): the modules of other ranks' stages are
removed, the block list becomes a ``ModuleDict`` keyed by each block's original index, so ``named_parameters()``
yields this rank's params under the names they had (``model.layers.5.mlp.up_proj.weight``); its ``forward`` becomes
the stages', chosen by the ``pipeline_stage`` keyword (several stages per rank share one module and one FSDP root).

An HF decoder's stage runs the model's own forward (torchtitan's way): the decoder builds its masks, positions and
rotary embeddings as it does uncut, and loops over every layer index, meeting a pass-through where a layer is not the
stage's (:class:`StageBlocks`); a stage after the first passes the hidden states it received as ``inputs_embeds``, one
before the last stops before the final norm, and the last runs the causal LM's head (soft-cap, logit scaling) as the
model does.
"""

import contextlib
import functools
import inspect
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Set, cast

from torch import Tensor, nn

from lightning_mixedfsdp.compat.transformers import causal_lm_output, hidden_states_as_inputs_embeds
from lightning_mixedfsdp.planning.stages import HF_DECODER, BlockLayout, Stage


def cut_to_stages(
    model: nn.Module, layout: BlockLayout, stages: Sequence[Stage], block_outputs: Optional[Mapping[int, int]] = None
) -> None:
    """Remove from ``model`` every module none of ``stages`` holds, and install their forward. ``block_outputs``:
    what each block of an HF decoder returns (:class:`ProbeResult`; a tensor where not probed)."""
    held = {name for stage in stages for name in stage.modules}
    if layout.family == HF_DECODER:
        stage_blocks = StageBlocks(_block_list(model, layout), block_outputs or {})
        for key in [key for key in stage_blocks.keys() if f"{layout.block_list}.{key}" not in held]:
            del stage_blocks[key]
        _set_submodule(model, layout.block_list, stage_blocks)
    else:
        kept = {name.rsplit(".", 1)[-1]: model.get_submodule(name) for name in layout.blocks if name in held}
        _set_submodule(model, layout.block_list, nn.ModuleDict(kept))
    for name in layout.first + layout.last:
        if name not in held:
            _set_submodule(model, name, None)
    by_index = {stage.index: stage for stage in stages}
    model.forward = functools.partial(_stage_forward, model, by_index, _stage_runner(layout))


def _block_list(model: nn.Module, layout: BlockLayout) -> List[nn.Module]:
    return list(cast(nn.ModuleList, model.get_submodule(layout.block_list)))


def _stage_runner(layout: BlockLayout) -> Callable[..., Tensor]:
    if layout.family == HF_DECODER:
        return functools.partial(_hf_decoder_stage, layout.last[0].rsplit(".", 1)[-1])
    return _sequence_stage


def output_wrapper(layout: BlockLayout) -> Callable[[Any], Any]:
    """What the last stage's tensor becomes before the loss sees it: the output object the model's own forward
    returns (an HF causal LM's), or the tensor itself."""
    return causal_lm_output if layout.family == HF_DECODER else _same


def _same(output: Any) -> Any:
    return output


def _set_submodule(model: nn.Module, name: str, module: Any) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _stage_forward(
    model: nn.Module,
    stages: Dict[int, Stage],
    run: Callable[..., Tensor],
    inputs: Tensor,
    *,
    pipeline_stage: int,
    **kwargs: Any,
) -> Tensor:
    if pipeline_stage not in stages:
        held = sorted(stages)
        raise ValueError(f"pipeline_stage={pipeline_stage} is not on this rank, which holds stages {held}.")
    return run(model, stages[pipeline_stage], inputs, **kwargs)


class StageBlocks(nn.ModuleDict):
    """An HF decoder's block list under pipeline stages: the blocks this rank holds, keyed by original index, while
    the decoder's own forward loops over every index. Iterated or sliced (``self.layers[: num_hidden_layers]``), it
    yields one module per index in order: the block itself where it belongs to the running stage (every held block
    when none runs), else a pass-through that returns the hidden states as the block would (a tensor, or a tuple
    headed by them) and carries the block's plain attributes (``attention_type``, ``layer_type``: some loops read
    them)."""

    _stand_ins: List[nn.Module]
    _running: Optional[Set[int]]

    def __init__(self, blocks: Sequence[nn.Module], outputs: Mapping[int, int]) -> None:
        super().__init__({str(index): block for index, block in enumerate(blocks)})
        stand_ins = [_PassThrough(_plain_attributes(block), outputs.get(i, 0)) for i, block in enumerate(blocks)]
        object.__setattr__(self, "_stand_ins", stand_ins)
        object.__setattr__(self, "_running", None)

    @contextlib.contextmanager
    def running(self, blocks: Iterable[str]) -> Iterator[None]:
        """While one stage runs: its blocks (by name) are the ones iteration yields."""
        previous = self._running
        object.__setattr__(self, "_running", {int(name.rsplit(".", 1)[-1]) for name in blocks})
        try:
            yield
        finally:
            object.__setattr__(self, "_running", previous)

    def _in_order(self) -> List[nn.Module]:
        running = self._running
        return [
            self._modules[str(i)] if str(i) in self._modules and (running is None or i in running) else stand_in
            for i, stand_in in enumerate(self._stand_ins)
        ]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self._in_order()[key]
        return super().__getitem__(str(key))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._in_order())

    def __len__(self) -> int:
        return len(self._stand_ins)


class _PassThrough(nn.Module):
    """A block another stage runs: its hidden states go on unchanged."""

    def __init__(self, attributes: Dict[str, Any], outputs: int) -> None:
        super().__init__()
        self.__dict__.update(attributes)
        self._outputs = outputs

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        return hidden_states if self._outputs == 0 else (hidden_states,) + (None,) * (self._outputs - 1)


def _plain_attributes(block: nn.Module) -> Dict[str, Any]:
    return {
        name: value
        for name, value in vars(block).items()
        if not name.startswith("_") and name != "training" and isinstance(value, (str, int, float, bool, type(None)))
    }


def _hf_decoder_stage(norm: str, model: Any, stage: Stage, inputs: Tensor, **kwargs: Any) -> Tensor:
    """One stage of an HF causal LM through its own forward (``use_cache=False``, as training runs it): token ids
    on the first stage, the received hidden states as ``inputs_embeds`` after; the causal LM's logits on the last,
    the decoder's hidden states before its final norm (``norm``) on the others."""
    decoder = model.model
    embedded = {"input_ids": inputs} if stage.first else {"inputs_embeds": inputs}
    with contextlib.ExitStack() as scope:
        scope.enter_context(decoder.layers.running(stage.blocks))
        if not stage.first:
            scope.enter_context(hidden_states_as_inputs_embeds(decoder))
        inputs_and_options = {**kwargs, **embedded, "use_cache": False}
        if stage.last:  # the class's forward: the instance's is this one
            return type(model).forward(model, **inputs_and_options).logits
        scope.enter_context(_replaced(decoder, norm, nn.Identity()))
        return decoder(**inputs_and_options).last_hidden_state


@contextlib.contextmanager
def _replaced(parent: nn.Module, name: str, module: nn.Module) -> Iterator[None]:
    saved = parent._modules[name]
    parent._modules[name] = module
    try:
        yield
    finally:
        parent._modules[name] = saved


PROBE_ELEMENTS = 2_000_000_000
"""Models of more parameter elements than this are not probed at setup (a forward of the whole model on one rank)."""
PROBE_TOLERANCE = 1e-6
"""The largest difference, relative to the output's largest magnitude, between the composed stages and the model's
forward that counts as the same computation: the same modules in the same order agree to the bit (the Llama family's
stages differ by exactly 0.0 in fp32 and bf16), and a forward that scales, soft-caps or adds anything differs by more
(a soft-cap of 30 on logits of order 1 by about 1e-4)."""


class ProbeResult(NamedTuple):
    gap: Optional[float]
    """The largest difference relative to the forward's largest magnitude (inf where the two differ in shape or
    in where they are not finite, or where a stage raised); None where no probe ran."""
    reason: str
    """Why no probe ran, or what a stage raised (empty otherwise)."""
    block_outputs: Mapping[int, int] = {}
    """An HF decoder's blocks by index, each with the number of values it returns (0: a tensor), as the probe saw."""


def composed_stage_gap(model: nn.Module, layout: BlockLayout, stages: Sequence[Stage]) -> ProbeResult:
    """Run a probe through ``model``'s own forward and through every stage's forward in order (the model still whole,
    in eval mode, no grad; every module's mode and the block list restored after), and compare."""

    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return ProbeResult(None, "its params are on the meta device")
    if sum(p.numel() for p in params) > PROBE_ELEMENTS:
        return ProbeResult(None, f"it has more than {PROBE_ELEMENTS:.0e} parameter elements")
    probe = _probe_input(model, layout, params[0].device)
    if probe is None:
        return ProbeResult(None, "its first module takes neither token ids (nn.Embedding) nor features (nn.Linear)")
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        return _compare_on_probe(model, layout, stages, probe)
    finally:
        for module, training in modes.items():
            module.training = training


def _compare_on_probe(model: nn.Module, layout: BlockLayout, stages: Sequence[Stage], probe: Tensor) -> ProbeResult:
    import torch

    outputs: Dict[int, int] = {}
    try:
        with torch.no_grad(), _counting_outputs(model, layout, outputs):
            expected = _output_tensor(model(probe))
    except Exception as error:  # noqa: BLE001  # a probe the model does not take: nothing is known, said so
        return ProbeResult(None, f"its forward raised on a probe of shape {tuple(probe.shape)}: {error!r}")
    if expected is None:
        return ProbeResult(None, "its forward returns no tensor (nor an output with logits)")
    run, hidden, running = _stage_runner(layout), probe, stages[0].index
    try:
        with torch.no_grad(), _stage_blocks_installed(model, layout, outputs):
            for stage in stages:
                running = stage.index
                hidden = run(model, stage, hidden)
    except Exception as error:  # noqa: BLE001  # the stages cannot run what the forward runs: refused with it
        return ProbeResult(float("inf"), f"stage {running} raised {error!r}", outputs)
    return ProbeResult(_relative_gap(expected, hidden), "", outputs)


def _relative_gap(expected: Tensor, got: Tensor) -> float:
    import torch

    finite = torch.isfinite(expected)
    if expected.shape != got.shape or not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    scale = expected[finite].float().abs().max().clamp_min(1e-6) if finite.any() else expected.new_ones(())
    gap = (expected[finite].float() - got[finite].float()).abs().max() if finite.any() else scale * 0
    return float(gap / scale)


@contextlib.contextmanager
def _counting_outputs(model: nn.Module, layout: BlockLayout, outputs: Dict[int, int]) -> Iterator[None]:
    """Records in ``outputs`` what each block of an HF decoder returns (0: a tensor, else a tuple's length)."""
    if layout.family != HF_DECODER:
        yield
        return

    def count(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            outputs[index] = 0 if isinstance(output, Tensor) else len(output)

        return hook

    handles = [block.register_forward_hook(count(i)) for i, block in enumerate(_block_list(model, layout))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _stage_blocks_installed(model: nn.Module, layout: BlockLayout, outputs: Mapping[int, int]) -> Iterator[None]:
    """An HF decoder's block list as :class:`StageBlocks` (all held) while the stages run; the user's after."""
    if layout.family != HF_DECODER:
        yield
        return
    original = model.get_submodule(layout.block_list)
    _set_submodule(model, layout.block_list, StageBlocks(_block_list(model, layout), outputs))
    try:
        yield
    finally:
        _set_submodule(model, layout.block_list, original)


def _probe_input(model: nn.Module, layout: BlockLayout, device: Any) -> Optional[Tensor]:
    import torch

    generator = torch.Generator().manual_seed(0)
    first = model.get_submodule(layout.first[0] if layout.first else layout.blocks[0])
    if layout.family == HF_DECODER:
        vocab = int(getattr(model.config, "vocab_size"))  # noqa: B009  # an HF model (the layout says)
        return torch.randint(0, vocab, (2, 8), generator=generator).to(device)
    if isinstance(first, nn.Embedding):
        return torch.randint(0, first.num_embeddings, (2, 8), generator=generator).to(device)
    if isinstance(first, nn.Linear):
        dtype = first.weight.dtype
        return torch.randn(2, 8, first.in_features, generator=generator).to(device=device, dtype=dtype)
    return None


def _output_tensor(output: Any) -> Optional[Tensor]:
    """The tensor a forward returns: itself, an HF output's ``logits``, or a tuple's first element."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


def _sequence_stage(model: nn.Module, stage: Stage, inputs: Tensor, **kwargs: Any) -> Tensor:
    """Each module of the stage on the previous one's output, with the keyword inputs its forward takes."""
    hidden = inputs
    for name in stage.modules:
        module = model.get_submodule(name)
        hidden = module(hidden, **_accepted(module, kwargs))
    return hidden


def _accepted(module: nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if not kwargs:
        return {}
    cls: Any = type(module)
    names = _keyword_names(cls)
    return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}


@functools.lru_cache(maxsize=None)
def _keyword_names(cls: Any) -> Any:
    """The keyword names ``cls.forward`` takes (None: any, it takes ``**kwargs``)."""
    parameters = inspect.signature(cls.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters)
