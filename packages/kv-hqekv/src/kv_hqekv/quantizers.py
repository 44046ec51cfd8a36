"""The quantizer of each HqeKV tier (§3.4): uniform at 4 and 2 bits, normalized at 1 bit.

Keys are quantized per channel (a group is one channel of a ``G``-token block), values per token (a group is
``G`` channels of one token) (§3.4, following KIVI). Table 3 motivates the split: uniform min-max has the lower
conversion loss at 4 bits, the normalized quantizer at 1 bit.
"""

from __future__ import annotations

from kv_hqekv.normalized import NormalizedQuantizer
from kv_hqekv.uniform_one_bit import UniformOneBitQuantizer
from kvcodec import UniformQuantizer
from kvcore import Quantizer
from kvcore.checks import check_int

QUANT_WIDTHS: tuple[int, ...] = (1, 2, 4, 8)
"""Quantized tier widths: 1 (normalized), 2, 4 (uniform; 8 is available, share 0 in the paper)."""

ONE_BIT: tuple[str, ...] = ("normalized", "uniform")
"""1-bit tier quantizers: HqeKV's normalized one (§3.4) and uniform min-max (Table 6 "w/o II")."""


def tier_quantizer(bits: int, kind: str, group_size: int = 32, one_bit: str = "normalized") -> Quantizer:
    """The quantizer of the ``bits`` tier for ``kind`` ``"key"`` (per channel) or ``"value"`` (per token).

    ``bits == 1``: :class:`~kv_hqekv.normalized.NormalizedQuantizer` (``one_bit="normalized"``, HqeKV) or
    :class:`~kv_hqekv.uniform_one_bit.UniformOneBitQuantizer` (``one_bit="uniform"``, the Table 6 ablation);
    2, 4, 8: :class:`kvcodec.UniformQuantizer`. Widths outside {1, 2, 4, 8} (16 is full precision, 0 eviction)
    are a ``ValueError``.
    """
    if check_int("bits", bits) not in QUANT_WIDTHS:
        raise ValueError(f"bits must be a quantized HqeKV width {QUANT_WIDTHS} (16 = fp16, 0 = evict), got {bits!r}")
    if kind not in ("key", "value"):
        raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
    check_int("group_size", group_size, low=1)
    if one_bit not in ONE_BIT:
        raise ValueError(f"one_bit must be one of {ONE_BIT}, got {one_bit!r}")
    axis = "channel" if kind == "key" else "token"
    if bits == 1:
        return (NormalizedQuantizer if one_bit == "normalized" else UniformOneBitQuantizer)(1, axis, group_size)
    return UniformQuantizer(bits, axis, group_size)
