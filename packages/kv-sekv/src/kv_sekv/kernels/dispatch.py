"""SEKV's kernels dispatched: Triton on CUDA tensors (when Triton is installed), the PyTorch reference otherwise.

The decision is :func:`kvcore.dispatch.use_triton`, bound here (``dispatch.use_triton``) so a test can force this
module's Triton path with ``monkeypatch.setattr(dispatch, "use_triton", ...)``; :mod:`kv_sekv.summaries` and
:mod:`kv_sekv.surprisal` read it through this module.
"""

from __future__ import annotations

import torch

from kvcore import merge_split_attention
from kvcore.dispatch import use_triton

from .reference import (
    biased_attention_torch,
    factored_attention_batch_torch,
    factored_attention_torch,
    factored_items_torch,
)
from .routing import routing_priority_torch

__all__ = [
    "biased_attention",
    "biased_attention_splits",
    "factored_attention",
    "factored_attention_batch",
    "factored_items",
    "merge_splits",
    "routing_priority",
    "use_triton",
]


def biased_attention(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, query: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 decode attention with per-entry bias (see :func:`~kv_sekv.kernels.reference.biased_attention_torch`)."""
    if use_triton(keys):
        from .triton_attention import biased_attention_triton

        return biased_attention_triton(keys, values, bias, query, scale)
    return biased_attention_torch(keys, values, bias, query, scale)


def biased_attention_splits(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, query: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 decode attention as partial results for a log-sum-exp merge (:func:`kv_sekv.kernels.merge.merge_splits`):
    ``(outp [B·Hq·Q, S, D], lsep [B·Hq·Q, S])`` float32, rows in ``(batch, query head, query)`` order. On CUDA the
    ``S`` splits of :func:`~kv_sekv.kernels.triton_attention.biased_attention_splits_triton`, elsewhere
    :func:`~kv_sekv.kernels.reference.biased_attention_torch` as one part."""
    if use_triton(keys):
        from .triton_attention import biased_attention_splits_triton

        return biased_attention_splits_triton(keys, values, bias, query, scale)
    out, lse = biased_attention_torch(keys, values, bias, query, scale)
    return out.reshape(-1, 1, out.shape[-1]), lse.reshape(-1, 1)


def factored_items(query, key_factors, value_factors, scale):
    """Stage-2 attention of every expanded (span, KV head) item over its span from the factors, not merged (see
    :func:`~kv_sekv.kernels.reference.factored_items_torch`; on CUDA the Triton kernel
    :func:`~kv_sekv.kernels.triton_attention.factored_items_triton`)."""
    if use_triton(query):
        from .triton_attention import factored_items_triton

        return factored_items_triton(query, key_factors, value_factors, scale)
    return factored_items_torch(query, key_factors, value_factors, scale)


def factored_attention(query, key_factors, value_factors, scale):
    """Stage-2 attention over one span from its factors (see
    :func:`~kv_sekv.kernels.reference.factored_attention_torch`)."""
    if use_triton(query):
        from .triton_attention import factored_attention_triton

        return factored_attention_triton(query, key_factors, value_factors, scale)
    return factored_attention_torch(query, key_factors, value_factors, scale)


def factored_attention_batch(query, key_factors, value_factors, scale, group, groups):
    """Stage-2 attention over every expanded (span, KV head) of a step at once, merged per KV head (see
    :func:`~kv_sekv.kernels.reference.factored_attention_batch_torch`; on CUDA the Triton kernel
    :func:`~kv_sekv.kernels.triton_attention.factored_attention_batch_triton`)."""
    if use_triton(query):
        from .triton_attention import factored_attention_batch_triton

        return factored_attention_batch_triton(query, key_factors, value_factors, scale, group, groups)
    return factored_attention_batch_torch(query, key_factors, value_factors, scale, group, groups)


def routing_priority(query, W, tau, summary, length, alive):
    """Largest selecting routing gate per KV head and span (Eqs. 4–5, 9), and Stage 1's coarse-entry bias (see
    :func:`~kv_sekv.kernels.routing.routing_priority_torch`; on CUDA one launch of
    :func:`~kv_sekv.kernels.triton_routing.routing_priority_triton`)."""
    if use_triton(query):
        from .triton_routing import routing_priority_triton

        return routing_priority_triton(query, W, tau, summary, length, alive)
    return routing_priority_torch(query, W, tau, summary, length, alive)


def merge_splits(outp: torch.Tensor, lsep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp merge of partial attentions over disjoint entry sets (SEKV §3.3: Stage 1 and Stage 2 merged
    into one softmax over all of it): ``outp [R, S, D]`` normalised outputs and ``lsep [R, S]`` log-sum-exps of ``R``
    query rows -> ``(out [R, D], lse [R])`` float32; a part with ``lse = -inf`` adds nothing, a row no part saw gets
    ``out = 0``, ``lse = -inf``. On CUDA one launch of kvcodec's merge kernel
    (:func:`kvcodec.kernels.triton_attention.merge_splits`, shared with the other methods' decode kernels), elsewhere
    :func:`kvcore.merge_split_attention`."""
    if use_triton(outp):
        from .triton_attention import merge_split_parts

        return merge_split_parts(outp, lsep)
    return merge_split_attention(outp, lsep, dim=1)
