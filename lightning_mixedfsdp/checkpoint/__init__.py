"""Checkpoints that keep every dtype: atomic saves, dtype-aware and rank-0 loads, export."""

from lightning_mixedfsdp.checkpoint.export import export_adapter, export_model, write_safetensors
from lightning_mixedfsdp.checkpoint.load import load_full_weights, load_weights, read_state_dict

__all__ = [
    "export_adapter",
    "export_model",
    "load_full_weights",
    "load_weights",
    "read_state_dict",
    "write_safetensors",
]
