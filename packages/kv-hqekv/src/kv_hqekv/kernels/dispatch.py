"""Dispatch of the HqeKV kernels: Triton on CUDA tensors (when triton is installed), the PyTorch reference otherwise.

Arguments are checked by the public entry points (:func:`kv_hqekv.attention.mixed_tier_attention`,
:meth:`kv_hqekv.HqeKVStore.attend`, :func:`kv_hqekv.window_importance`); see :mod:`kv_hqekv.kernels.reference`
for the semantics.
"""

from __future__ import annotations

import torch

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout
from kv_hqekv.kernels.reference import (
    blocked_attention_ref,
    tiered_attention_ref,
    tiered_attention_row_ref,
    transcode_ref,
)
from kv_hqekv.kernels.tiered import TieredSide
from kvcodec.kernels.dispatch import use_triton
from kvcore import QuantizedTensor


def tiered_attention(
    query: torch.Tensor, keys: TieredSide, values: TieredSide, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused mixed-tier decode attention ``(out, lse)`` (:func:`~kv_hqekv.kernels.reference.tiered_attention_ref`)."""
    if use_triton(query):
        from kv_hqekv.kernels.triton_attention import tiered_attention_triton

        return tiered_attention_triton(query, keys, values, scale)
    return tiered_attention_ref(query, keys, values, scale)


def blocked_attention(
    query: torch.Tensor, layout: BlockLayout, keys: BlockedSide, values: BlockedSide, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused mixed-tier decode attention over a cache addressed by blocks
    (:func:`~kv_hqekv.kernels.reference.blocked_attention_ref`)."""
    if use_triton(query):
        from kv_hqekv.kernels.triton_attention import blocked_attention_triton

        return blocked_attention_triton(query, layout, keys, values, scale)
    return blocked_attention_ref(query, layout, keys, values, scale)


def tiered_attention_row(query: torch.Tensor, keys: TieredSide, scale: float, lse: torch.Tensor) -> torch.Tensor:
    """Attention row reduced over each GQA group (:func:`~kv_hqekv.kernels.reference.tiered_attention_row_ref`)."""
    if use_triton(query):
        from kv_hqekv.kernels.triton_attention import tiered_attention_row_triton

        return tiered_attention_row_triton(query, keys, scale, lse)
    return tiered_attention_row_ref(query, keys, scale, lse)


def transcode(source: TieredSide, bits: int, axis: str, group_size: int) -> QuantizedTensor:
    """A lower tier quantized from the held codes (:func:`~kv_hqekv.kernels.reference.transcode_ref`)."""
    if use_triton(source.tier):
        from kv_hqekv.kernels.triton_transcode import transcode_triton

        return transcode_triton(source, bits, axis, group_size)
    return transcode_ref(source, bits, axis, group_size)
