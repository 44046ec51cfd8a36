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

import functools

import torch
import triton
import triton.language as tl

from kv_hqekv.kernels.blocked import BlockedSide
from kvcodec.kernels.triton_attention import code_lanes, group_params
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
    s, z = group_params(scales_ptr, zeros_ptr, g, sel, d, C, GCOL, D)
    if CB:
        level = tl.load(cb_ptr + code, mask=m2, other=0.0).to(tl.float32)
        y = level * s + z
    else:
        y = z + code.to(tl.float32) * s
    return y


@triton.jit
def _entry_maps(tier_ptr, row_ptr, grp_ptr, base, emask):
    """Per-entry ``(tier int32, row, group)`` of the entries ``base`` (where ``emask``) read from the maps of a
    :class:`~kv_hqekv.kernels.TieredSide` (tier 0 elsewhere)."""
    tier = tl.load(tier_ptr + base, mask=emask, other=0).to(tl.int32)
    row = tl.load(row_ptr + base, mask=emask, other=0)
    grp = tl.load(grp_ptr + base, mask=emask, other=0)
    return tier, row, grp


@triton.jit
def _block_maps(tier_ptr, row_ptr, grp_ptr, tail, seg, t, nb, held, A, NB,
                G: tl.constexpr, GROUP_IS_ROW: tl.constexpr):  # fmt: skip
    """Per-entry ``(tier int32, row int64, group int64)`` of slots ``t`` of head ``seg`` from the block maps of a
    :class:`~kv_hqekv.kernels.blocked.BlockedSide` (block ``t // G``, or the tail; ``nb``, ``held`` and ``tail``
    the head's scalars, ``A`` the entries appended since the layout was taken: full rows moved by ``seg·A``)."""
    shift = seg * A
    in_block = t < nb * G
    b_off = seg * NB + t // G
    btier = tl.load(tier_ptr + b_off, mask=in_block, other=0).to(tl.int32)
    brow = tl.load(row_ptr + b_off, mask=in_block, other=0).to(tl.int64) + t % G
    brow = tl.where(btier == 16, brow + shift, brow)
    in_tail = (t >= nb * G) & (t < held + A)
    tier = tl.where(in_block, btier, tl.where(in_tail, 16, 0))
    row = tl.where(in_block, brow, tail + shift + (t - nb * G))
    if GROUP_IS_ROW:  # noqa: SIM108 (a compile-time branch: only one side is traced)
        grp = row
    else:
        grp = tl.load(grp_ptr + b_off, mask=in_block, other=0).to(tl.int64)
    return tier, row, grp


@triton.jit
def _mapped_rows(
    tier,
    row,
    grp,
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
    """float32 ``[R, BLOCK_D]``: the entries of one side with maps ``(tier, row, grp)``, dequantized from their tiers
    (0 where ``tier`` is 0)."""
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
    return tl.where(full[:, None], fv.to(tl.float32), y)


@functools.lru_cache(maxsize=8)
def _dummies(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-element uint8, float32 and int32 tensors on ``device``: the pointers of absent tables (never read)."""
    return tuple(torch.zeros(1, dtype=dt, device=device) for dt in (torch.uint8, torch.float32, torch.int32))


def side_args(side) -> tuple[list, dict]:
    """Pointer/scalar arguments and constexprs of one side for :func:`_entry_maps` / :func:`_block_maps` and
    :func:`_mapped_rows` (prefix-free names): the maps,
    the full rows, the code tables. A :class:`~kv_hqekv.kernels.blocked.BlockedSide` gives its block maps (tier,
    row, group -- a dummy where every entry is its own parameter row, ``GROUP_IS_ROW``) for :func:`_block_maps`."""
    device = side.full.device
    dummy_u8, dummy_f, dummy_i = _dummies(device)
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
    group = side.group
    if isinstance(side, BlockedSide):
        meta["GROUP_IS_ROW"] = group is None
        group = dummy_i if group is None else group
    maps = [side.tier.contiguous(), side.row.contiguous(), group.contiguous(), full]
    meta["GCOL"] = 1 if side.axis == "channel" else side.group_size
    return [*maps, *ptrs, C, *pws], meta
