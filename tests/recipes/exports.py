"""What every export of the runner must show a user's loader: ``config.json`` states the dtype its bulk is stored in
(each sub-config too), ``from_pretrained(folder, dtype="auto")`` builds the bulk in it, and that model's logits are
the stored weights' within bf16's distance, with the same greedy tokens."""

import contextlib
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

RTOL, ATOL = 1.6e-2, 1e-2
"""bf16's distance: two roundings of bf16 (eps 2**-8 = 3.9e-3 relative) in values of order 1."""

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SUB_CONFIGS = ("text_config", "vision_config")


def assert_the_export_states_its_dtype(
    export: Path,
    dtype: torch.dtype,
    inputs: Optional[Dict[str, torch.Tensor]] = None,
    auto_class: Any = None,
    trust_remote_code: bool = False,
) -> None:
    """``export``'s config says ``dtype``, as do its sub-configs; loaded with ``dtype="auto"`` most of its params are
    ``dtype``; its logits on ``inputs`` (default: 24 token ids) equal the trained model's within rtol 1.6e-2 / atol
    1e-2, with the same greedy tokens where the trained model's top two are further apart than that. The trained
    model: a causal LM as ``load_export`` builds it (each tensor in the dtype the export holds it in, fp32 norms
    computing in fp32); another ``auto_class`` (an image-text model) from the same files in fp32.

    A MoE is compared where both models route alike: ``dtype="auto"`` rounds the export's fp32 tensors (norms,
    ``A_log``) to bf16 where the model class does not keep them fp32, which moves a router logit by a bf16 ulp; at a
    tie that picks another expert, and every later position (causal mixing) differs by far more than rounding. So
    the logits are compared at the positions before the first token any router sends elsewhere, and that first
    difference must be a tie: the experts swapped there within bf16's distance in the reference's router logits."""
    from transformers import AutoModelForCausalLM

    config = json.loads((export / "config.json").read_text())
    assert config["dtype"] == DTYPE_NAMES[dtype], (export, config["dtype"])
    for name in SUB_CONFIGS:
        if isinstance(config.get(name), dict):
            assert config[name]["dtype"] == DTYPE_NAMES[dtype], (export, name, config[name].get("dtype"))
    auto_class = auto_class or AutoModelForCausalLM
    built = auto_class.from_pretrained(export, dtype="auto", trust_remote_code=trust_remote_code).eval()
    elements: Dict[torch.dtype, int] = {}
    for param in built.parameters():
        elements[param.dtype] = elements.get(param.dtype, 0) + param.numel()
    assert max(elements, key=lambda d: elements[d]) == dtype, elements
    if auto_class is AutoModelForCausalLM:  # the trained model: each tensor in the dtype it was trained in
        from lightning_mixedfsdp.recipes.run.hf_export import load_export

        exact = load_export(export, dtype, trust_remote_code=trust_remote_code)
    else:  # (load_export builds causal LMs only) the stored weights in fp32
        exact = auto_class.from_pretrained(export, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    if inputs is None:
        vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        inputs = {"input_ids": torch.arange(24).remainder(min(vocab, 256))[None]}
    with _routes(built) as built_routes, _routes(exact) as exact_routes, torch.no_grad():
        stored = built(**inputs).logits.float()
        reference = exact(**inputs).logits.float()
    agreed = _first_rerouted_position(built_routes, exact_routes, reference.shape[:2])
    stored, reference = stored[:, :agreed], reference[:, :agreed]
    torch.testing.assert_close(stored, reference, rtol=RTOL, atol=ATOL)
    # the same greedy token wherever the exact weights' top two logits are further apart than the rounding
    top = reference.topk(2, dim=-1).values
    clear = (top[..., 0] - top[..., 1]) > 2 * (ATOL + RTOL * top[..., 0].abs())
    assert torch.equal(stored.argmax(-1)[clear], reference.argmax(-1)[clear])


Route = Tuple[torch.Tensor, torch.Tensor]
"""One router call: its logits (tokens x experts) and the experts it chose (tokens x k)."""


@contextlib.contextmanager
def _routes(model: nn.Module) -> Iterator[List[Route]]:
    """Every MoE router call of ``model``'s forwards in order, as HF's routers return them: ``(logits, scores,
    indices)`` with integer indices (Qwen3-Next's and GPT-OSS's ``*TopKRouter``); none for a dense model."""
    calls: List[Route] = []

    def record(_: nn.Module, __: Any, out: Any) -> None:
        if isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point():
            calls.append((out[0].detach().float(), out[2].detach()))

    hooks = [m.register_forward_hook(record) for m in model.modules() if type(m).__name__.endswith("Router")]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def _first_rerouted_position(built: List[Route], exact: List[Route], shape: torch.Size) -> int:
    """The first position where some router of ``built`` chose other experts than ``exact``'s (the sequence length
    where none did), after checking that the first such choice, in the earliest layer, is a tie: each expert
    swapped in or out within bf16's distance of the one it replaced in ``exact``'s router logits."""
    assert len(built) == len(exact), (len(built), len(exact))
    batch, length = shape
    differs = []
    for (_, chosen), (_, expected) in zip(built, exact, strict=True):
        rows = (chosen.sort(-1).values != expected.sort(-1).values).any(-1).view(batch, length)
        differs.append(rows.any(0))
    if not differs or not torch.stack(differs).any():
        return length
    position = int(torch.stack(differs).any(0).nonzero()[0])
    layer = next(i for i, d in enumerate(differs) if d[position])
    (_, chosen), (reference, expected) = built[layer], exact[layer]
    logits = reference.view(batch, length, -1)
    for row in range(batch):
        token = row * length + position
        swapped_in = set(chosen[token].tolist()) - set(expected[token].tolist())
        swapped_out = set(expected[token].tolist()) - set(chosen[token].tolist())
        values = logits[row, position]
        ins, outs = (sorted(experts, key=lambda e: -values[e]) for experts in (swapped_in, swapped_out))
        for a, b in zip(ins, outs, strict=True):  # as many swapped in as out: each token picks k experts
            gap, bound = (values[b] - values[a]).abs(), ATOL + RTOL * values[b].abs()
            assert gap <= bound, (f"router {layer} at position {position}: expert {a} for {b}, not a tie", gap, bound)
    return position
