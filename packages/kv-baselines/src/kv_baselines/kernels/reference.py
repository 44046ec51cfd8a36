"""PyTorch references of the hot quantization operations (the CPU path; same signatures as the Triton kernels).

* :func:`quantize_pack_ref` -- fused min-max quantize + dense bit-pack (KIVI ``quant_and_pack_{k,v}cache``).
* :func:`unpack_dequantize_ref` -- unpack + dequantize (KIVI ``unpack_and_dequant_{k,v}cache``).
* :func:`compact_ref` -- gather the kept entries of a ragged per-head selection into one flat buffer.

Arguments are assumed valid (the public entry points, ``UniformQuantizer`` and the dispatchers, check them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kv_baselines.quant.minmax import minmax_scale, scale_dtype_for
from kv_baselines.quant.packing import pack_codes, unpack_codes


def _group_minmax(x: torch.Tensor, axis: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of float32 ``x [M, T, D]`` (partial last groups allowed)."""
    M, T, D = x.shape
    G = group_size
    if axis == "token":
        n = -(-D // G)
        lo = F.pad(x, (0, n * G - D), value=float("inf")).view(M, T, n, G).amin(-1)
        hi = F.pad(x, (0, n * G - D), value=float("-inf")).view(M, T, n, G).amax(-1)
    else:
        n = -(-T // G)
        lo = F.pad(x, (0, 0, 0, n * G - T), value=float("inf")).view(M, n, G, D).amin(-2)
        hi = F.pad(x, (0, 0, 0, n * G - T), value=float("-inf")).view(M, n, G, D).amax(-2)
    return lo, hi


def _expand(stat: torch.Tensor, axis: str, group_size: int, T: int, D: int) -> torch.Tensor:
    """Broadcast per-group statistics ``[M, *, *]`` back to elements ``[M, T, D]``."""
    if axis == "token":
        return stat.repeat_interleave(group_size, dim=-1)[..., :D]
    return stat.repeat_interleave(group_size, dim=-2)[..., :T, :]


def quantize_pack_ref(
    x: torch.Tensor, bits: int, axis: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., T, D]`` per group with the min-max rule of :mod:`kv_baselines.quant.minmax`.

    Returns
    -------
    codes : Tensor
        uint8 ``[..., T, packed_width(D, bits)]``.
    scales, zeros : Tensor
        ``[..., T, ceil(D/G)]`` (``axis="token"``) or ``[..., ceil(T/G), D]`` (``axis="channel"``); scales in
        ``scale_dtype_for(x.dtype, bits)``, zeros (the group minima) in ``x.dtype``.
    """
    *lead, T, D = x.shape
    xf = x.reshape(math.prod(lead), T, D).float()
    lo, hi = _group_minmax(xf, axis, group_size)
    sdt = scale_dtype_for(x.dtype, bits)
    scale = minmax_scale(hi - lo, bits, sdt)
    z_el = _expand(lo, axis, group_size, T, D)
    s_el = _expand(scale, axis, group_size, T, D)
    levels = (1 << bits) - 1
    codes = torch.round((xf - z_el) / s_el).clamp_(0, levels).to(torch.uint8)
    packed = pack_codes(codes, bits)
    shape_g = tuple(scale.shape[1:])
    return (
        packed.view(*lead, T, packed.shape[-1]),
        scale.to(sdt).view(*lead, *shape_g),
        lo.to(x.dtype).view(*lead, *shape_g),
    )


def unpack_dequantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    axis: str,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack_ref` up to the quantization error: ``zero + code * scale`` in ``dtype``.

    Computed in float32 (a product, then a sum) and clamped to the finite range of ``dtype`` before the
    final round-to-nearest cast.
    """
    *lead, T, D = shape
    M = math.prod(lead)
    c = unpack_codes(codes.reshape(M, T, codes.shape[-1]), bits, D).float()
    s_el = _expand(scales.reshape(M, *scales.shape[-2:]).float(), axis, group_size, T, D)
    z_el = _expand(zeros.reshape(M, *zeros.shape[-2:]).float(), axis, group_size, T, D)
    fmax = torch.finfo(dtype).max
    y = (z_el + c * s_el).clamp_(-fmax, fmax)
    return y.to(dtype).view(*lead, T, D)


def compact_ref(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries of ``x [B, H, T, D]`` under ``keep [B, H, T]`` as ``([N, D] in (b, h, t) order, [B, H] counts)``."""
    return x[keep], keep.sum(-1)
