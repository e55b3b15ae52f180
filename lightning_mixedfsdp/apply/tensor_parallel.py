"""Tensor parallelism from a Hugging Face model's own plan: ``config.base_model_tp_plan`` (what transformers'
``tp_plan="auto"`` applies), mapped to torch's ``parallelize_module`` styles, for a run that asks for
``tensor_parallel_size > 1`` without a ``parallelize_fn``. A model without a plan, a plan style this mapping does not
know, or sizes the split cannot divide are refused before any collective, naming the fix; without this, TP ranks
would silently compute the same whole projections twice."""

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from torch import nn

from lightning_mixedfsdp.model.names import canonical_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

TENSOR_PARALLEL_DIM = "tensor_parallel"
SUPPORTED_STYLES = ("colwise", "rowwise")
"""HF's plan styles applied here: ``colwise`` splits a Linear's output features (its output stays local, the heads
or hidden units this rank owns), ``rowwise`` its input features (its output all-reduced). Every decoder plan of
Llama, Qwen2, Mistral and Granite is these two."""
DIVIDED_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
"""The config sizes each rank takes a whole share of: heads (q, k, v split by head) and the MLP's hidden units."""


@dataclass(frozen=True)
class ModelPlan:
    """An HF model's tensor-parallel plan, where it applies."""

    base: str
    """The canonical name of the module the plan's names start from (the HF model's base model: ``model`` in a
    causal LM), "" for the top."""
    styles: Dict[str, str]
    """Module name pattern (``*``: a layer index) -> style."""
    config: Any
    """The config the plan came from (its head and hidden sizes)."""


def hf_tensor_parallel_plan(model: nn.Module) -> Optional[ModelPlan]:
    """The plan of the first HF model in ``model`` (itself, or one a LightningModule or PEFT wraps) whose config
    carries one; None when there is none (an image-text model's config keeps it on its text config: not applied)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        styles = getattr(config, "base_model_tp_plan", None)
        prefix = getattr(module, "base_model_prefix", None)
        if styles and isinstance(prefix, str):
            base = ".".join(part for part in (name, prefix if hasattr(module, prefix) else "") if part)
            return ModelPlan(canonical_name(base), dict(styles), config)
    return None


def tensor_parallel_problems(
    model: nn.Module, size: int, split_in: str = "parallelize_fn", float8: bool = False
) -> List[str]:
    """Why ``model`` cannot be split ``size`` ways by its own plan (empty: it can); ``split_in``: where the user
    would split it instead (``parallelize_fn``, or the Trainer's ``configure_model``); ``float8``: float8 training is
    on."""
    if float8:
        return [
            f"tensor_parallel_size={size} with float8: the model's own plan splits with torch's"
            f" Colwise/RowwiseParallel, not torchao's float8 styles. Split it in `{split_in}` with torchao's"
            " Float8ColwiseParallel and Float8RowwiseParallel, or turn float8 off."
        ]
    plan = hf_tensor_parallel_plan(model)
    if plan is None:
        return [
            f"tensor_parallel_size={size} without a split in `{split_in}`: this model carries no tensor-parallel plan"
            f" (a Hugging Face model's `config.base_model_tp_plan`), so every tensor-parallel rank would compute the"
            f" same whole layers. Split it in `{split_in}` (torch's `parallelize_module` on the mesh's"
            " 'tensor_parallel' dim), or set tensor_parallel_size=1."
        ]
    problems = []
    unknown = sorted({style for style in plan.styles.values() if style not in SUPPORTED_STYLES})
    if unknown:
        problems.append(
            f"tensor_parallel_size={size}: the model's tensor-parallel plan uses the styles {unknown}, which"
            f" mixed_fsdp2 does not apply yet (it applies {list(SUPPORTED_STYLES)}). Pass a `parallelize_fn` that"
            " splits this model, or set tensor_parallel_size=1."
        )
    for field in DIVIDED_SIZES:
        value = getattr(plan.config, field, None)
        if isinstance(value, int) and value % size:
            problems.append(
                f"tensor_parallel_size={size} does not divide the model's {field}={value}: each rank takes a whole"
                f" share; use a tensor_parallel_size that divides {value}."
            )
    matching = _matching(model, plan)
    if not matching:
        problems.append(
            f"tensor_parallel_size={size}: no module of the model matches its tensor-parallel plan"
            f" {sorted(plan.styles)[:3]}; pass a `parallelize_fn` that splits this model."
        )
    others = sorted(
        {f"{name} ({type(module).__name__})" for name, _, module in matching if type(module) is not nn.Linear}
    )
    if others:
        problems.append(
            f"tensor_parallel_size={size}: the planned layers {others[:3]} are not plain `nn.Linear` (e.g. LoRA"
            " adapters around them), which the model's plan splits; pass a `parallelize_fn` that splits them, or set"
            " tensor_parallel_size=1."
        )
    return problems


def describe_split(model: nn.Module, size: int) -> str:
    """The split the model's plan makes, in a line (the dtype report's companion)."""
    plan = hf_tensor_parallel_plan(model)
    assert plan is not None
    matching = _matching(model, plan)
    counts = {style: sum(1 for _, s, _ in matching if s == style) for style in SUPPORTED_STYLES}
    split = ", ".join(f"{count} {style} (`{style.capitalize()}Parallel`)" for style, count in counts.items() if count)
    return f"tensor parallel {size} by the model's `base_model_tp_plan`: {split}; every other param whole on each"


def keep_tensor_parallel_share(model: nn.Module, size: int) -> None:
    """Shrink, in place, each Linear the model's plan splits to what one of ``size`` TP ranks holds (colwise: its
    share of the output features, bias included; rowwise: of the input features, the bias whole), so a planner
    counts one rank's bytes. For the dry run's meta-device models only: nothing is allocated."""
    import torch

    plan = hf_tensor_parallel_plan(model)
    assert plan is not None  # refused before by tensor_parallel_problems
    for _, style, module in _matching(model, plan):
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                raise ValueError(f"keep_tensor_parallel_share: {name} is on {param.device}; pass a meta model.")
            dim = 0 if style == "colwise" else 1 if name == "weight" else None
            if dim is None:  # a rowwise layer's bias is added after the all-reduce, whole on each rank
                continue
            shape = list(param.shape)
            shape[dim] //= size
            share = torch.empty(shape, dtype=param.dtype, device="meta")
            setattr(module, name, nn.Parameter(share, requires_grad=param.requires_grad))


def apply_hf_tensor_parallel(model: nn.Module, mesh: "DeviceMesh") -> nn.Module:
    """Split ``model``'s planned Linear layers over ``mesh``'s tensor-parallel dim, in place; names stay."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = hf_tensor_parallel_plan(model)
    assert plan is not None  # refused before by tensor_parallel_problems
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layers = {name: styles[style]() for name, style, _ in _matching(model, plan)}
    parallelize_module(model, mesh[TENSOR_PARALLEL_DIM], layers)
    return model


def _matching(model: nn.Module, plan: ModelPlan) -> List[Tuple[str, str, nn.Module]]:
    """Every module of ``model`` (its name as it is, wrappers included) whose canonical name is a planned pattern
    under the plan's base, with that pattern's style; the outermost module of each canonical name."""
    patterns = [(_pattern(plan.base, key), style) for key, style in plan.styles.items()]
    found, seen = [], set()
    for name, module in model.named_modules():
        canonical = canonical_name(name)
        if canonical in seen:
            continue
        for pattern, style in patterns:
            if pattern.match(canonical):
                found.append((name, style, module))
                seen.add(canonical)
                break
    return found


def _pattern(base: str, key: str) -> "re.Pattern[str]":
    """A plan key (``layers.*.self_attn.q_proj``) as a whole canonical name under ``base``, ``*`` a layer index."""
    under = re.escape(base) + r"\." if base else ""
    return re.compile("^" + under + re.escape(key).replace(r"\*", r"\d+") + "$")
