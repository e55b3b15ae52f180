"""The reference model (``TinyLlama`` of ``tiny_llama.py``) as a Hugging Face causal LM, so that the main job's export
loads with ``AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)``.

The export holds this file and a copy of ``tiny_llama.py`` (HF's custom-code convention: ``auto_map`` in
``config.json``); it imports only torch and transformers, so the export loads wherever those are installed. The
parameter names are the training model's. The tensors the export holds in fp32 (the config's ``keep_in_fp32``
patterns: norms, ``A_log``) stay fp32 under a bf16 or fp16 load (``_keep_in_fp32_modules_strict``), and an fp32 norm
computes as it did in training: its input cast to fp32, its output cast back to the embedding's dtype.
"""

from typing import Any, List, Optional

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from typing_extensions import override

from .tiny_llama import Block, Mixer, RMSNorm, TinyLlamaConfig, causal_lm_loss


class TinyLlamaHFConfig(PretrainedConfig):
    model_type = "mixedfsdp_tinyllama"
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        hidden_dim: int = 128,
        mixer_layers: Optional[List[int]] = None,
        norm_eps: float = 1e-5,
        keep_in_fp32: Optional[List[str]] = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size, self.dim, self.n_layers, self.n_heads = vocab_size, dim, n_layers, n_heads
        self.hidden_dim, self.mixer_layers, self.norm_eps = hidden_dim, list(mixer_layers or []), norm_eps
        self.keep_in_fp32 = list(keep_in_fp32 or [])
        """Anchored regexes of the tensors the checkpoint holds in fp32."""
        super().__init__(**kwargs)

    def reference(self) -> TinyLlamaConfig:
        return TinyLlamaConfig(
            self.vocab_size, self.dim, self.n_layers, self.n_heads, self.hidden_dim, self.mixer_layers, self.norm_eps
        )


class TinyLlamaForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TinyLlamaHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: TinyLlamaHFConfig) -> None:
        super().__init__(config)
        reference = config.reference()
        self.tok_embeddings = nn.Embedding(reference.vocab_size, reference.dim)
        self.layers = nn.ModuleList(Block(reference, i in reference.mixer_layers) for i in range(reference.n_layers))
        self.norm = RMSNorm(reference.dim, reference.norm_eps)
        self.output = nn.Linear(reference.dim, reference.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.register_forward_pre_hook(_inputs_to_weight_dtype)
                module.register_forward_hook(self._output_to_compute_dtype)
        self.post_init()
        # read by from_pretrained once the model is built: exactly these tensors stay fp32 under bf16/fp16
        self._keep_in_fp32_modules_strict = set(config.keep_in_fp32)

    def _output_to_compute_dtype(self, _: nn.Module, __: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.tok_embeddings.weight.dtype)

    @torch.no_grad()
    @override
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, (RMSNorm, Mixer)):
            module.reset_parameters()

    @override
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """HF's ``generate`` without a KV cache (this model keeps none): each step runs the whole sequence, as
        greedy decoding by hand does. The config cannot say ``use_cache=False``: transformers 5 pops generation
        parameters from a config's kwargs, and ``generate`` would then build a cache this model never fills and
        pass it only the newest token from the second step on."""
        kwargs.setdefault("use_cache", False)
        return super().generate(*args, **kwargs)

    @override
    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    @override
    def set_input_embeddings(self, value: nn.Module) -> None:
        assert isinstance(value, nn.Embedding)
        self.tok_embeddings = value

    @override
    def get_output_embeddings(self) -> nn.Linear:
        return self.output

    @override
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        """Causal attention over the whole sequence (no padding mask, no KV cache: generation recomputes the
        prefix)."""
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _inputs_to_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    assert isinstance(module, RMSNorm)
    dtype = module.weight.dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
