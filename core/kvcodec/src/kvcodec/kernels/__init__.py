"""Hot operations of the quantized stores: Triton kernels (CUDA) with PyTorch references (CPU).

``quantize_pack`` / ``unpack_dequantize`` (min-max quantization fused with dense bit-packing, both grouping
axes, 1/2/3/4/8 bits) and ``compact`` (gather kept entries of a ragged selection). Each dispatcher runs the
Triton kernel on CUDA tensors and the reference in :mod:`kvcodec.kernels.reference` otherwise.
"""

from kvcodec.kernels.dispatch import compact, quantize_pack, triton_available, unpack_dequantize, use_triton
from kvcodec.kernels.reference import compact_ref, quantize_pack_ref, unpack_dequantize_ref

__all__ = [
    "compact",
    "compact_ref",
    "quantize_pack",
    "quantize_pack_ref",
    "triton_available",
    "unpack_dequantize",
    "unpack_dequantize_ref",
    "use_triton",
]
