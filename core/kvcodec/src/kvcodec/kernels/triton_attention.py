"""Triton kernel: decode attention over a :class:`~kvcodec.attention.QuantizedSegment`, dequantizing in registers.

One program per (batch row, KV head, split) owns the ``Hq/Hkv * Q`` query rows of that head (GQA without repeating
K/V) and walks ``TILES`` (a compile-time count) tiles of ``BLOCK_T`` of the head's ``T`` entries with an online
softmax (FlashAttention, Dao et al. 2022, §3.1); the head's entries are split across programs (Flash-Decoding: a
decode step has one query per head, so without the split a GPU would run ``B * Hkv`` programs) and the splits'
normalized outputs are merged by log-sum-exp in a second, small kernel (one launch, not a chain of tensor ops).
``T`` is a run-time argument and the split count the grid's second dimension, so a growing cache does not recompile
the kernel at every decode step. Each entry's key and value are read through the index maps: a packed code row
(two bytes per code read and shifted, which covers every width 1-8 including 3) dequantized as
``zero + code * scale`` in float32 and rounded to the cache dtype (``CodeRows.full.dtype``) exactly as the unpack +
dequantize kernel of :mod:`kvcodec.kernels.triton_quant` does (no FMA contraction), or a full-precision row.
Products run on the matrix units (``tl.dot``; the query rows padded to 16): in the cache dtype when the query and
cache are float16 or bfloat16 (the keys are exact in it; the probabilities are split into two float16 or three
bfloat16 parts, :mod:`kvcodec.kernels.triton_dot`), else in IEEE float32 (the interpreter's path: its bfloat16
``tl.dot`` is wrong). A broadcast-and-sum formulation needed 255 registers and ~2 KB of spills per thread at
64-entry tiles and ran at ~1% of an H200's bandwidth; this one compiles (Triton 3.6, sm_90) to 128 registers and no
spills at the default 32-entry tiles and 8 warps.

This module needs ``triton``; :func:`kvcodec.quantized_attention` imports it lazily for CUDA queries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.kernels.triton_dot import (
    DOT_CODE,
    as_dot,
    cache_round,
    dot_mode,
    load_query_group,
    online_softmax_step,
    qk_dot,
    softmax_result,
)
from kvcore.checks import check_int, check_power_of_two


@triton.jit
def code_lanes(codes_ptr, r, ok, PW, BITS: tl.constexpr, D: tl.constexpr):
    """int32 ``[BT, D]`` codes of code rows ``r`` (``PW`` bytes apart; 0 where not ``ok``) for widths that divide a
    byte: each row's ``D / L`` bytes read as one contiguous run (``L = 8 // BITS`` lanes per byte, channel
    ``p * L + lane``) and split into their lanes by joins, which keep every lane in the thread that loaded the byte
    (no two overlapping byte reads per code, no change of register layout). ``D`` a power of two; shared with the
    method packages' kernels over code rows."""
    L: tl.constexpr = 8 // BITS
    P: tl.constexpr = D // L
    x = tl.load(codes_ptr + r[:, None] * PW + tl.arange(0, P)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    mask: tl.constexpr = (1 << BITS) - 1
    if L == 1:
        c = x
    elif L == 2:
        c = tl.join(x & mask, (x >> 4) & mask)
    elif L == 4:
        c = tl.join(tl.join(x & mask, (x >> 4) & mask), tl.join((x >> 2) & mask, (x >> 6) & mask))
    else:
        lo = tl.join(tl.join(x & 1, (x >> 4) & 1), tl.join((x >> 2) & 1, (x >> 6) & 1))
        hi = tl.join(tl.join((x >> 1) & 1, (x >> 5) & 1), tl.join((x >> 3) & 1, (x >> 7) & 1))
        c = tl.join(lo, hi)
    return tl.reshape(c, (x.shape[0], D))


@triton.jit
def group_params(scales_ptr, zeros_ptr, g, ok, d, C, GCOL: tl.constexpr, D: tl.constexpr):
    """float32 ``(scale, zero)`` tiles ``[R, d.shape[0]]`` (0 where not ``ok``): parameter rows ``g`` of ``[rows, C]``
    tables, channel ``d`` reading column ``d // GCOL``. Where whole rows are read (a power-of-two head dim) and
    groups of a power-of-two ``GCOL > 1`` tile them (values quantized per token in channel groups), each of a row's
    ``D / GCOL`` parameters is loaded once and spread over its channels in registers; loading per channel read each
    parameter ``GCOL`` times, one 16-bit load at a time on sm_90."""
    if GCOL > 1 and (GCOL & (GCOL - 1)) == 0 and d.shape[0] == D and D % GCOL == 0:
        CC: tl.constexpr = D // GCOL
        cc = tl.arange(0, CC)
        s = tl.load(scales_ptr + g[:, None] * CC + cc[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g[:, None] * CC + cc[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (ok.shape[0], CC, GCOL)), (ok.shape[0], D))
        z = tl.reshape(tl.broadcast_to(z[:, :, None], (ok.shape[0], CC, GCOL)), (ok.shape[0], D))
    else:
        m2 = ok[:, None] & (d < D)[None, :]
        col = d // GCOL
        s = tl.load(scales_ptr + g[:, None] * C + col[None, :], mask=m2, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g[:, None] * C + col[None, :], mask=m2, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _load_side(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    full_ptr,
    row,
    grp,
    tmask,
    d,
    PW,
    C,
    BITS: tl.constexpr,
    GCOL: tl.constexpr,
    D: tl.constexpr,
    FMAX: tl.constexpr,
    OUT: tl.constexpr,
):
    quant = (row >= 0) & tmask
    isfull = (row < 0) & tmask
    # clamped rather than selected (masked lanes never load; a select here trips Triton 3.6's layout pass on sm_90)
    r = tl.maximum(row, 0).to(tl.int64)
    g = tl.maximum(grp, 0).to(tl.int64)
    f = tl.maximum(-1 - row, 0).to(tl.int64)
    dmask = d < D
    bitpos = d * BITS
    byte = bitpos // 8
    sh = bitpos % 8
    m2 = quant[:, None] & dmask[None, :]
    if (BITS == 1 or BITS == 2 or BITS == 4 or BITS == 8) and d.shape[0] == D:  # whole bytes, no padded channels
        code = code_lanes(codes_ptr, r, quant, PW, BITS, D)
    else:
        b0 = tl.load(codes_ptr + r[:, None] * PW + byte[None, :], mask=m2, other=0).to(tl.int32)
        b1 = tl.load(codes_ptr + r[:, None] * PW + byte[None, :] + 1, mask=m2 & ((byte + 1) < PW)[None, :], other=0)
        word = b0 | (b1.to(tl.int32) << 8)
        code = (word >> sh[None, :]) & ((1 << BITS) - 1)
    s, z = group_params(scales_ptr, zeros_ptr, g, quant, d, C, GCOL, D)
    deq = z + code.to(tl.float32) * s
    deq = tl.minimum(tl.maximum(deq, -FMAX), FMAX)
    deq = cache_round(deq, OUT)
    fv = tl.load(full_ptr + f[:, None] * D + d[None, :], mask=isfull[:, None] & dmask[None, :], other=0.0)
    return tl.where(quant[:, None], deq, fv.to(tl.float32))


@triton.jit
def _quantized_attention_kernel(
    q_ptr,
    out_ptr,
    lse_ptr,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    kf_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    vf_ptr,
    krow_ptr,
    kgrp_ptr,
    vrow_ptr,
    vgrp_ptr,
    bias_ptr,
    sqb,
    sqh,
    sqq,
    sqd,
    H,
    T,
    Q,
    KPW,
    KC,
    VPW,
    VC,
    scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILES: tl.constexpr,
    KBITS: tl.constexpr,
    KGCOL: tl.constexpr,
    VBITS: tl.constexpr,
    VGCOL: tl.constexpr,
    KFMAX: tl.constexpr,
    KOUT: tl.constexpr,
    VFMAX: tl.constexpr,
    VOUT: tl.constexpr,
    DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    qv, m, mmask, _hq, _qi, d, dmask = load_query_group(q_ptr, b, h, sqb, sqh, sqq, sqd, Q, GROUP, D, BLOCK_M, BLOCK_D)
    qv = as_dot(qv, DOT)
    qmask = mmask[:, None] & dmask[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for blk in range(TILES):
        t = (sp * TILES + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        base = pid.to(tl.int64) * T + t
        krow = tl.load(krow_ptr + base, mask=tmask, other=0)
        kgrp = tl.load(kgrp_ptr + base, mask=tmask, other=0)
        vrow = tl.load(vrow_ptr + base, mask=tmask, other=0)
        vgrp = tl.load(vgrp_ptr + base, mask=tmask, other=0)
        bias = tl.load(bias_ptr + base, mask=tmask, other=float("-inf"))
        k = _load_side(kc_ptr, ks_ptr, kz_ptr, kf_ptr, krow, kgrp, tmask, d, KPW, KC, KBITS, KGCOL, D, KFMAX, KOUT)
        v = _load_side(vc_ptr, vs_ptr, vz_ptr, vf_ptr, vrow, vgrp, tmask, d, VPW, VC, VBITS, VGCOL, D, VFMAX, VOUT)
        # products on the matrix units (kvcodec.kernels.triton_dot: cache dtype or IEEE float32)
        qk = qk_dot(qv, k, DOT)
        logits = qk * scale + bias[None, :]
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    out, lse = softmax_result(m_i, l_i, acc)
    row = (pid.to(tl.int64) * tl.num_programs(1) + sp) * (GROUP * Q) + m
    tl.store(out_ptr + row[:, None] * D + d[None, :], out, mask=qmask)
    tl.store(lse_ptr + row, lse, mask=mmask)


@triton.jit
def _merge_splits_kernel(outp_ptr, lsep_ptr, out_ptr, lse_ptr, NSPLIT, M, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    # one program per (head, query row): log-sum-exp merge of the splits' normalized outputs, BLOCK_S splits at a
    # time (CHUNKS of them, a compile-time bound), rescaled online to the running maximum
    pid = tl.program_id(0)
    hm = pid // M
    mi = pid % M
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    top = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(CHUNKS):
        sidx = c * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = sidx < NSPLIT
        rows = (hm.to(tl.int64) * NSPLIT + sidx) * M + mi
        ls = tl.load(lsep_ptr + rows, mask=smask, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(ls, axis=0))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        alpha = tl.where(top == float("-inf"), 0.0, tl.exp(top - safe))
        w = tl.where(ls == float("-inf"), 0.0, tl.exp(ls - safe))
        o = tl.load(outp_ptr + rows[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        top = new_top
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    merged = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + pid.to(tl.int64) * D + d, merged, mask=dmask)
    lse = tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + pid + tl.arange(0, 1), lse)


#: splits the merge kernel holds in registers at a time (more are merged in chunks of this many)
MERGE_CHUNK = 64


def merge_splits(
    outp: torch.Tensor, lsep: torch.Tensor, num_warps: int = 8, *, chunk: int = MERGE_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out float32 [S, M, D], lse float32 [S, M])``: the log-sum-exp merge of the normalised outputs ``outp
    [S, nsplit, M, D]`` and log-sum-exps ``lsep [S, nsplit, M]`` of the splits of a decode-attention launch
    (Flash-Decoding), in one launch of the merge kernel (a split that saw nothing has ``lse = -inf``); with one
    split, views of the inputs. Shared by the fused decode-attention kernels of kvcodec and the method packages.

    ``chunk`` (a power of two) splits are held in registers at a time and merged online into the running result,
    so a long cache's many splits do not spill (a compiled variant per power of two of ``nsplit``, as before)."""
    S, nsplit, M, D = outp.shape
    check_power_of_two("chunk", chunk)
    if nsplit == 1:
        return outp.view(S, M, D), lsep.view(S, M)
    out = torch.empty(S, M, D, dtype=torch.float32, device=outp.device)
    lse = torch.empty(S, M, dtype=torch.float32, device=outp.device)
    if S * M:
        block_s = min(_pow2(nsplit), chunk)
        _merge_splits_kernel[(S * M,)](
            outp, lsep, out, lse, nsplit, M, D=D, BLOCK_S=block_s, BLOCK_D=_pow2(D),
            CHUNKS=_pow2(nsplit) // block_s, num_warps=num_warps,
        )  # fmt: skip
    return out, lse


def _full_or_dummy(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.shape[0] else torch.zeros(1, t.shape[1], dtype=t.dtype, device=t.device)


_OUT = DOT_CODE  # the cache dtype's rounding code


def _params(side) -> tuple:
    codes = (
        side.codes.contiguous()
        if side.codes.shape[0]
        else torch.zeros(1, side.codes.shape[1] or 1, dtype=torch.uint8, device=side.codes.device)
    )
    scales = (
        side.scales.contiguous()
        if side.scales.shape[0]
        else torch.zeros(1, max(side.scales.shape[1], 1), device=side.codes.device)
    )
    zeros = side.zeros.contiguous() if side.zeros.shape[0] else torch.zeros_like(scales)
    gcol = 1 if side.axis == "channel" else side.group_size
    rounding = (float(torch.finfo(side.full.dtype).max), _OUT[side.full.dtype])
    return codes, scales, zeros, _full_or_dummy(side.full), side.codes.shape[1], side.scales.shape[1], gcol, rounding


#: programs a launch aims for when it picks the tiles per program (a few waves on a 100+ multiprocessor GPU)
TARGET_PROGRAMS = 256
#: tiles per program it picks from (each a compiled variant)
TILE_CHOICES = (1, 2, 4, 8, 16, 32)


def _pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1) - 1).bit_length())


def split_plan(T: int, programs: int, block_t: int | None = None, tiles: int | None = None) -> tuple[int, int, int]:
    """``(block_t, tiles, splits)`` for ``T`` entries per head and ``programs = B * Hkv`` heads.

    ``block_t`` defaults to 32 entries (at least 16: ``tl.dot``), ``tiles`` to the smallest of :data:`TILE_CHOICES`
    that keeps the launch near :data:`TARGET_PROGRAMS` programs, so short caches get many small splits and long ones
    few, long splits (less to merge).
    """
    bt = max(16, _pow2(block_t if block_t is not None else min(32, _pow2(T))))  # tl.dot needs >= 16
    if tiles is None:
        want = -(-T // max(1, -(-TARGET_PROGRAMS // max(programs, 1))))  # entries per split for the target
        tiles = next((c for c in TILE_CHOICES if c * bt >= want), TILE_CHOICES[-1])
    check_int("tiles", tiles, low=1)
    return bt, tiles, max(1, triton.cdiv(T, bt * tiles))


def quantized_attention_triton(
    query: torch.Tensor,
    segment,
    scale: float,
    *,
    block_t: int | None = None,
    tiles: int | None = None,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kvcodec.kernels.reference.quantized_attention_ref` (same arguments, same results up to float32
    summation order); ``block_t`` entries per tile and ``tiles`` tiles per program (defaults: :func:`split_plan`).

    ``tensor_cores``: multiply in the cache dtype on the matrix units (the query and both sides' cache dtype all
    float16 or all bfloat16; the probabilities split into two parts of that dtype, ~2x its mantissa bits) instead
    of float32. Default: on CUDA when the dtypes allow it; the interpreter runs float32 (its bfloat16 ``tl.dot``
    is wrong)."""
    B, H, T, D = segment.shape
    Hq, Q = query.shape[1], query.shape[2]
    group = Hq // H
    M = group * Q
    if B * H == 0 or Q == 0 or D == 0 or T == 0:
        out = torch.zeros(B, Hq, Q, D, dtype=torch.float32, device=query.device)
        return out, torch.full((B, Hq, Q), float("-inf"), dtype=torch.float32, device=query.device)
    dot = dot_mode(query, (segment.keys.full.dtype, segment.values.full.dtype), tensor_cores)
    if block_t is None and not dot:
        block_t = 16  # IEEE float32 products: 32-entry tiles spill on sm_90 with Triton 3.9 (296 bytes)
    bt, tiles, nsplit = split_plan(T, B * H, block_t, tiles)
    outp = torch.empty(B * H, nsplit, M, D, dtype=torch.float32, device=query.device)
    lsep = torch.empty(B * H, nsplit, M, dtype=torch.float32, device=query.device)
    kc, ks, kz, kf, kpw, kC, kg, (kfmax, kout) = _params(segment.keys)
    vc, vs, vz, vf, vpw, vC, vg, (vfmax, vout) = _params(segment.values)
    _quantized_attention_kernel[(B * H, nsplit)](
        query,
        outp,
        lsep,
        kc,
        ks,
        kz,
        kf,
        vc,
        vs,
        vz,
        vf,
        segment.key_row.contiguous(),
        segment.key_group.contiguous(),
        segment.value_row.contiguous(),
        segment.value_group.contiguous(),
        segment.bias.float().contiguous(),
        *query.stride(),
        H,
        T,
        Q,
        kpw,
        kC,
        vpw,
        vC,
        float(scale),
        GROUP=group,
        D=D,
        BLOCK_M=max(16, _pow2(M)),
        BLOCK_T=bt,
        BLOCK_D=max(16, _pow2(D)),
        TILES=tiles,
        KBITS=segment.keys.bits,
        KGCOL=kg,
        VBITS=segment.values.bits,
        VGCOL=vg,
        KFMAX=kfmax,
        KOUT=kout,
        VFMAX=vfmax,
        VOUT=vout,
        DOT=dot,
        num_warps=num_warps,
        enable_fp_fusion=False,  # dequantize bit-exactly like the unpack + dequantize kernel
    )
    out, lse = merge_splits(outp, lsep, num_warps)
    return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)
