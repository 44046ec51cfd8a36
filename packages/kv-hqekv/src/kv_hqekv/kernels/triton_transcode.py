"""Triton kernel: block transcode -- held entries quantized at a lower tier straight from their held codes.

A tile of held entries (any mix of fp16 rows and 4-/2-/1-bit code rows, :mod:`kv_hqekv.kernels.triton_tiles`) is
dequantized in registers to the cache dtype, its new group statistics are reduced in registers, and the new codes
are packed and stored: the dequantized tensor of a dequantize-then-quantize pass is never written to memory.

* ``axis="channel"`` (HqeKV keys): a program owns one unit of ``U <= G`` entries (one quantization group per
  channel) and the whole head dimension, and reduces along the entries.
* ``axis="token"`` (HqeKV values): a program owns ``BLOCK_R`` entries and reduces groups of ``G`` channels in
  registers (``G`` a power of two; the dispatcher uses the reference otherwise).

Target tiers: uniform min-max at 4 or 2 bits (the exact scale rule of :mod:`kvcodec.stats`, bit-identical to
:class:`kvcodec.UniformQuantizer`), normalized at 1 bit (group mean and unbiased std rounded to the cache dtype, code
``#{k : z > u_k}`` with the Gaussian-quantile bounds :func:`kv_hqekv.normal_bounds`; equal to
:class:`kv_hqekv.NormalizedQuantizer` up to the summation order of the mean and std, which only moves entries lying
within float rounding of the mean or of a bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_hqekv.kernels.tiered import TieredSide
from kv_hqekv.kernels.triton_tiles import OUT_CODE, _entry_maps, _mapped_rows, side_args
from kvcodec.kernels.triton_dot import cache_round
from kvcodec.kernels.triton_quant import _SDT, _codes, _minmax_scale, _pack_store
from kvcodec.stats import scale_dtype_for, scale_floor
from kvcore import QuantizedTensor, packed_width


@triton.jit
def _quantize_groups(x, valid, count, bounds_ptr, BITS: tl.constexpr, NORMAL: tl.constexpr, SDT: tl.constexpr,
                     FLOOR: tl.constexpr, OUT: tl.constexpr, AXIS: tl.constexpr):  # fmt: skip
    """Codes (int32, like ``x``), scales and zeros (float32, reduced over ``AXIS``) of the groups of ``x``."""
    lo = tl.min(tl.where(valid, x, float("inf")), axis=AXIS)
    hi = tl.max(tl.where(valid, x, float("-inf")), axis=AXIS)
    some = count > 0
    lo = tl.where(some, lo, 0.0)
    hi = tl.where(some, hi, 0.0)
    if NORMAL:
        n = tl.where(some, count, 1).to(tl.float32)
        mean = tl.math.div_rn(tl.sum(tl.where(valid, x, 0.0), axis=AXIS), n)
        const = lo == hi
        mean = tl.where(const, lo, mean)
        dev = tl.where(valid, x - tl.expand_dims(mean, AXIS), 0.0)
        var = tl.math.div_rn(tl.sum(dev * dev, axis=AXIS), tl.maximum(n - 1.0, 1.0))
        std = tl.where(const, 0.0, tl.math.sqrt_rn(var))
        zero = cache_round(mean, OUT)
        scale = cache_round(std, OUT)
        s = tl.expand_dims(scale, AXIS)
        pos = s > 0
        z = tl.where(pos, tl.math.div_rn(x - tl.expand_dims(zero, AXIS), tl.where(pos, s, 1.0)), 0.0)
        code = tl.zeros(x.shape, tl.int32)
        for k in tl.static_range((1 << BITS) - 1):
            code += (z > tl.load(bounds_ptr + k)).to(tl.int32)
    else:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        scale = _minmax_scale(hi - lo, LEVELS, SDT, FLOOR)
        zero = lo
        code = _codes(x, tl.expand_dims(lo, AXIS), tl.expand_dims(scale, AXIS), LEVELS)
    return tl.where(valid, code, 0), scale, zero


@triton.jit
def _transcode_channel_kernel(
    out_codes, out_scales, out_zeros, bounds_ptr,
    st, sr, sg, sf, c4, s4, z4, k4, c2, s2, z2, k2, c1, s1, z1, k1, C, PW4, PW2, PW1,
    U,
    D: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr, PW: tl.constexpr, BITS: tl.constexpr,
    NORMAL: tl.constexpr, SDT: tl.constexpr, FLOOR: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
    GCOL: tl.constexpr, HAS4: tl.constexpr, HAS2: tl.constexpr, HAS1: tl.constexpr,
    CB4: tl.constexpr, CB2: tl.constexpr, CB1: tl.constexpr,
):  # fmt: skip
    u = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_U)
    rmask = r < U
    base = u * U + r
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    tier, row, grp = _entry_maps(st, sr, sg, base, rmask)
    x = _mapped_rows(
        tier, row, grp, sf, c4, s4, z4, k4, c2, s2, z2, k2, c1, s1, z1, k1,
        d, dmask, C, PW4, PW2, PW1, D, GCOL, BLOCK_U, BLOCK_D, HAS4, HAS2, HAS1, CB4, CB2, CB1, FMAX, OUT,
    )  # fmt: skip
    valid = rmask[:, None] & dmask[None, :]
    count = tl.sum(valid.to(tl.int32), axis=0)
    code, scale, zero = _quantize_groups(x, valid, count, bounds_ptr, BITS, NORMAL, SDT, FLOOR, OUT, 0)
    _pack_store(out_codes, base * PW, rmask, code, PW, BITS, BLOCK_U, BLOCK_D)
    tl.store(out_scales + u * D + d, scale, mask=dmask)
    tl.store(out_zeros + u * D + d, zero, mask=dmask)


@triton.jit
def _transcode_token_kernel(
    out_codes, out_scales, out_zeros, bounds_ptr,
    st, sr, sg, sf, c4, s4, z4, k4, c2, s2, z2, k2, c1, s1, z1, k1, C, PW4, PW2, PW1,
    N,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, PW: tl.constexpr,
    BITS: tl.constexpr, NORMAL: tl.constexpr, SDT: tl.constexpr, FLOOR: tl.constexpr, FMAX: tl.constexpr,
    OUT: tl.constexpr, GCOL: tl.constexpr, HAS4: tl.constexpr, HAS2: tl.constexpr, HAS1: tl.constexpr,
    CB4: tl.constexpr, CB2: tl.constexpr, CB1: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < N
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    tier, row, grp = _entry_maps(st, sr, sg, r, rmask)
    x = _mapped_rows(
        tier, row, grp, sf, c4, s4, z4, k4, c2, s2, z2, k2, c1, s1, z1, k1,
        d, dmask, C, PW4, PW2, PW1, D, GCOL, BLOCK_R, BLOCK_D, HAS4, HAS2, HAS1, CB4, CB2, CB1, FMAX, OUT,
    )  # fmt: skip
    NG: tl.constexpr = BLOCK_D // G
    valid = rmask[:, None] & dmask[None, :]
    xg = tl.reshape(x, (BLOCK_R, NG, G))
    vg = tl.reshape(valid, (BLOCK_R, NG, G))
    count = tl.sum(vg.to(tl.int32), axis=2)
    code, scale, zero = _quantize_groups(xg, vg, count, bounds_ptr, BITS, NORMAL, SDT, FLOOR, OUT, 2)
    _pack_store(out_codes, r * PW, rmask, tl.reshape(code, (BLOCK_R, BLOCK_D)), PW, BITS, BLOCK_R, BLOCK_D)
    g = tl.arange(0, NG)
    smask = rmask[:, None] & (g < C)[None, :]
    tl.store(out_scales + r[:, None] * C + g[None, :], scale, mask=smask)
    tl.store(out_zeros + r[:, None] * C + g[None, :], zero, mask=smask)


def _pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1) - 1).bit_length())


def triton_supported(source: TieredSide, axis: str, group_size: int) -> bool:
    """Layouts the kernels cover: channel groups of ``U <= G`` entries; token groups with ``G`` a power of two."""
    if axis == "channel":
        return source.tier.shape[1] <= group_size
    return group_size == _pow2(group_size)


def transcode_triton(
    source: TieredSide, bits: int, axis: str, group_size: int, *, block_r: int = 16, num_warps: int = 4
) -> QuantizedTensor:
    """Triton :func:`~kv_hqekv.kernels.reference.transcode_ref` (same arguments; the reference for layouts outside
    :func:`triton_supported`)."""
    from kv_hqekv.kernels.reference import transcode_ref
    from kv_hqekv.normalized import normal_bounds
    from kvcodec import normal_codebook

    if not triton_supported(source, axis, group_size):
        return transcode_ref(source, bits, axis, group_size)
    Nu, U = source.tier.shape
    D, dtype, device = source.head_dim, source.dtype, source.tier.device
    G = group_size
    normal = bits == 1
    sdt = dtype if normal else scale_dtype_for(dtype, bits)
    PW = packed_width(D, bits)
    C = D if axis == "channel" else -(-D // G)
    codes = torch.zeros(Nu, U, PW, dtype=torch.uint8, device=device)
    gshape = (Nu, 1, D) if axis == "channel" else (Nu, U, C)
    scales = torch.zeros(gshape, dtype=sdt, device=device)
    zeros = torch.zeros(gshape, dtype=dtype, device=device)
    bounds = normal_bounds(bits).to(device)
    args, meta = side_args(source)
    common = dict(
        D=D,
        BLOCK_D=max(_pow2(D), G if axis == "token" else 1, 8),  # whole groups, whole packed bytes
        PW=PW,
        BITS=bits,
        NORMAL=normal,
        SDT=_SDT[sdt],
        FLOOR=scale_floor(sdt, bits),
        FMAX=float(torch.finfo(dtype).max),
        OUT=OUT_CODE[dtype],
        **meta,
    )
    if Nu * U:
        if axis == "channel":
            _transcode_channel_kernel[(Nu,)](
                codes, scales, zeros, bounds, *args, U, BLOCK_U=_pow2(U), **common,
                num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
        else:
            N = Nu * U
            _transcode_token_kernel[(triton.cdiv(N, block_r),)](
                codes, scales, zeros, bounds, *args, N, BLOCK_R=block_r, G=G, **common,
                num_warps=num_warps, enable_fp_fusion=False,
            )  # fmt: skip
    if scales.numel() and not bool(torch.isfinite(scales).all()):
        raise ValueError(f"held entries have a group spread too large for {sdt} statistics at bits={bits}")
    return QuantizedTensor(
        codes=codes,
        scales=scales,
        zeros=zeros,
        bits=bits,
        axis=axis,
        group_size=G,
        shape=(Nu, U, D),
        dtype=dtype,
        codebook=normal_codebook(bits).to(device) if normal else None,
    )
