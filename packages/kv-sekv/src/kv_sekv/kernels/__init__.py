"""SEKV hot operations: PyTorch references (the CPU path) and Triton kernels with the same signatures
(:mod:`kv_sekv.kernels.dispatch` picks one per device)."""

from .dispatch import biased_attention, factored_attention, factored_attention_batch
from .reference import biased_attention_torch, factored_attention_batch_torch, factored_attention_torch

__all__ = [
    "biased_attention",
    "biased_attention_torch",
    "factored_attention",
    "factored_attention_batch",
    "factored_attention_batch_torch",
    "factored_attention_torch",
]
