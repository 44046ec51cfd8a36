"""HqeKV's kernels: Triton on CUDA, each with a PyTorch reference of the same signature (the CPU path).

* fused mixed-tier decode attention and its reduced attention row (:func:`tiered_attention`,
  :func:`tiered_attention_row`) over a :class:`TieredSide` pair, and the same attention over a cache addressed by
  blocks (:func:`blocked_attention` over a :class:`BlockLayout` and two :class:`BlockedSide` s, the decode path);
* block transcode, a lower tier quantized from the held codes (:func:`transcode`);
* tiled window importance (:func:`kv_hqekv.window_importance`, kernel in :mod:`kv_hqekv.kernels.triton_importance`).
"""

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout, blocked_layout, expand_side
from kv_hqekv.kernels.dispatch import blocked_attention, tiered_attention, tiered_attention_row, transcode
from kv_hqekv.kernels.reference import (
    blocked_attention_ref,
    dequantize_side_ref,
    tiered_attention_ref,
    tiered_attention_row_ref,
    transcode_ref,
)
from kv_hqekv.kernels.tiered import TIER_BITS, TierCodes, TieredSide

__all__ = [
    "TIER_BITS",
    "BlockLayout",
    "BlockedSide",
    "TierCodes",
    "TieredSide",
    "blocked_attention",
    "blocked_attention_ref",
    "blocked_layout",
    "dequantize_side_ref",
    "expand_side",
    "tiered_attention",
    "tiered_attention_ref",
    "tiered_attention_row",
    "tiered_attention_row_ref",
    "transcode",
    "transcode_ref",
]
