"""Triton kernel: dequantize + overlay merge of one part of a HEX layer (HEX §3.5), for ``read`` and full mode.

``_side_tile`` reconstructs a tile of entries of one side (keys or values) in registers: a packed code row (two bytes
per code read and shifted, which covers every width including 3) dequantized as ``code · scale + zero`` in float32
and rounded to the cache dtype exactly as :func:`kv_hex.kernels.reference.dequantize_part` does (no FMA
contraction; bf16 rounded to nearest even in integer arithmetic, as the GPU does), the static mask's overlay
elements of the entry's (slot, head) replaced by their full-precision values, or a full-precision row. The fused
decode-attention kernel (:mod:`kv_hex.kernels.triton_attention`) uses the same tile loader. Loop bounds are
compile-time constants, so the kernels run in Triton's interpreter. GPU speed is unmeasured.

This module needs ``triton``; :mod:`kv_hex.kernels.dispatch` imports it lazily.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcodec.kernels.triton_dot import DOT_CODE, cache_round

__all__ = ["dequantize_part_triton", "side_args"]  # _side_tile, _entry_tile: kernel helpers

_OUT = DOT_CODE  # the cache dtype's rounding code, as kvcodec's kernels use it


@triton.jit
def _side_tile(
    IDX, CODES, ROWS, SCALE, ZERO, GRP, OVER, OOFF, HCOLS,
    e, emask, slot, h, d, PW,
    H: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, PER_CHANNEL: tl.constexpr, W: tl.constexpr,
    OUT: tl.constexpr,
):  # fmt: skip
    """float32 ``[BT, BLOCK_D]`` tile of entries ``e`` (``emask``: real entries) at mask rows ``slot``, heads ``h``."""
    idx = tl.load(IDX + e, mask=emask, other=0)
    quant = (idx >= 0) & emask
    isfull = (idx < 0) & emask
    r = tl.where(quant, idx, 0).to(tl.int64)
    f = tl.where(isfull, -1 - idx, 0).to(tl.int64)
    g = tl.load(GRP + e, mask=quant, other=0).to(tl.int64)
    off = tl.load(OOFF + e, mask=quant, other=0).to(tl.int64) if W > 0 else r  # r: never read without an overlay
    return _entry_tile(CODES, ROWS, SCALE, ZERO, OVER, HCOLS, quant, isfull, r, f, g, off, slot, h, d, PW,
                       H, D, BITS, PER_CHANNEL, W, OUT)  # fmt: skip


@triton.jit
def _entry_tile(
    CODES, ROWS, SCALE, ZERO, OVER, HCOLS,
    quant, isfull, r, f, g, off, slot, h, d, PW,
    H: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, PER_CHANNEL: tl.constexpr, W: tl.constexpr,
    OUT: tl.constexpr,
):  # fmt: skip
    """float32 ``[BT, BLOCK_D]`` tile of entries whose addresses are given: ``quant`` / ``isfull`` (coded / full
    entries; neither: masked off), code row ``r``, full row ``f``, statistics row ``g``, first overlay value
    ``off``, mask row ``slot`` and head ``h`` (int64 where they index). ``PER_CHANNEL``: 0, one statistic per
    entry (values); 1, a row of per-channel statistics per entry; 2, one row for every entry of the tile (``g`` a
    scalar: a segment's keys of one head)."""
    dmask = d < D
    m2 = quant[:, None] & dmask[None, :]
    bitpos = d * BITS
    byte = bitpos // 8
    sh = bitpos % 8
    b0 = tl.load(CODES + r[:, None] * PW + byte[None, :], mask=m2, other=0).to(tl.int32)
    b1 = tl.load(CODES + r[:, None] * PW + byte[None, :] + 1, mask=m2 & ((byte + 1) < PW)[None, :], other=0)
    word = b0 | (b1.to(tl.int32) << 8)
    code = ((word >> sh[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    if PER_CHANNEL == 2:  # one statistics row for the whole tile: ``g`` is a scalar row
        s = tl.load(SCALE + g * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(ZERO + g * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    elif PER_CHANNEL:
        s = tl.load(SCALE + g[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        z = tl.load(ZERO + g[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    else:
        s = tl.load(SCALE + g, mask=quant, other=0.0).to(tl.float32)[:, None]
        z = tl.load(ZERO + g, mask=quant, other=0.0).to(tl.float32)[:, None]
    deq = code * s + z
    deq = cache_round(deq, OUT)
    if W > 0:
        hc = (slot.to(tl.int64) * H + h) * W
        for j in range(W):
            c = tl.load(HCOLS + hc + j, mask=quant, other=-1)
            ok = quant & (c >= 0)
            val = tl.load(OVER + off + j, mask=ok, other=0.0).to(tl.float32)
            deq = tl.where((d[None, :] == c[:, None]) & ok[:, None], val[:, None], deq)
    fv = tl.load(ROWS + f[:, None] * D + d[None, :], mask=isfull[:, None] & dmask[None, :], other=0.0)
    return tl.where(quant[:, None], deq, fv.to(tl.float32))


@triton.jit
def _dequantize(
    SEG, SLOT, HCOLS, OUTK, OUTV,
    KIDX, KCODES, KROWS, KSCALE, KZERO, KGRP, KOVER, KOOFF,
    VIDX, VCODES, VROWS, VSCALE, VZERO, VGRP, VOVER, VOOFF,
    N, KPW, VPW,
    H: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr,
    VPC: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    e = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    emask = e < N
    d = tl.arange(0, BLOCK_D)
    seg = tl.load(SEG + e, mask=emask, other=0)
    slot = tl.load(SLOT + e, mask=emask, other=0)
    h = seg % H
    omask = emask[:, None] & (d < D)[None, :]
    k = _side_tile(KIDX, KCODES, KROWS, KSCALE, KZERO, KGRP, KOVER, KOOFF, HCOLS, e, emask, slot, h, d, KPW,
                   H, D, BITS, True, W, OUT)  # fmt: skip
    tl.store(OUTK + e[:, None] * D + d[None, :], k.to(OUTK.dtype.element_ty), mask=omask)
    v = _side_tile(VIDX, VCODES, VROWS, VSCALE, VZERO, VGRP, VOVER, VOOFF, HCOLS, e, emask, slot, h, d, VPW,
                   H, D, BITS, VPC, W, OUT)  # fmt: skip
    tl.store(OUTV + e[:, None] * D + d[None, :], v.to(OUTV.dtype.element_ty), mask=omask)


@functools.lru_cache(maxsize=64)
def _dummy(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _nonempty(t: torch.Tensor, shape: tuple[int, ...], dtype=None) -> torch.Tensor:
    """``t`` contiguous, or a small dummy of ``dtype`` when it is empty (never read: masked off; cached per shape,
    dtype and device, so a decode step allocates none)."""
    if t.numel():
        return t.contiguous()
    return _dummy(tuple(shape), dtype or t.dtype, str(t.device))


def side_args(side, D: int) -> tuple:
    """Kernel arguments of one :class:`~kv_hex.layout.SideLayout`: eight pointers and the packed width."""
    pw = side.codes.shape[1]
    return (
        _nonempty(side.idx, (1,)),
        _nonempty(side.codes, (1, max(pw, 1))),
        _nonempty(side.rows, (1, D)),
        _nonempty(side.scale, (1,), torch.float32),
        _nonempty(side.zero, (1,), torch.float32),
        _nonempty(side.grp, (1,)),
        _nonempty(side.over, (1,), side.rows.dtype),
        _nonempty(side.ooff, (1,)),
    ), pw


def dequantize_part_triton(part, block_t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kv_hex.kernels.reference.dequantize_part` (same arguments, bit-identical results)."""
    N, D, dtype = part.num_entries, part.D, part.dtype
    device = part.k.idx.device
    k = torch.empty(N, D, dtype=dtype, device=device)
    v = torch.empty(N, D, dtype=dtype, device=device)
    if N == 0 or D == 0:
        return k, v
    kargs, kpw = side_args(part.k, D)
    vargs, vpw = side_args(part.v, D)
    seg = part.seg().to(torch.int32)
    hcols = _nonempty(part.hcols, (1,))
    _dequantize[(triton.cdiv(N, block_t),)](
        seg, part.slot.contiguous(), hcols, k, v, *kargs, *vargs, N, kpw, vpw,
        H=part.H, D=D, BITS=part.bits, W=part.hcols.shape[-1], OUT=_OUT[dtype], VPC=part.v.per_channel,
        BT=block_t, BLOCK_D=triton.next_power_of_2(D),
        enable_fp_fusion=False,  # code * scale + zero rounded twice, as the reference
    )  # fmt: skip
    return k, v
