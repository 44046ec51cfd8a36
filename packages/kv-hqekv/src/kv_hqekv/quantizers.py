"""The quantizer of each HqeKV tier (§3.4): uniform at 4 and 2 bits, normalized at 1 bit.

Keys are quantized per channel (a group is one channel of a ``G``-token block), values per token (a group is
``G`` channels of one token) (§3.4, following KIVI). Table 3 motivates the split: uniform min-max has the lower
conversion loss at 4 bits, the normalized quantizer at 1 bit.
"""

from __future__ import annotations

from kv_hqekv.normalized import NormalizedQuantizer
from kvcodec import UniformQuantizer
from kvcore import Quantizer
from kvcore.checks import check_int

QUANT_WIDTHS: tuple[int, ...] = (1, 2, 4, 8)
"""Quantized tier widths: 1 (normalized), 2, 4 (uniform; 8 is available, share 0 in the paper)."""


def tier_quantizer(bits: int, kind: str, group_size: int = 32) -> Quantizer:
    """The quantizer of the ``bits`` tier for ``kind`` ``"key"`` (per channel) or ``"value"`` (per token).

    ``bits == 1``: :class:`~kv_hqekv.normalized.NormalizedQuantizer`; 2, 4, 8: :class:`kvcodec.UniformQuantizer`.
    Widths outside {1, 2, 4, 8} (16 is full precision, 0 eviction) are a ``ValueError``.
    """
    if isinstance(bits, bool) or bits not in QUANT_WIDTHS:
        raise ValueError(f"bits must be a quantized HqeKV width {QUANT_WIDTHS} (16 = fp16, 0 = evict), got {bits!r}")
    if kind not in ("key", "value"):
        raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
    check_int("group_size", group_size, low=1)
    axis = "channel" if kind == "key" else "token"
    if bits == 1:
        return NormalizedQuantizer(1, axis, group_size)
    return UniformQuantizer(bits, axis, group_size)
