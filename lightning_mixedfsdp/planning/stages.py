"""Pipeline stages, planned (pure: model + sizes -> stages): where a model's repeated blocks are, and which of its
modules each stage holds.

A model is split when its parts are known (:func:`block_layout`):
- an HF causal LM whose decoder (``model.model``) holds ``embed_tokens``, a ``layers`` ``ModuleList`` and one more
  module with params (its final norm), beside ``lm_head``: each stage runs the model's own forward with the other
  stages' layers passed over (``pipelining/stage_forward.py``), checked at setup against the uncut forward on a probe;
- a model that names its block list in a class attribute ``pipeline_blocks = "layers"`` (this project's own), or any
  model given ``pipeline_split``: the modules registered before the block list run first, then the blocks, then the
  modules after it, each on the previous one's output (keyword inputs its ``forward`` takes passed along).

By default the stages are balanced: every stage holds ``blocks // stages`` blocks, and the remainder goes to the
middle stages first, since the first also holds the embedding and the last the final norm and the head (each about
one block's work). Stage ``s``
runs on pipeline rank ``s % pipeline_parallel_size`` (torch's loop order for several stages per rank).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, cast

from torch import nn

from lightning_mixedfsdp.model.names import is_hf_model, user_class_name

HF_DECODER, SEQUENCE = "hf_decoder", "sequence"

CHECKED_DECODERS = frozenset(
    {"llama", "qwen2", "qwen3", "olmo2", "mistral", "granite", "gemma3_text", "qwen3_moe", "deepseek_v3", "jamba"}
)
"""HF ``model_type`` values whose stages, run in order, the suite checks to the bit against the model's own forward
(``tests/pipelining/test_stage_plans.py``): where setup cannot probe (params on the meta device), these split without
a warning."""


@dataclass(frozen=True)
class BlockLayout:
    """Where a model's parts are: what runs before its blocks, the blocks, what runs after."""

    family: str
    """``"hf_decoder"`` (an HF causal LM's decoder) or ``"sequence"`` (each part on the previous part's output)."""
    first: Tuple[str, ...]
    """Modules before the blocks (the embedding), on the first stage."""
    blocks: Tuple[str, ...]
    """The repeated blocks' names, in order (``model.layers.0``, ...)."""
    last: Tuple[str, ...]
    """Modules after the blocks (the final norm, the head), on the last stage."""
    block_list: str
    """The block list's name (``model.layers``)."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the modules it holds."""

    index: int
    first: Tuple[str, ...]
    blocks: Tuple[str, ...]
    last: Tuple[str, ...]

    @property
    def modules(self) -> Tuple[str, ...]:
        return self.first + self.blocks + self.last

    def describe(self) -> str:
        """``embed_tokens + layers 0-3`` style."""
        parts = [name.rsplit(".", 1)[-1] for name in self.first]
        if self.blocks:
            numbers = [name.rsplit(".", 1)[-1] for name in self.blocks]
            parts.append(f"blocks {numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else f"block {numbers[0]}")
        parts += [name.rsplit(".", 1)[-1] for name in self.last]
        return " + ".join(parts)


def block_layout(model: nn.Module, split: Optional[Sequence[str]] = None) -> Optional[BlockLayout]:
    """``model``'s layout, or None when it cannot be split (the caller refuses it by name)."""
    if is_hf_model(model):
        decoder = _hf_decoder_layout(model)
        if decoder is not None:
            return decoder
    declared = getattr(type(model), "pipeline_blocks", None)
    list_name = declared if isinstance(declared, str) else _parent(split[0]) if split else None
    if list_name is None:
        return None
    return _sequence_layout(model, list_name)


def _hf_decoder_layout(model: nn.Module) -> Optional[BlockLayout]:
    """An HF causal LM's layout: ``model.embed_tokens`` first, ``model.layers`` the blocks, the decoder's one other
    child with params (its final norm, whatever its name) and ``lm_head`` last; None where the parts differ."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, nn.Module) or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    if not hasattr(decoder, "embed_tokens") or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return None
    others = [
        name
        for name, child in decoder.named_children()
        if name not in ("embed_tokens", "layers") and any(True for _ in child.parameters())
    ]
    if len(others) != 1:
        return None
    blocks = tuple(f"model.layers.{i}" for i in range(len(cast(nn.ModuleList, decoder.layers))))
    return BlockLayout(HF_DECODER, ("model.embed_tokens",), blocks, (f"model.{others[0]}", "lm_head"), "model.layers")


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _sequence_layout(model: nn.Module, list_name: str) -> Optional[BlockLayout]:
    """The top-level children before and after the (top-level) block list ``list_name``."""
    children = [name for name, _ in model.named_children()]
    block_list = getattr(model, list_name, None) if "." not in list_name else None
    if not isinstance(block_list, nn.ModuleList) or list_name not in children:
        return None
    at = children.index(list_name)
    blocks = tuple(f"{list_name}.{i}" for i in range(len(block_list)))
    return BlockLayout(SEQUENCE, tuple(children[:at]), blocks, tuple(children[at + 1 :]), list_name)


def tied_to_head(model: nn.Module, layout: BlockLayout) -> List[Tuple[str, str]]:
    """Params shared between a module of the last part and one of the first (tied embeddings): ``(name in the
    last part, name in the first)`` pairs (``("lm_head.weight", "model.embed_tokens.weight")``)."""
    first = {id(p): name for m in layout.first for name, p in model.get_submodule(m).named_parameters(prefix=m)}
    tied = []
    for m in layout.last:
        for name, param in model.get_submodule(m).named_parameters(prefix=m, remove_duplicate=False):
            if id(param) in first:
                tied.append((name, first[id(param)]))
    return tied


def shared_across_stages(model: nn.Module, stages: Sequence[Stage], tied: Sequence[str] = ()) -> List[str]:
    """Every Parameter (by identity, across the whole model) that more than one stage would hold, or that no stage
    holds (a param of a module outside the stages, which every rank would keep and none would train), each as the
    places it is found; ``tied``: names of params the first and the last stage share on purpose (kept equal by the
    embedding group, ``pipelining/tied.py``)."""
    places: Dict[int, List[Tuple[int, str]]] = {}
    for stage in stages:
        for module in stage.modules:
            for name, param in model.get_submodule(module).named_parameters(prefix=module, remove_duplicate=False):
                places.setdefault(id(param), []).append((stage.index, name))
    found = []
    exempt = {id(model.get_parameter(name)) for name in tied}
    for key, stage_names in places.items():
        if key in exempt:
            continue
        by_stage: Dict[int, str] = {}
        for index, name in stage_names:
            by_stage.setdefault(index, name)
        if len(by_stage) > 1:
            (a, first), (b, second) = sorted(by_stage.items())[:2]
            found.append(f"{second} (stage {b}) is {first} (stage {a})")
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in places:
            found.append(f"{name} is held by no stage")
    return found


def plan_stages(
    model: nn.Module, num_stages: int, split: Optional[Sequence[str]] = None
) -> Tuple[Optional[List[Stage]], List[str]]:
    """The stages of ``model``, or None and every problem (each with its fix)."""
    layout = block_layout(model, split)
    name = user_class_name(model)
    if layout is None:
        if split:
            reason = f"pipeline_split={list(split)} does not name blocks of a top-level ModuleList"
            return None, [f"{reason}; give names like 'layers.4' of the model's block list."]
        return None, [
            f"{name} cannot be split into pipeline stages automatically: HF causal LMs whose decoder holds"
            " `embed_tokens`, a `layers` ModuleList and one final norm, and models that declare"
            " `pipeline_blocks = \"layers\"`, are; give pipeline_split=['layers.4', ...] (the blocks that begin"
            " each stage after the first) for a model whose forward runs the modules before its block list, the"
            " blocks, and the modules after, in order."
        ]
    problems = _router_loss_problems(model, name) if layout.family == HF_DECODER else []
    tied = [first for _, first in tied_to_head(model, layout)]
    if split:
        stages, split_problems = _stages_at(layout, num_stages, split)
    else:
        stages, split_problems = _balanced(layout, num_stages, name)
    problems += split_problems
    shared = [] if split_problems else shared_across_stages(model, stages, tied)
    if shared:
        problems.append(
            f"{name} uses a Parameter on more than one pipeline stage ({'; '.join(shared[:4])}): each stage's rank"
            " would hold a copy that trains apart (or none would train it); move the stage boundary with"
            " pipeline_split so each shared Parameter is used within one stage, give each place its own Parameter,"
            " or set pipeline_parallel_size=1."
        )
    return (None if problems else stages), problems


def _router_loss_problems(model: nn.Module, name: str) -> List[str]:
    """An MoE decoder asked for its routers' load-balancing loss: the model adds it up over every layer in its own
    forward, and each stage holds a part of them (the loss the last stage returned would hold its own layers' only)."""
    if not getattr(getattr(model, "config", None), "output_router_logits", False):
        return []
    return [
        f"{name} has output_router_logits=True: its forward sums the routers' load-balancing loss over every layer,"
        " and under pipeline stages each stage holds only its own layers, so the loss would miss the others' part;"
        " set config.output_router_logits=False (and, for a load-balancing term, add one computed in each stage's"
        " layers) or set pipeline_parallel_size=1."
    ]


def _balanced(layout: BlockLayout, num_stages: int, name: str) -> Tuple[List[Stage], List[str]]:
    blocks = len(layout.blocks)
    if num_stages > blocks:
        return [], [
            f"{num_stages} pipeline stages (pipeline_parallel_size x pipeline_stages_per_rank) exceed {name}'s"
            f" {blocks} blocks; use at most {blocks} stages."
        ]
    # every stage gets blocks // stages; the rest go to the middle stages first (the first and the last carry the
    # embedding's and the head's unit), then to the earlier ones
    sizes = [blocks // num_stages] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for stage in order[: blocks % num_stages]:
        sizes[stage] += 1
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [_stage(layout, s, starts[s], starts[s] + sizes[s], num_stages) for s in range(num_stages)], []


def _stages_at(layout: BlockLayout, num_stages: int, split: Sequence[str]) -> Tuple[List[Stage], List[str]]:
    if len(split) != num_stages - 1:
        return [], [
            f"pipeline_split={list(split)} gives {len(split) + 1} stages and pipeline_parallel_size x"
            f" pipeline_stages_per_rank is {num_stages}; give {num_stages - 1} names."
        ]
    unknown = [s for s in split if s not in layout.blocks]
    if unknown:
        return [], [f"pipeline_split names {unknown}, which are not blocks; use names like {layout.blocks[1]!r}."]
    starts = [0] + [layout.blocks.index(s) for s in split]
    ends = starts[1:] + [len(layout.blocks)]
    empty = [s for s in range(num_stages) if ends[s] <= starts[s]]
    if empty:
        return [], [
            f"pipeline_split={list(split)} leaves stage {empty[0]} without a block; give the names in increasing"
            " order, each once."
        ]
    return [_stage(layout, s, starts[s], ends[s], num_stages) for s in range(num_stages)], []


def _stage(layout: BlockLayout, index: int, start: int, stop: int, num_stages: int) -> Stage:
    first = layout.first if index == 0 else ()
    last = layout.last if index == num_stages - 1 else ()
    return Stage(index, first, layout.blocks[start:stop], last)


def stages_of_rank(pipeline_rank: int, pipeline_size: int, stages_per_rank: int) -> List[int]:
    """The stage indices ``pipeline_rank`` holds: ``rank, rank + size, ...`` (torch's loop order)."""
    return [pipeline_rank + k * pipeline_size for k in range(stages_per_rank)]


def stage_of_params(model: nn.Module, stages: Sequence[Stage]) -> Dict[str, int]:
    """Each param of ``model`` (uncut) by name, with the stage that holds it."""
    found: Dict[str, int] = {}
    for stage in stages:
        for module in stage.modules:
            for name, _ in model.get_submodule(module).named_parameters(prefix=module):
                found[name] = stage.index
    return found
