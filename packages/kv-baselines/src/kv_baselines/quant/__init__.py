"""KIVI on kvcodec: the KIVI store and tier selector (the quantization toolkit itself is :mod:`kvcodec`).

* :class:`KIVIStore` -- ``kvcore.Store`` with KIVI's key/value residual policies, ragged eviction, re-tiering and a
  fused quantized ``attend``.
* :class:`KIVITierSelector` -- ``kvcore.Selector`` producing KIVI's prefill layout after any eviction.

``UniformQuantizer``, ``pack_codes``, ``unpack_codes``, ``QUANT_BITS`` and ``scale_dtype_for`` are re-exported from
:mod:`kvcodec` for existing imports; new code imports them from ``kvcodec``.
"""

from kv_baselines.quant.kivi_selector import KIVITierSelector, kivi_tiers
from kv_baselines.quant.kivi_store import KIVIStore, KIVIUnquantizedWarning
from kvcodec import QUANT_BITS, UniformQuantizer, pack_codes, scale_dtype_for, unpack_codes

__all__ = [
    "QUANT_BITS",
    "KIVIStore",
    "KIVITierSelector",
    "KIVIUnquantizedWarning",
    "UniformQuantizer",
    "kivi_tiers",
    "pack_codes",
    "scale_dtype_for",
    "unpack_codes",
]
