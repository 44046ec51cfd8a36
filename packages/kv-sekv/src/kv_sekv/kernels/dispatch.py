"""One dispatch point: Triton on CUDA tensors (when Triton is installed), the PyTorch reference otherwise."""

from __future__ import annotations

import torch

from .reference import biased_attention_torch, factored_attention_batch_torch, factored_attention_torch

__all__ = ["biased_attention", "factored_attention", "factored_attention_batch"]


def _use_triton(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    from .triton_attention import HAS_TRITON

    return HAS_TRITON


def biased_attention(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, query: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 decode attention with per-entry bias (see :func:`~kv_sekv.kernels.reference.biased_attention_torch`)."""
    if _use_triton(keys):
        from .triton_attention import biased_attention_triton

        return biased_attention_triton(keys, values, bias, query, scale)
    return biased_attention_torch(keys, values, bias, query, scale)


def factored_attention(query, key_factors, value_factors, scale):
    """Stage-2 attention over one span from its factors (see
    :func:`~kv_sekv.kernels.reference.factored_attention_torch`)."""
    if _use_triton(query):
        from .triton_attention import factored_attention_triton

        return factored_attention_triton(query, key_factors, value_factors, scale)
    return factored_attention_torch(query, key_factors, value_factors, scale)


def factored_attention_batch(query, key_factors, value_factors, scale, group, groups):
    """Stage-2 attention over every expanded (span, KV head) of a step at once, merged per KV head (see
    :func:`~kv_sekv.kernels.reference.factored_attention_batch_torch`; on CUDA the Triton kernel
    :func:`~kv_sekv.kernels.triton_attention.factored_attention_batch_triton`)."""
    if _use_triton(query):
        from .triton_attention import factored_attention_batch_triton

        return factored_attention_batch_triton(query, key_factors, value_factors, scale, group, groups)
    return factored_attention_batch_torch(query, key_factors, value_factors, scale, group, groups)
