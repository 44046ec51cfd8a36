"""SEKV hot operations: PyTorch references (the CPU path) and Triton kernels with the same signatures
(:mod:`kv_sekv.kernels.dispatch` picks one per device): decode attention (Stage 1, Stage 2, the merge) and the
routing gate here; the prefill's surprisal (:func:`kv_sekv.surprisal_from_hidden`) and coarse entries
(:func:`kv_sekv.coarse_entries`) dispatch to :mod:`.triton_surprisal` / :mod:`.triton_summaries` themselves."""

from .dispatch import biased_attention, factored_attention, factored_attention_batch, routing_priority
from .reference import biased_attention_torch, factored_attention_batch_torch, factored_attention_torch
from .routing import routing_priority_torch

__all__ = [
    "biased_attention",
    "biased_attention_torch",
    "factored_attention",
    "factored_attention_batch",
    "factored_attention_batch_torch",
    "factored_attention_torch",
    "routing_priority",
    "routing_priority_torch",
]
