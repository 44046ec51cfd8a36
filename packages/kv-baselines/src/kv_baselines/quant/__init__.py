"""Quantization: KIVI-style uniform min-max quantizers, dense bit-packing, and the KIVI store/selector.

* :class:`UniformQuantizer` -- ``kvcore.Quantizer``, per-token or per-channel groups, 1/2/3/4/8 bits.
* :func:`pack_codes` / :func:`unpack_codes` -- the dense little-endian bit stream of ``kvcore.QuantizedTensor``.
* :class:`KIVIStore` -- ``kvcore.Store`` with KIVI's key/value residual policies and ragged eviction.
* :class:`KIVITierSelector` -- ``kvcore.Selector`` producing KIVI's prefill layout after any eviction.
"""

from kv_baselines.quant.minmax import QUANT_BITS, scale_dtype_for
from kv_baselines.quant.packing import pack_codes, unpack_codes
from kv_baselines.quant.uniform import UniformQuantizer
from kv_baselines.quant.kivi_store import KIVIStore
from kv_baselines.quant.kivi_selector import KIVITierSelector, kivi_tiers

__all__ = [
    "KIVIStore", "KIVITierSelector", "QUANT_BITS", "UniformQuantizer", "kivi_tiers", "pack_codes",
    "scale_dtype_for", "unpack_codes",
]
