"""The models a recipe builds itself: the reference byte-level Llama (``tiny_llama``; tests, examples and benchmarks
share it), its Hugging Face wrapper (``hf_tinyllama``, copied into exports) and HF causal LMs from a config
(``hf``)."""

from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig, causal_lm_loss

__all__ = ["TinyLlama", "TinyLlamaConfig", "causal_lm_loss"]
