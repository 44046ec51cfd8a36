"""Triton kernels: fused min-max quantize + bit-pack, and fused unpack + dequantize, for both grouping axes.

Same signatures and bit-identical results as :mod:`kvcodec.kernels.reference` (codes, scales and zeros
exactly; dequantized values exactly when compiled without FMA contraction, which the launchers request).
The scale rule is :mod:`kvcodec.stats`; divisions use ``tl.math.div_rn`` (IEEE round-to-nearest,
plain ``/`` is an approximate division on NVIDIA GPUs) and rounding is half-to-even like ``torch.round``.

Layout (few programs, large blocks):

* ``axis="token"`` (groups of G channels of one token, KIVI values): a program owns ``BLOCK_R`` token rows
  and the whole head dimension. With G a power of two (or G >= D) the tile is reshaped to
  ``[BLOCK_R, D/G, G]`` and reduced in registers; otherwise the group statistics are reduced on a
  ``[BLOCK_R, groups, G]`` gathered tile, stored, and read back per element after a barrier.
* ``axis="channel"`` (groups of G tokens of one channel, KIVI keys): a program owns one group of G token
  rows and the whole head dimension and reduces along the rows.

Codes are packed along D in both cases (the ``kvcore.QuantizedTensor`` layout): for b in {1, 2, 4} the
``8/b`` codes of a byte are combined with shifts, for b = 3 eight codes form a 24-bit word stored as
3 bytes, for b = 8 a code is a byte.

This module needs ``triton``; import it lazily (``kvcodec.kernels.dispatch`` does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvcodec.stats import scale_dtype_for, scale_floor
from kvcore import packed_width

_SDT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# --------------------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _bf16_rtne(x):
    """float32 -> bfloat16 with round-to-nearest-even, in integer arithmetic.

    Same result as the GPU conversion; the interpreter's own fp32 -> bf16 cast truncates instead.
    Finite inputs within the bf16 range only (callers clamp).
    """
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_scale_dtype(s, SDT: tl.constexpr):
    """Round float32 ``s`` to the scale storage dtype (0 fp32, 1 fp16, 2 bf16), back as float32."""
    if SDT == 1:
        s = s.to(tl.float16).to(tl.float32)
    elif SDT == 2:
        s = _bf16_rtne(s).to(tl.float32)
    return s


@triton.jit
def _cast_out(y, OUT_BF16: tl.constexpr, out_ty: tl.constexpr):
    """Round-to-nearest-even cast of float32 ``y`` to the output element type."""
    r = _bf16_rtne(y) if OUT_BF16 else y.to(out_ty)
    return r


@triton.jit
def _next_up(s, SDT: tl.constexpr):
    """Next value of the scale dtype above the positive float32 values ``s``."""
    if SDT == 0:
        r = (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    elif SDT == 1:
        r = (s.to(tl.float16).to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        r = (_bf16_rtne(s).to(tl.int16, bitcast=True) + 1).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return r


@triton.jit
def _minmax_scale(span, LEVELS: tl.constexpr, SDT: tl.constexpr, FLOOR: tl.constexpr):
    """``kvcodec.stats.minmax_scale`` on float32 ``span = max - min``."""
    s = _to_scale_dtype(tl.math.div_rn(span, tl.full(span.shape, LEVELS, tl.float32)), SDT)
    s = tl.maximum(s, tl.full(span.shape, FLOOR, tl.float32))
    for _ in tl.static_range(2):
        s = tl.where(tl.math.div_rn(span, s) >= LEVELS + 0.5, _next_up(s, SDT), s)
    return s


@triton.jit
def _codes(x, lo, s, LEVELS: tl.constexpr):
    """``round_half_even((x - lo) / s)`` clamped to ``[0, LEVELS]``, as int32.

    Clamping before rounding gives the same codes (LEVELS is odd) and keeps padding lanes finite.
    """
    v = tl.minimum(tl.maximum(tl.math.div_rn(x - lo, s), 0.0), LEVELS)
    r = tl.floor(v)
    f = v - r
    odd = (r.to(tl.int32) & 1) == 1
    up = (f > 0.5) | ((f == 0.5) & odd)
    return (r + up.to(tl.float32)).to(tl.int32)


@triton.jit
def _pack_store(
    codes_ptr, row_off, row_mask, c, PW: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Pack int32 codes ``c [ROWS, BLOCK_D]`` (zero past D) along the last dim and store ``PW`` bytes per row."""
    if BITS == 8:
        cols = tl.arange(0, BLOCK_D)
        tl.store(
            codes_ptr + row_off[:, None] + cols[None, :], c.to(tl.uint8), mask=row_mask[:, None] & (cols[None, :] < PW)
        )
    elif BITS == 3:
        NC: tl.constexpr = BLOCK_D // 8
        shifts = tl.arange(0, 8) * BITS
        word = tl.sum(tl.reshape(c, (ROWS, NC, 8)) << shifts[None, None, :], axis=2)
        chunk = tl.arange(0, NC)
        for k in tl.static_range(BITS):
            byte = ((word >> (8 * k)) & 0xFF).to(tl.uint8)
            off = chunk * BITS + k
            tl.store(codes_ptr + row_off[:, None] + off[None, :], byte, mask=row_mask[:, None] & (off[None, :] < PW))
    else:
        CPB: tl.constexpr = 8 // BITS
        NB: tl.constexpr = BLOCK_D // CPB
        shifts = tl.arange(0, CPB) * BITS
        byte = tl.sum(tl.reshape(c, (ROWS, NB, CPB)) << shifts[None, None, :], axis=2).to(tl.uint8)
        nb = tl.arange(0, NB)
        tl.store(codes_ptr + row_off[:, None] + nb[None, :], byte, mask=row_mask[:, None] & (nb[None, :] < PW))


@triton.jit
def _load_unpack(
    codes_ptr, row_off, row_mask, PW: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Load ``PW`` packed bytes per row and return the int32 codes ``[ROWS, BLOCK_D]`` (garbage past D)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        cols = tl.arange(0, BLOCK_D)
        c = tl.load(
            codes_ptr + row_off[:, None] + cols[None, :], mask=row_mask[:, None] & (cols[None, :] < PW), other=0
        ).to(tl.int32)
    elif BITS == 3:
        NC: tl.constexpr = BLOCK_D // 8
        chunk = tl.arange(0, NC)
        word = tl.zeros((ROWS, NC), dtype=tl.int32)
        for k in tl.static_range(BITS):
            off = chunk * BITS + k
            byte = tl.load(
                codes_ptr + row_off[:, None] + off[None, :], mask=row_mask[:, None] & (off[None, :] < PW), other=0
            ).to(tl.int32)
            word = word | (byte << (8 * k))
        shifts = tl.arange(0, 8) * BITS
        c = tl.reshape((word[:, :, None] >> shifts[None, None, :]) & MASK, (ROWS, BLOCK_D))
    else:
        CPB: tl.constexpr = 8 // BITS
        NB: tl.constexpr = BLOCK_D // CPB
        nb = tl.arange(0, NB)
        byte = tl.load(
            codes_ptr + row_off[:, None] + nb[None, :], mask=row_mask[:, None] & (nb[None, :] < PW), other=0
        ).to(tl.int32)
        shifts = tl.arange(0, CPB) * BITS
        c = tl.reshape((byte[:, :, None] >> shifts[None, None, :]) & MASK, (ROWS, BLOCK_D))
    return c


# --------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _quant_token_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    R,
    D: tl.constexpr,
    PW: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    NGP: tl.constexpr,
    GP: tl.constexpr,
    RESHAPE: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    SDT: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows64[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if RESHAPE:
        # G is a power of two dividing BLOCK_D (or one group spans the row): reduce in registers.
        NGB: tl.constexpr = BLOCK_D // GB
        g = tl.arange(0, NGB)
        col3 = g[:, None] * GB + tl.arange(0, GB)[None, :]
        valid3 = (col3 < D)[None, :, :]
        x3 = tl.reshape(x, (BLOCK_R, NGB, GB))
        gmask = g < NG
        lo = tl.where(gmask[None, :], tl.min(tl.where(valid3, x3, float("inf")), axis=2), 0.0)
        hi = tl.where(gmask[None, :], tl.max(tl.where(valid3, x3, float("-inf")), axis=2), 0.0)
        s = _minmax_scale(hi - lo, LEVELS, SDT, FLOOR)
        soff = rows64[:, None] * NG + g[None, :]
        smask = rmask[:, None] & gmask[None, :]
        tl.store(scales_ptr + soff, s.to(scales_ptr.dtype.element_ty), mask=smask)
        tl.store(zeros_ptr + soff, lo.to(zeros_ptr.dtype.element_ty), mask=smask)
        c3 = _codes(x3, lo[:, :, None], s[:, :, None], LEVELS)
        c = tl.reshape(c3, (BLOCK_R, BLOCK_D))
    else:
        # Any other G: reduce a gathered [rows, groups, G] tile, publish the statistics, read them per element.
        g = tl.arange(0, NGP)
        i = tl.arange(0, GP)
        col3 = g[:, None] * G + i[None, :]
        valid3 = (i[None, :] < G) & (col3 < D)
        m3 = rmask[:, None, None] & valid3[None, :, :]
        x3 = tl.load(x_ptr + rows64[:, None, None] * D + col3[None, :, :], mask=m3, other=0.0).to(tl.float32)
        gmask = g < NG
        lo = tl.where(gmask[None, :], tl.min(tl.where(m3, x3, float("inf")), axis=2), 0.0)
        hi = tl.where(gmask[None, :], tl.max(tl.where(m3, x3, float("-inf")), axis=2), 0.0)
        s = _minmax_scale(hi - lo, LEVELS, SDT, FLOOR)
        soff = rows64[:, None] * NG + g[None, :]
        smask = rmask[:, None] & gmask[None, :]
        tl.store(scales_ptr + soff, s.to(scales_ptr.dtype.element_ty), mask=smask)
        tl.store(zeros_ptr + soff, lo.to(zeros_ptr.dtype.element_ty), mask=smask)
        tl.debug_barrier()
        eoff = rows64[:, None] * NG + (cols // G)[None, :]
        s_el = tl.load(scales_ptr + eoff, mask=m2, other=1.0).to(tl.float32)
        z_el = tl.load(zeros_ptr + eoff, mask=m2, other=0.0).to(tl.float32)
        c = _codes(x, z_el, s_el, LEVELS)
    c = tl.where(cmask[None, :], c, 0)
    _pack_store(codes_ptr, rows64 * PW, rmask, c, PW, BITS, BLOCK_R, BLOCK_D)


@triton.jit
def _quant_channel_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    T,
    NGT,
    D: tl.constexpr,
    PW: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    SDT: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    mi = (pid // NGT).to(tl.int64)
    gt = pid % NGT
    i = tl.arange(0, GP)
    t = gt * G + i
    rmask = (i < G) & (t < T)
    rows64 = mi * T + t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows64[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    lo = tl.where(cmask, tl.min(tl.where(m2, x, float("inf")), axis=0), 0.0)
    hi = tl.where(cmask, tl.max(tl.where(m2, x, float("-inf")), axis=0), 0.0)
    s = _minmax_scale(hi - lo, LEVELS, SDT, FLOOR)
    soff = (mi * NGT + gt) * D + cols
    tl.store(scales_ptr + soff, s.to(scales_ptr.dtype.element_ty), mask=cmask)
    tl.store(zeros_ptr + soff, lo.to(zeros_ptr.dtype.element_ty), mask=cmask)
    c = _codes(x, lo[None, :], s[None, :], LEVELS)
    c = tl.where(cmask[None, :], c, 0)
    _pack_store(codes_ptr, rows64 * PW, rmask, c, PW, BITS, GP, BLOCK_D)


@triton.jit
def _dequant_token_kernel(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    R,
    D: tl.constexpr,
    PW: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,
    GB: tl.constexpr,
    RESHAPE: tl.constexpr,
    BITS: tl.constexpr,
    FMAX: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    c = _load_unpack(codes_ptr, rows64 * PW, rmask, PW, BITS, BLOCK_R, BLOCK_D).to(tl.float32)
    if RESHAPE:
        NGB: tl.constexpr = BLOCK_D // GB
        g = tl.arange(0, NGB)
        soff = rows64[:, None] * NG + g[None, :]
        smask = rmask[:, None] & (g < NG)[None, :]
        s = tl.load(scales_ptr + soff, mask=smask, other=1.0).to(tl.float32)
        z = tl.load(zeros_ptr + soff, mask=smask, other=0.0).to(tl.float32)
        y = tl.reshape(z[:, :, None] + tl.reshape(c, (BLOCK_R, NGB, GB)) * s[:, :, None], (BLOCK_R, BLOCK_D))
    else:
        eoff = rows64[:, None] * NG + (cols // G)[None, :]
        s = tl.load(scales_ptr + eoff, mask=m2, other=1.0).to(tl.float32)
        z = tl.load(zeros_ptr + eoff, mask=m2, other=0.0).to(tl.float32)
        y = z + c * s
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    tl.store(out_ptr + rows64[:, None] * D + cols[None, :], _cast_out(y, OUT_BF16, out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _dequant_channel_kernel(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    T,
    NGT,
    D: tl.constexpr,
    PW: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BITS: tl.constexpr,
    FMAX: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    mi = (pid // NGT).to(tl.int64)
    gt = pid % NGT
    i = tl.arange(0, GP)
    t = gt * G + i
    rmask = (i < G) & (t < T)
    rows64 = mi * T + t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    soff = (mi * NGT + gt) * D + cols
    s = tl.load(scales_ptr + soff, mask=cmask, other=1.0).to(tl.float32)
    z = tl.load(zeros_ptr + soff, mask=cmask, other=0.0).to(tl.float32)
    c = _load_unpack(codes_ptr, rows64 * PW, rmask, PW, BITS, GP, BLOCK_D).to(tl.float32)
    y = z[None, :] + c * s[None, :]
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    tl.store(
        out_ptr + rows64[:, None] * D + cols[None, :],
        _cast_out(y, OUT_BF16, out_ptr.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


# --------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _token_layout(D: int, G: int) -> tuple[int, bool, int, int, int]:
    """``(BLOCK_D, RESHAPE, GB, NGP, GP)`` for token-axis groups of ``G`` channels in rows of ``D``."""
    block_d = max(8, _pow2(D))
    reshape = G >= D or (G & (G - 1)) == 0
    gb = block_d if G >= D else min(G, block_d)
    ng = -(-D // G)
    return block_d, reshape, gb, _pow2(ng), _pow2(min(G, D))


def _block_rows(R: int, block_d: int, block_rows: int | None) -> int:
    if block_rows is not None:
        return _pow2(block_rows)
    return max(1, min(_pow2(R), max(1, 4096 // block_d)))


def quantize_pack_triton(
    x: torch.Tensor, bits: int, axis: str, group_size: int, *, block_rows: int | None = None, num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton :func:`~kvcodec.kernels.reference.quantize_pack_ref`.

    ``block_rows`` (token axis) sets the token rows per program; the default aims at 4096 elements per
    program. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
    """
    *lead, T, D = x.shape
    M = math.prod(lead)
    G = group_size
    x = x.contiguous()
    sdt = scale_dtype_for(x.dtype, bits)
    PW = packed_width(D, bits)
    codes = torch.empty(*lead, T, PW, dtype=torch.uint8, device=x.device)
    gshape = (T, -(-D // G)) if axis == "token" else (-(-T // G), D)
    scales = torch.empty(*lead, *gshape, dtype=sdt, device=x.device)
    zeros = torch.empty(*lead, *gshape, dtype=x.dtype, device=x.device)
    if codes.numel() == 0 or scales.numel() == 0:
        return codes, scales, zeros
    common = dict(BITS=bits, LEVELS=float((1 << bits) - 1), SDT=_SDT[sdt], FLOOR=scale_floor(sdt, bits))
    launch = dict(num_warps=num_warps, enable_fp_fusion=False)
    if axis == "token":
        R = M * T
        block_d, reshape, gb, ngp, gp = _token_layout(D, G)
        br = _block_rows(R, block_d, block_rows)
        _quant_token_kernel[(triton.cdiv(R, br),)](
            x,
            codes,
            scales,
            zeros,
            R,
            D=D,
            PW=PW,
            NG=gshape[1],
            G=G,
            GB=gb,
            NGP=ngp,
            GP=gp,
            RESHAPE=reshape,
            BLOCK_R=br,
            BLOCK_D=block_d,
            **common,
            **launch,
        )
    else:
        NGT = gshape[0]
        _quant_channel_kernel[(M * NGT,)](
            x,
            codes,
            scales,
            zeros,
            T,
            NGT,
            D=D,
            PW=PW,
            G=G,
            GP=_pow2(min(G, T)),
            BLOCK_D=max(8, _pow2(D)),
            **common,
            **launch,
        )
    return codes, scales, zeros


def unpack_dequantize_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    axis: str,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    block_rows: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton :func:`~kvcodec.kernels.reference.unpack_dequantize_ref`."""
    *lead, T, D = shape
    M = math.prod(lead)
    G = group_size
    codes, scales, zeros = codes.contiguous(), scales.contiguous(), zeros.contiguous()
    out = torch.empty(*shape, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    PW = packed_width(D, bits)
    fmax = float(torch.finfo(dtype).max)
    launch = dict(num_warps=num_warps, enable_fp_fusion=False, OUT_BF16=dtype == torch.bfloat16)
    if axis == "token":
        R = M * T
        block_d, reshape, gb, _, _ = _token_layout(D, G)
        br = _block_rows(R, block_d, block_rows)
        _dequant_token_kernel[(triton.cdiv(R, br),)](
            codes,
            scales,
            zeros,
            out,
            R,
            D=D,
            PW=PW,
            NG=-(-D // G),
            G=G,
            GB=gb,
            RESHAPE=reshape,
            BITS=bits,
            FMAX=fmax,
            BLOCK_R=br,
            BLOCK_D=block_d,
            **launch,
        )
    else:
        NGT = -(-T // G)
        _dequant_channel_kernel[(M * NGT,)](
            codes,
            scales,
            zeros,
            out,
            T,
            NGT,
            D=D,
            PW=PW,
            G=G,
            GP=_pow2(min(G, T)),
            BITS=bits,
            FMAX=fmax,
            BLOCK_D=max(8, _pow2(D)),
            **launch,
        )
    return out
