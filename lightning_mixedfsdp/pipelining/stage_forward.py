"""A model cut down to this rank's pipeline stages, with the forward each stage runs.

The model object stays the user's (its class, its config, its methods): the modules of other ranks' stages are
removed, the block list becomes a ``ModuleDict`` keyed by each block's original index, so ``named_parameters()``
yields this rank's params under the names they had (``model.layers.5.mlp.up_proj.weight``); its ``forward`` becomes
the stages', chosen by the ``pipeline_stage`` keyword (several stages per rank share one module and one FSDP root).
"""

import functools
import inspect
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

from torch import Tensor, nn

from lightning_mixedfsdp.compat.transformers import causal_lm_output, decoder_attention_masks, decoder_layer_type
from lightning_mixedfsdp.planning.stages import HF_DECODER, BlockLayout, Stage


def cut_to_stages(model: nn.Module, layout: BlockLayout, stages: Sequence[Stage]) -> None:
    """Remove from ``model`` every module none of ``stages`` holds, and install their forward."""
    held = {name for stage in stages for name in stage.modules}
    kept = nn.ModuleDict({name.rsplit(".", 1)[-1]: model.get_submodule(name) for name in layout.blocks if name in held})
    _set_submodule(model, layout.block_list, kept)
    for name in layout.first + layout.last:
        if name not in held:
            _set_submodule(model, name, None)
    by_index = {stage.index: stage for stage in stages}
    run = _hf_decoder_stage if layout.family == HF_DECODER else _sequence_stage
    model.forward = functools.partial(_stage_forward, model, by_index, run)


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


def _hf_decoder_stage(model: Any, stage: Stage, inputs: Tensor, **kwargs: Any) -> Tensor:
    """A Llama-family decoder's forward for one stage, as its own forward runs with ``use_cache=False`` (training):
    the embedding (first stage), the rotary embeddings, position ids and causal masks rebuilt from the micro-batch
    (position ids that restart mid-row mark packed documents, and attention stays within each), the stage's layers,
    the final norm and the head (last stage)."""
    import torch

    decoder = model.model
    hidden = decoder.embed_tokens(inputs) if stage.first else inputs
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    masks = decoder_attention_masks(decoder, hidden, kwargs.get("attention_mask"), position_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids)
    for name in stage.blocks:
        index = int(name.rsplit(".", 1)[-1])
        hidden = _block(decoder.layers, index)(
            hidden,
            attention_mask=masks[decoder_layer_type(decoder, index)],
            position_embeddings=position_embeddings,
            position_ids=position_ids,
        )
    if stage.last:
        hidden = model.lm_head(decoder.norm(hidden))
    return hidden


def _block(blocks: nn.Module, index: int) -> nn.Module:
    """Block ``index`` of the block list: a ``ModuleDict`` keyed by original index once cut, a ``ModuleList`` before."""
    return blocks[str(index)] if isinstance(blocks, nn.ModuleDict) else blocks[index]  # type: ignore[index]


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
    in where they are not finite); None where no probe ran."""
    reason: str
    """Why no probe ran (empty where one did)."""


def composed_stage_gap(model: nn.Module, layout: BlockLayout, stages: Sequence[Stage]) -> ProbeResult:
    """Run a probe through ``model``'s own forward and through every stage's forward in order (the model still whole,
    in eval mode, no grad; every module's mode restored after), and compare."""
    import torch

    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return ProbeResult(None, "its params are on the meta device")
    if sum(p.numel() for p in params) > PROBE_ELEMENTS:
        return ProbeResult(None, f"it has more than {PROBE_ELEMENTS:.0e} parameter elements")
    probe = _probe_input(model, layout, params[0].device)
    if probe is None:
        return ProbeResult(None, "its first module takes neither token ids (nn.Embedding) nor features (nn.Linear)")
    run = _hf_decoder_stage if layout.family == HF_DECODER else _sequence_stage
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            expected = _output_tensor(model(probe))
            hidden = probe
            for stage in stages:
                hidden = run(model, stage, hidden)
    except Exception as error:  # noqa: BLE001  # a probe the model does not take: nothing is known, said so
        return ProbeResult(None, f"its forward raised on a probe of shape {tuple(probe.shape)}: {error!r}")
    finally:
        for module, training in modes.items():
            module.training = training
    if expected is None:
        return ProbeResult(None, "its forward returns no tensor (nor an output with logits)")
    finite = torch.isfinite(expected)
    if expected.shape != hidden.shape or not torch.equal(finite, torch.isfinite(hidden)):
        return ProbeResult(float("inf"), "")
    scale = expected[finite].float().abs().max().clamp_min(1e-6) if finite.any() else expected.new_ones(())
    gap = (expected[finite].float() - hidden[finite].float()).abs().max() if finite.any() else scale * 0
    return ProbeResult(float(gap / scale), "")


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
