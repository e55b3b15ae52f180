"""Every transformers API the library uses beyond its public model classes (expert parallelism, checkpoint key
renames, decoding with a cache), each behind one small function.

Checked on transformers 5.23, 5.24 and 5.25 (``transformers/distributed/expert_parallel.py``, ``parallel_utils.py``,
``mixin.py``, ``conversion_mapping.py``, ``core_model_loading.py``). transformers is optional: these import it only
when called.
"""

import contextlib
import functools
import re
from typing import Any, Callable, Dict, Iterator, Optional

from torch import nn

from lightning_mixedfsdp.compat.versions import gone

EXPERTS_STYLE = "ep_dispatch_experts"
"""The EP style of a module whose experts are reached by all-to-all (5.23); its params carry ``grouped_gemm``."""
SPLIT_STYLE = "grouped_gemm"
"""The EP style of a fused expert param: ``Shard(0)`` over the EP ranks."""


def model_ep_plan(module: nn.Module) -> Optional[Dict[str, str]]:
    """The wildcard EP plan an HF ``PreTrainedModel`` declares (``PreTrainedModel.ep_plan``:
    ``config.base_model_ep_plan`` prefixed with the base model's name, e.g.
    ``{"model.layers.*.mlp.experts": "ep_dispatch_experts", ...}``); None when it declares none. Ask it of
    ``PreTrainedModel``s only: a peft wrapper forwards ``ep_plan`` to the model inside, whose names it is relative
    to."""
    plan = getattr(module, "ep_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan else None


def wildcard_name(name: str) -> str:
    """``layers.3.mlp.experts`` -> ``layers.*.mlp.experts``, as transformers matches plan keys
    (``parallel_utils.replace_layer_number_by_wildcard``, copied: three lines, and it keeps the planner importable
    without transformers)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def apply_expert_parallelism(model: nn.Module, plan: Dict[str, str], ep_mesh: Any, tp_mesh: Any) -> None:
    """transformers' own EP: ``grouped_gemm`` params become ``Shard(0)`` DTensors on ``ep_mesh`` (each rank keeps
    ``num_experts / E`` experts), ``ep_dispatch_experts`` modules get a forward that all-to-alls the tokens to the
    ranks holding their experts and back (``AllToAllEP``). ``plan`` is concrete (no wildcards), params before their
    module, names relative to ``model``."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism as apply

    apply(model, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")


def all_to_all_module() -> Any:
    """The module whose ``all_to_all_single`` (split sizes) and ``all_to_all_single_autograd`` (tokens) the
    all-to-all EP calls at call time: patch them there to count."""
    import transformers.distributed.expert_parallel as module

    return module


def _meta_shell(model_class: type, config: Any) -> Optional[Any]:
    """``model_class`` built from ``config`` on the meta device (None for a class that is not a ``PreTrainedModel``):
    what transformers' conversion mappings are asked of, since it skips them for a class it takes for custom code,
    as it takes FSDP's dynamic ``FSDP<Name>`` subclass."""
    import torch
    from transformers import PreTrainedModel

    if not issubclass(model_class, PreTrainedModel):
        return None
    with torch.device("meta"):
        return model_class._from_config(config)


def checkpoint_key_renames(model_class: type, config: Any) -> Optional[Callable[[str], str]]:
    """The renames ``from_pretrained`` applies to checkpoint keys for a ``model_class`` of ``config`` (None when there
    are none): a folder saved in a legacy layout, as transformers 5 still saves Llava (``language_model.model.*``),
    loads into the model's own names (``model.language_model.*``). Only renames: a key the model's conversions would
    also convert (fused experts) keeps its name, and a load that needs it says which keys are missing.

    The renames are read off a shell of the model built on the meta device: transformers skips its mappings for a
    class it takes for custom code, as it takes FSDP's dynamic ``FSDP<Name>`` subclass. Internal
    ``conversion_mapping.get_model_conversion_mapping`` and ``core_model_loading.rename_source_key`` (transformers
    5.23 to 5.25; gone: :class:`~lightning_mixedfsdp.compat.versions.UnsupportedVersion`)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError as err:
        raise gone("transformers", "conversion_mapping.get_model_conversion_mapping (and core_model_loading)") from err
    shell = _meta_shell(model_class, config)
    if shell is None:
        return None
    renamings = [t for t in get_model_conversion_mapping(shell) if isinstance(t, WeightRenaming)]
    if not renamings:
        return None
    meta = dict.fromkeys(shell.state_dict())
    prefix = shell.base_model_prefix
    return lambda key: str(rename_source_key(key, renamings, [], prefix, meta)[0])


def checkpoint_tensors(model_class: type, config: Any) -> Optional[Callable[[str, Any], Dict[str, Any]]]:
    """What ``save_pretrained`` writes for one of ``model_class``'s tensors, as a function ``(name, tensor) -> {name:
    tensor}`` (None where the class converts nothing): transformers 5 holds some weights fused (an MoE's
    ``mlp.experts.gate_up_proj``) that checkpoints, and the serving engines' loaders (vLLM's, SGLang's
    ``load_weights``), keep per expert (``mlp.experts.0.gate_proj.weight``, ...). Each conversion is reversed on its
    own tensor (an MoE conversion fuses per-expert tensors into one, so its reverse takes one; a class whose conversion
    splits one checkpoint tensor into several of its own, HRM's ``gqkv_proj``, raises ``NotImplementedError``), on a
    shell of the class built on the meta device (FSDP's dynamic subclass would be taken for custom code). Internal
    ``core_model_loading.revert_weight_conversion`` and ``conversion_mapping.get_model_conversion_mapping`` (5.23 to
    5.25, checked against ``save_pretrained``'s keys and values)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, revert_weight_conversion
    except ImportError as err:
        raise gone("transformers", "core_model_loading.revert_weight_conversion") from err
    shell = _meta_shell(model_class, config)
    if shell is None:
        return None
    conversions = get_model_conversion_mapping(shell, add_legacy=False)
    if not conversions:
        return None
    joined = [c for c in conversions if isinstance(c, WeightConverter) and len(c.target_patterns) > 1]
    if joined:  # several model tensors make one checkpoint tensor: reversing them needs them together
        targets, sources = (
            ", ".join(map(str, joined[0].target_patterns)),
            ", ".join(map(str, joined[0].source_patterns)),
        )
        raise NotImplementedError(
            f"stream_weights: {model_class.__name__} splits checkpoint tensors into several of its own ({targets}"
            f" from {sources}), and the stream reverses one tensor at a time; pass checkpoint_names=False for the"
            " model's own names (and map them in the engine), or export with strategy.export_safetensors"
        )
    return lambda name, tensor: dict(revert_weight_conversion(shell, {name: tensor}))


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``config.layer_types`` values whose cache holds attention keys and values only. Every other value (5.23 to 5.25:
``linear_attention`` for Mamba, Mamba-2, Jamba, Qwen3-Next; ``hybrid`` for Falcon-H1; and any type a later release
adds) marks a layer with a recurrent state."""
STATEFUL_WITHOUT_LAYER_TYPES = frozenset({"rwkv", "xlstm"})
"""Recurrent models whose config has no ``layer_types`` (transformers 5.23-5.24 marked them ``_is_stateful``)."""


def decodes_with_cache(model: nn.Module) -> bool:
    """Whether rollouts may decode ``model`` one token at a time with its own cache: a model whose cache holds
    attention keys and values only. A stateful model (Mamba, Mamba-2, and the hybrids Jamba, Falcon-H1, Qwen3-Next,
    ...) carries recurrent states whose decoding step needs inputs of the model's own (5.24's Mamba-1 decodes another
    distribution when the step is given the attention mask: mismatch 0.53 on a random init, Mamba-2 1e-7). Such a
    model decodes without a cache instead: each step runs the whole sequence, the forward the trainer runs.

    Read off the public ``config.layer_types`` (the decoder's, for an image-text model), which transformers'
    ``DynamicCache(config=...)`` builds its cache layers from: every type must be an attention type
    (:data:`ATTENTION_LAYER_TYPES`); a config without ``layer_types`` is all full attention (Llama), unless its model
    type is a recurrent one that has none (:data:`STATEFUL_WITHOUT_LAYER_TYPES`); and the model's ``forward`` must
    name the cache argument (:func:`cache_keyword`; RWKV's takes a ``state`` instead). Checked on 5.23, 5.24 and 5.25
    against the private ``_is_stateful`` those versions (but 5.25) set. An unknown type decodes without a cache:
    slower, never another distribution. Asked of a peft wrapper's base model."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    config = getattr(inner, "config", None)
    if config is None:
        return True
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text_config, "model_type", None) in STATEFUL_WITHOUT_LAYER_TYPES:
        return False
    types = getattr(text_config, "layer_types", None) or ()
    if not all(layer_type in ATTENTION_LAYER_TYPES for layer_type in types):
        return False
    return cache_keyword() in inspect.signature(type(inner).forward).parameters


@functools.lru_cache(maxsize=None)
def cache_keyword() -> str:
    """The name of the decoding cache, in a causal LM's arguments and in its output: ``cache`` from transformers 5.24
    on, ``past_key_values`` before (5.23). Read off ``CausalLMOutputWithPast``'s fields, not the version; once per
    process (every decoding step asks)."""
    from dataclasses import fields

    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in fields(CausalLMOutputWithPast)}
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    raise gone("transformers", "CausalLMOutputWithPast.cache (5.24+) or .past_key_values (5.23)")


def cached_step(model: nn.Module, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any) -> Any:
    """One decoding step of an HF causal LM with its KV cache (None at the first, the prompt's): the logits of the
    tokens fed, and the cache for the next step, under either version's name (:func:`cache_keyword`)."""
    name = cache_keyword()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, name: cache}
    out = model(**inputs, use_cache=True)
    return out.logits, getattr(out, name)


INPUT_EMBEDDING_SCALES = ("embedding_multiplier", "embed_scale", "embedding_scale")
"""Decoder attributes by which an HF decoder's forward multiplies ``inputs_embeds`` whether or not it embedded the
tokens itself (Granite and its MoE and hybrid kin: ``inputs_embeds = inputs_embeds * self.embedding_multiplier``;
checked on 5.23, 5.24 and 5.25). A pipeline stage after the first passes the previous stage's hidden states as
``inputs_embeds``, which must not be scaled again."""


@contextlib.contextmanager
def hidden_states_as_inputs_embeds(decoder: nn.Module) -> Iterator[None]:
    """While a stage after the first runs ``decoder`` on hidden states: each numeric
    :data:`INPUT_EMBEDDING_SCALES` attribute is 1 (restored after). The setup's probe checks the stages, run in
    order, against the uncut forward, so a scale under another name is refused, not applied twice."""
    saved = {}
    for name in INPUT_EMBEDDING_SCALES:
        value = decoder.__dict__.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            saved[name] = value
            setattr(decoder, name, 1.0)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(decoder, name, value)


def causal_lm_output(logits: Any) -> Any:
    """An HF causal LM's output object around ``logits``, as the model's own forward returns it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits)
