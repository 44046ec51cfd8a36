"""kvcodec: the quantization toolkit shared by KV-cache compression methods.

* Dense bit packing, 1 to 8 bits: :func:`pack_codes` / :func:`unpack_codes` (the ``kvcore.QuantizedTensor`` layout).
* Min-max statistics (any group size, whole-axis groups, masked entries): :func:`minmax_stats`.
* :class:`UniformQuantizer` -- uniform asymmetric min-max (KIVI), a ``kvcore.Quantizer``.
* :class:`CodebookQuantizer` and :func:`normal_codebook` -- nearest-level codebooks in units of the group scale.
* :func:`to_bytes` / :func:`from_bytes` -- versioned, checksummed serialization of a ``QuantizedTensor``.
* :func:`quantized_attention` -- fused decode attention over packed uniform codes (Triton on CUDA).
* Ragged per-(batch, head) containers (:mod:`kvcodec.ragged`, :mod:`kvcodec.segments`) for quantized stores.
"""

from kvcodec.attention import CodeRows, QuantizedSegment, quantized_attention
from kvcodec.codebook import CodebookQuantizer, normal_codebook
from kvcodec.narrow import narrow, narrow_int
from kvcodec.packing import PACK_BITS, pack_codes, unpack_codes
from kvcodec.serialize import from_bytes, to_bytes
from kvcodec.stats import QUANT_BITS, MinMaxStats, minmax_stats, scale_dtype_for
from kvcodec.uniform import UniformQuantizer

__all__ = [
    "PACK_BITS",
    "QUANT_BITS",
    "CodeRows",
    "CodebookQuantizer",
    "MinMaxStats",
    "QuantizedSegment",
    "UniformQuantizer",
    "from_bytes",
    "minmax_stats",
    "narrow",
    "narrow_int",
    "normal_codebook",
    "pack_codes",
    "quantized_attention",
    "scale_dtype_for",
    "to_bytes",
    "unpack_codes",
]
