"""What every export of the runner must show a user's loader: ``config.json`` states the dtype its bulk is stored in
(each sub-config too), ``from_pretrained(folder, dtype="auto")`` builds the bulk in it, and that model's logits are
the stored weights' within bf16's distance, with the same greedy tokens."""

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch

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
    computing in fp32); another ``auto_class`` (an image-text model) from the same files in fp32. A MoE's routing
    in fp32 compute can differ from bf16's, which is why the reference computes as training did."""
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
    with torch.no_grad():
        stored = built(**inputs).logits.float()
        reference = exact(**inputs).logits.float()
    torch.testing.assert_close(stored, reference, rtol=1.6e-2, atol=1e-2)
    # the same greedy token wherever the exact weights' top two logits are further apart than the rounding
    top = reference.topk(2, dim=-1).values
    clear = (top[..., 0] - top[..., 1]) > 2 * (1e-2 + 1.6e-2 * top[..., 0].abs())
    assert torch.equal(stored.argmax(-1)[clear], reference.argmax(-1)[clear])
