"""Dispatch: Triton kernels for CUDA tensors, the PyTorch references for everything else.

The decision is :func:`kvcore.dispatch.use_triton` (the one dispatch point of kvcompress), re-exported here with
:func:`~kvcore.dispatch.triton_available`. ``import kvcodec`` works without triton: the Triton modules are imported
on the first CUDA call, and CUDA tensors fall back to the reference when triton is not installed.
"""

from __future__ import annotations

import torch

from kvcodec.kernels.reference import compact_ref, quantize_pack_ref, unpack_dequantize_ref
from kvcore.checks import check_tensor
from kvcore.dispatch import triton_available, use_triton

__all__ = ["compact", "quantize_pack", "triton_available", "unpack_dequantize", "use_triton"]


def quantize_pack(
    x: torch.Tensor, bits: int, axis: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused min-max quantize + bit-pack of ``x [..., T, D]``: ``(codes, scales, zeros)``.

    Arguments are not checked here; :class:`~kvcodec.UniformQuantizer` is the checked entry point.
    See :func:`~kvcodec.kernels.reference.quantize_pack_ref` for the layout.
    """
    if use_triton(x):
        from kvcodec.kernels.triton_quant import quantize_pack_triton

        return quantize_pack_triton(x, bits, axis, group_size)
    return quantize_pack_ref(x, bits, axis, group_size)


def unpack_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    axis: str,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Fused unpack + dequantize (inverse of :func:`quantize_pack` up to the quantization error)."""
    if use_triton(codes):
        from kvcodec.kernels.triton_quant import unpack_dequantize_triton

        return unpack_dequantize_triton(codes, scales, zeros, bits, axis, group_size, shape, dtype)
    return unpack_dequantize_ref(codes, scales, zeros, bits, axis, group_size, shape, dtype)


def compact(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries of ``x [B, H, T, D]`` as ``(flat [N, D] in (b, h, t) order, lengths [B, H])``.

    Equal to ``(x[keep], keep.sum(-1))``.
    """
    check_tensor("x", x, ndim=4)
    check_tensor("keep", keep, ndim=3)
    if keep.dtype != torch.bool or tuple(keep.shape) != tuple(x.shape[:3]):
        raise ValueError(
            f"keep must be a bool tensor of shape {tuple(x.shape[:3])}, got {keep.dtype} {tuple(keep.shape)}"
        )
    if keep.device != x.device:
        raise ValueError(f"keep is on {keep.device} but x is on {x.device}")
    if use_triton(x):
        from kvcodec.kernels.triton_compact import compact_triton

        return compact_triton(x, keep)
    return compact_ref(x, keep)
