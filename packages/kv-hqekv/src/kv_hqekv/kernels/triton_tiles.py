"""Triton device helpers shared by the HqeKV kernels: load a tile of a :class:`~kv_hqekv.kernels.TieredSide`,
dequantizing each entry from its own tier in registers.

An entry's tier selects one of four masked loads (the full row, or the packed code row of the 4-, 2- or 1-bit tier
with its group parameters); every other lane is masked off, so only the bytes of the entry's own tier are read.
Code rows are dequantized as the store's quantizers do -- ``zero + code·scale`` (uniform) or
``codebook[code]·scale + zero`` (normalized) in float32, clamped to the cache dtype's range and rounded to it --
which is bit-exact when the kernels are compiled without FMA contraction (the launchers ask for that).

This module needs ``triton``; the dispatchers import it lazily for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.kernels.triton_attention import code_lanes
from kvcodec.kernels.triton_dot import DOT_CODE, cache_round

OUT_CODE = DOT_CODE  # the cache dtype's rounding code, as kvcodec's kernels use it


@triton.jit
def _tier_dequant(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    cb_ptr,
    row,
    grp,
    sel,
    d,
    dmask,
    PW,
    C,
    BITS: tl.constexpr,
    GCOL: tl.constexpr,
    CB: tl.constexpr,
    D: tl.constexpr,
):
    """float32 ``[R, BLOCK_D]``: code rows ``row`` (group rows ``grp``) of one tier where ``sel``, 0 elsewhere."""
    m2 = sel[:, None] & dmask[None, :]
    r = tl.where(sel, row, 0).to(tl.int64)
    g = tl.where(sel, grp, 0).to(tl.int64)
    if d.shape[0] == D:  # a power-of-two head dim: each code row read as one run of bytes, split into lanes
        code = code_lanes(codes_ptr, r, sel, PW, BITS, D)
    else:
        CPB: tl.constexpr = 8 // BITS
        byte = d // CPB
        sh = (d % CPB) * BITS
        packed = tl.load(codes_ptr + r[:, None] * PW + byte[None, :], mask=m2, other=0).to(tl.int32)
        code = (packed >> sh[None, :]) & ((1 << BITS) - 1)
    col = d // GCOL
    s = tl.load(scales_ptr + g[:, None] * C + col[None, :], mask=m2, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + g[:, None] * C + col[None, :], mask=m2, other=0.0).to(tl.float32)
    if CB:
        level = tl.load(cb_ptr + code, mask=m2, other=0.0).to(tl.float32)
        y = level * s + z
    else:
        y = z + code.to(tl.float32) * s
    return y


@triton.jit
def _side_tile(
    tier_ptr,
    row_ptr,
    grp_ptr,
    base,
    emask,
    full_ptr,
    c4,
    s4,
    z4,
    k4,
    c2,
    s2,
    z2,
    k2,
    c1,
    s1,
    z1,
    k1,
    d,
    dmask,
    C,
    PW4,
    PW2,
    PW1,
    D: tl.constexpr,
    GCOL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS4: tl.constexpr,
    HAS2: tl.constexpr,
    HAS1: tl.constexpr,
    CB4: tl.constexpr,
    CB2: tl.constexpr,
    CB1: tl.constexpr,
    FMAX: tl.constexpr,
    OUT: tl.constexpr,
):
    """``(rows float32 [R, BLOCK_D], tier int32 [R])`` of the entries ``base`` (where ``emask``) of one side."""
    tier = tl.load(tier_ptr + base, mask=emask, other=0).to(tl.int32)
    row = tl.load(row_ptr + base, mask=emask, other=0)
    grp = tl.load(grp_ptr + base, mask=emask, other=0)
    y = tl.zeros([ROWS, BLOCK_D], tl.float32)
    if HAS4:
        y = tl.where(
            (tier == 4)[:, None],
            _tier_dequant(c4, s4, z4, k4, row, grp, tier == 4, d, dmask, PW4, C, 4, GCOL, CB4, D),
            y,
        )
    if HAS2:
        y = tl.where(
            (tier == 2)[:, None],
            _tier_dequant(c2, s2, z2, k2, row, grp, tier == 2, d, dmask, PW2, C, 2, GCOL, CB2, D),
            y,
        )
    if HAS1:
        y = tl.where(
            (tier == 1)[:, None],
            _tier_dequant(c1, s1, z1, k1, row, grp, tier == 1, d, dmask, PW1, C, 1, GCOL, CB1, D),
            y,
        )
    y = cache_round(tl.minimum(tl.maximum(y, -FMAX), FMAX), OUT)
    full = tier == 16
    f = tl.where(full, row, 0).to(tl.int64)
    fv = tl.load(full_ptr + f[:, None] * D + d[None, :], mask=full[:, None] & dmask[None, :], other=0.0)
    return tl.where(full[:, None], fv.to(tl.float32), y), tier


def side_args(side) -> tuple[list, dict]:
    """Pointer/scalar arguments and constexprs of one side for :func:`_side_tile` (prefix-free names)."""
    device = side.full.device
    dummy_u8 = torch.zeros(1, dtype=torch.uint8, device=device)
    dummy_f = torch.zeros(1, dtype=torch.float32, device=device)
    ptrs, pws, meta = [], [], {}
    for b in (4, 2, 1):
        t = side.tiers.get(b)
        if t is None or t.codes.shape[0] == 0:
            ptrs += [dummy_u8, dummy_f, dummy_f, dummy_f]
            pws.append(1)
            meta[f"HAS{b}"], meta[f"CB{b}"] = False, False
            continue
        cb = dummy_f if t.codebook is None else t.codebook.float().to(device).contiguous()
        ptrs += [t.codes.contiguous(), t.scales.contiguous(), t.zeros.contiguous(), cb]
        pws.append(t.codes.shape[1])
        meta[f"HAS{b}"], meta[f"CB{b}"] = True, t.codebook is not None
    full = (
        side.full.contiguous() if side.full.shape[0] else torch.zeros(1, side.head_dim, dtype=side.dtype, device=device)
    )
    D = side.head_dim
    C = D if side.axis == "channel" else -(-D // side.group_size)
    maps = [side.tier.contiguous(), side.row.contiguous(), side.group.contiguous(), full]
    meta["GCOL"] = 1 if side.axis == "channel" else side.group_size
    return [*maps, *ptrs, C, *pws], meta
