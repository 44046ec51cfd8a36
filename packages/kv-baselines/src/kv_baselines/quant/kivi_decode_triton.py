"""Triton kernel: decode attention over KIVI's decode layout (:class:`~kv_baselines.quant.kivi_decode.DecodeState`).

The decode layout keeps each part of a KIVI cache (Liu et al. 2024, "KIVI", §3.3-3.4) as a strided buffer written in
place: token-inner packed key codes ``uint8 [S, P, capacity]`` with per-channel scales/zeros ``[S, D, groups]``, the
key residual ``[S, rows, D]``, token-inner value codes with per-token scales/zeros ``[S, D / G, capacity]`` and the
value FIFO as a ring of rows. Entry ``t`` of a head is a quantized key for ``t < tk`` (residual row ``t - tk``
after) and a quantized value for ``t < tv`` (ring slot ``(t - tv + head) mod nv`` after), so the kernel needs no
per-entry index maps: a tile of entries reads its code bytes, scales and zeros (or full-precision rows) by address
arithmetic, dequantizes them in registers (``zero + code * scale`` in float32, rounded to the cache dtype exactly as
``read()`` hands them out) and never writes a dequantized cache.

The layout keeps every row of codes and parameters 16-slot aligned (:data:`~kv_baselines.quant.kivi_decode.ALIGN`),
so a tile whose entries are all quantized on both sides -- every tile but the last few, next to the residual --
takes an unmasked path of vector loads that splits code bytes without any change of register layout (on sm_90 the
machine code of a tile is ~40 % shorter than the general path's, which stays for the tiles at the residual and for
misaligned buffers).

Like :mod:`kvcodec.kernels.triton_attention` (FlashAttention's online softmax, Dao et al. 2022, §3.1; the
Flash-Decoding split over programs with a log-sum-exp merge): one program per (KV head, split) owns the head's
``M`` query rows (GQA without repeating K/V), walks ``TILES`` (compile-time) tiles of ``BLOCK_T`` entries; the
counts ``tk, nr, tv, nv`` and the ring's head are run-time arguments, so a growing cache compiles one variant.
Products run on the matrix units (:mod:`kvcodec.kernels.triton_dot`: the cache dtype for float16/bfloat16 queries
and caches on CUDA, IEEE float32 otherwise and under the interpreter).

This module needs ``triton``; :meth:`KIVIStore.attend <kv_baselines.quant.KIVIStore.attend>` imports it lazily for
CUDA caches. The PyTorch reference of the same signature is
:func:`kv_baselines.quant.kivi_decode.decode_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.kernels.alignment import rows_aligned
from kvcodec.kernels.triton_attention import merge_splits, split_plan
from kvcodec.kernels.triton_dot import (
    DOT_CODE,
    as_dot,
    cache_round,
    dot_mode,
    online_softmax_step,
    online_softmax_step_t,
    qk_dot,
    softmax_result,
)


@triton.jit
def _codes_tile(
    codes_ptr, scales_ptr, zeros_ptr, s64, t, t0, ok, s_cs, s_cp, s_ps, s_pc,
    BITS: tl.constexpr, GT: tl.constexpr, GD: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    FMAX: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """float32 ``[BLOCK_T, D]`` dequantized entries ``t`` (0 where not ``ok``) of token-inner codes ``[S, D / L,
    capacity]`` (``L = 8 // BITS`` lanes per byte, channel ``p * L + lane``), scales and zeros at ``[d // GD,
    t // GT]``: keys ``GD = 1``, ``GT = G`` over ``[S, D, groups]``; values ``GD = G``, ``GT = 1`` over
    ``[S, D / G, capacity]``. ``D`` is a power of two: each byte is loaded once and split into its lanes, each
    parameter once per (token, group) -- or, for keys whose group spans the tile (``G % BLOCK_T == 0``, the tile
    starting at ``t0``), once per channel -- and broadcast, so the tile holds few addresses. Offsets within a head
    are int32 (a head's buffers hold far fewer than 2^31 elements)."""
    L: tl.constexpr = 8 // BITS
    P: tl.constexpr = D // L
    C: tl.constexpr = D // GD
    tt = tl.maximum(t, 0)
    p = tl.arange(0, P)
    byte = tl.load(codes_ptr + s64 * s_cs + (p * s_cp)[None, :] + tt[:, None], mask=ok[:, None], other=0)
    shift = tl.arange(0, L) * BITS
    code = (byte.to(tl.int32)[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)
    code = tl.reshape(code, (BLOCK_T, D)).to(tl.float32)
    base = s64 * s_ps
    if GT % BLOCK_T == 0:  # one parameter per channel for the whole tile
        c = tl.arange(0, C)
        g = t0 // GT
        live = (c * 0 + tl.sum(ok.to(tl.int32), 0)) > 0  # a tile with no entry here reads no parameter
        sc = tl.load(scales_ptr + base + c * s_pc + g, mask=live, other=0.0).to(tl.float32)
        zr = tl.load(zeros_ptr + base + c * s_pc + g, mask=live, other=0.0).to(tl.float32)
        sc = tl.reshape(tl.broadcast_to(sc[:, None], (C, GD)), (D,))[None, :]
        zr = tl.reshape(tl.broadcast_to(zr[:, None], (C, GD)), (D,))[None, :]
    else:  # one per (token, channel group)
        c = tl.arange(0, C)
        par = (c * s_pc)[None, :] + (tt // GT)[:, None]
        sc = tl.load(scales_ptr + base + par, mask=ok[:, None], other=0.0).to(tl.float32)
        zr = tl.load(zeros_ptr + base + par, mask=ok[:, None], other=0.0).to(tl.float32)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_T, C, GD)), (BLOCK_T, D))
        zr = tl.reshape(tl.broadcast_to(zr[:, :, None], (BLOCK_T, C, GD)), (BLOCK_T, D))
    deq = tl.where(ok[:, None], zr + code * sc, 0.0)
    return cache_round(tl.minimum(tl.maximum(deq, -FMAX), FMAX), OUT)


@triton.jit
def _dequantized(code, sc, zr, FMAX: tl.constexpr, OUT: tl.constexpr, DOT: tl.constexpr):
    """``zero + code * scale`` in float32 as ``read()`` computes it (fused into one multiply-add only where the launch
    allows it: 16-bit parameters, whose product with a code is exact, so one rounding either way), rounded to the
    cache dtype and clamped to its range; in the product dtype (``DOT``; float32 with the cache dtype's values under
    ``DOT = 0``). The clamp runs after the rounding, on the narrow type (two values
    per instruction): the same result, as every float32 beyond the range rounds to infinity or the largest value."""
    deq = zr + code * sc
    if DOT == 0:
        return cache_round(tl.minimum(tl.maximum(deq, -FMAX), FMAX), OUT)
    else:
        x = as_dot(deq, DOT)
        lim = as_dot(tl.full([1, 1], FMAX, tl.float32), DOT)
        return tl.minimum(tl.maximum(x, -lim), lim)


@triton.jit
def _codes_aligned(
    codes_ptr, scales_ptr, zeros_ptr, s64, t0, d, par, s_cs, s_cp, s_ps,
    BITS: tl.constexpr, BLOCK_T: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """``[D, BLOCK_T]`` dequantized entries ``t0 ...`` (channels ``d`` down, entries across: ``kᵀ`` as ``q · kᵀ`` takes
    it, ``vᵀ`` as :func:`~kvcodec.kernels.triton_dot.online_softmax_step_t` takes it) of a tile of quantized keys or
    values, parameters at offsets ``par`` (``[D, 1]`` or ``[D, BLOCK_T]``), code rows 16-byte aligned. The codes
    are read as 32-bit words of four entries: one shift and one mask leave a channel's code in each byte, the bytes
    go to their entries' registers by a join (no layout change) and become float32 by their bits (``2^23 + code``,
    no int -> float conversion, a slow instruction)."""
    L: tl.constexpr = 8 // BITS
    words = (codes_ptr + s64 * s_cs + t0).to(tl.pointer_type(tl.int32))
    w = tl.load(words + ((d // L) * (s_cp // 4))[:, None] + tl.arange(0, BLOCK_T // 4)[None, :])
    w = w >> ((d % L) * BITS)[:, None]
    if BITS < 8:
        w = w & (((1 << BITS) - 1) * 0x01010101)
    c = tl.join(tl.join(w & 0xFF, (w >> 16) & 0xFF), tl.join((w >> 8) & 0xFF, (w >> 24) & 0xFF))
    c = tl.reshape(c, (d.shape[0], BLOCK_T))  # entry 4j + i: byte i of word j
    code = (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    sc = tl.load(scales_ptr + s64 * s_ps + par).to(tl.float32)
    zr = tl.load(zeros_ptr + s64 * s_ps + par).to(tl.float32)
    return _dequantized(code, sc, zr, FMAX, OUT, DOT)


@triton.jit
def _rows_tile(rows_ptr, s64, r, ok, d, s_rs, D: tl.constexpr):
    """float32 ``[BLOCK_T, D]`` full-precision rows ``r`` (0 where not ``ok``) of ``[S, rows, D]`` (rows
    contiguous)."""
    rr = tl.maximum(r, 0)
    x = tl.load(rows_ptr + s64 * s_rs + (rr * D)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    return x.to(tl.float32)


# the counts and the ring's head change every step and the capacity strides as buffers grow: not specialised (an
# integer equal to 1 or divisible by 16 would otherwise compile a variant of its own). The strides that are whole
# multiples of D (a power of two >= 16) stay specialised: always divisible by 16, they let rows load as vectors.
_RUNTIME = ["tk", "nr", "tv", "nv", "head", "s_kcs", "s_kcp", "s_kpc", "s_vcs", "s_vcp", "s_vps", "s_vpc"]


@triton.jit(do_not_specialize=_RUNTIME)
def _kivi_decode_attention_kernel(
    q_ptr, outp_ptr, lsep_ptr,
    kc_ptr, ks_ptr, kz_ptr, kr_ptr, vc_ptr, vs_ptr, vz_ptr, ring_ptr,
    s_kcs, s_kcp, s_kps, s_kpc, s_krs, s_vcs, s_vcp, s_vps, s_vpc, s_rgs,
    M, tk, nr, tv, nv, head, scale,
    D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
    TILES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, FMAX: tl.constexpr,
    OUT: tl.constexpr, DOT: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    if ALIGNED:  # the host checked these strides are multiples of 16; `x // 16 * 16` (exact) tells the compiler
        s_kcs = s_kcs // 16 * 16
        s_kcp = s_kcp // 16 * 16
        s_vcs = s_vcs // 16 * 16
        s_vcp = s_vcp // 16 * 16
        s_vps = s_vps // 16 * 16
        s_vpc = s_vpc // 16 * 16
    s64 = s.to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    d = tl.arange(0, D)
    qmask = mmask[:, None]
    qrow = s64 * M + m
    qv = as_dot(tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=qmask, other=0.0), DOT)
    T = tk + nr
    ring = tl.maximum(nv, 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # on the matrix units the output accumulates transposed (online_softmax_step_t: the head dim on the product's
    # long side); on the float32 path that form spills on sm_90, so it accumulates as [M, D]
    TRANS: tl.constexpr = DOT != 0
    acc = tl.zeros([D, BLOCK_M], tl.float32) if TRANS else tl.zeros([BLOCK_M, D], tl.float32)
    qend = tl.minimum(tk, tv)
    for blk in range(TILES):
        t0 = (sp * TILES + blk) * BLOCK_T
        t = t0 + tl.arange(0, BLOCK_T)
        if ALIGNED and t0 + BLOCK_T <= qend:
            # every entry of the tile is quantized on both sides and the rows are aligned: no mask, no residual
            # keys: one parameter per channel for the whole tile where the group spans it
            kpar = d[:, None] * s_kpc + (t0 // G if G % BLOCK_T == 0 else t[None, :] // G)
            kt = _codes_aligned(
                kc_ptr, ks_ptr, kz_ptr, s64, t0, d, kpar, s_kcs, s_kcp, s_kps, KBITS, BLOCK_T, FMAX, OUT, DOT
            )
            vpar = ((d // GV) * s_vpc)[:, None] + t[None, :]
            vt = _codes_aligned(
                vc_ptr, vs_ptr, vz_ptr, s64, t0, d, vpar, s_vcs, s_vcp, s_vps, VBITS, BLOCK_T, FMAX, OUT, DOT
            )
            lf = qk_dot(qv, tl.trans(kt), DOT) * scale
            if TRANS:
                m_i, l_i, acc = online_softmax_step_t(m_i, l_i, acc, lf, vt, DOT)
            else:
                m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, lf, tl.trans(vt), DOT)
        else:
            tmask = t < T
            kq = tmask & (t < tk)
            vq = tmask & (t < tv)
            # the two parts' masks are disjoint and each is 0 outside its own: a sum, not a select
            k = (
                _codes_tile(kc_ptr, ks_ptr, kz_ptr, s64, t, t0, kq, s_kcs, s_kcp, s_kps, s_kpc, KBITS, G, 1, D,
                            BLOCK_T, FMAX, OUT)
                + _rows_tile(kr_ptr, s64, t - tk, tmask & (t >= tk), d, s_krs, D)
            )  # fmt: skip
            v = (
                _codes_tile(vc_ptr, vs_ptr, vz_ptr, s64, t, t0, vq, s_vcs, s_vcp, s_vps, s_vpc, VBITS, 1, GV, D,
                            BLOCK_T, FMAX, OUT)
                + _rows_tile(ring_ptr, s64, (tl.maximum(t - tv, 0) + head) % ring, tmask & (t >= tv), d, s_rgs,
                           D)
            )  # fmt: skip
            logits = qk_dot(qv, k, DOT) * scale
            logits = tl.where(tmask[None, :], logits, float("-inf"))
            if TRANS:
                m_i, l_i, acc = online_softmax_step_t(m_i, l_i, acc, logits, tl.trans(v), DOT)
            else:
                m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    if TRANS:
        acc = tl.trans(acc)
    out, lse = softmax_result(m_i, l_i, acc)
    row = (s64 * tl.num_programs(1) + sp) * M + m
    tl.store(outp_ptr + row[:, None] * D + d[None, :], out, mask=qmask)
    tl.store(lsep_ptr + row, lse, mask=mmask)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(state) -> bool:
    """Whether the kernel takes ``state``: a power-of-two head dim of at least 16 (the tiles are whole head rows and
    ``tl.dot`` needs 16) and power-of-two value channel groups (each code byte and parameter is split into its
    lanes and channels by reshapes). Other shapes attend through the PyTorch reference."""
    return state.D >= 16 and _is_pow2(state.D) and _is_pow2(state.vinfo[0].group_size)


def decode_attention_triton(
    state,
    query: torch.Tensor,
    scale: float,
    *,
    block_t: int | None = None,
    tiles: int | None = None,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
    aligned_path: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kv_baselines.quant.kivi_decode.decode_attention_ref`: ``(out float32 [S, M, D], lse float32
    [S, M, 1])`` of ``query [S, M, D]`` (the ``M`` query rows of each of the ``S = B * H`` KV heads, any float
    dtype) over a :class:`~kv_baselines.quant.kivi_decode.DecodeState`, equal to the reference up to float32
    summation order and the rounding of dequantized entries to the cache dtype (which ``read()`` also applies).
    ``ValueError`` for a state the kernel does not take (:func:`supported`).

    ``block_t`` entries per tile (default 32; 16 from head dim 256 on, where a 32-entry tile of 8-bit codes spills
    on sm_90) and ``tiles`` tiles per program (default: :func:`kvcodec.kernels.triton_attention.split_plan`);
    ``tensor_cores`` as :func:`kvcodec.kernels.triton_dot.dot_mode` (default: the cache dtype's matrix units on
    CUDA when the query and the cache share float16 or bfloat16). ``aligned_path``: tiles of quantized entries take
    the aligned path (module docstring) where the buffers allow it (``None``, default), always (``True``:
    ``ValueError`` for buffers that are not aligned) or never (``False``: every tile the general path, as a
    baseline for benchmarks)."""
    if aligned_path is not None and not isinstance(aligned_path, bool):
        raise TypeError(f"aligned_path must be None, True or False, got {aligned_path!r}")
    S, M, D = query.shape
    dev = query.device
    T = state.length
    if not supported(state):
        raise ValueError(
            f"the kernel needs a power-of-two head dim >= 16 and value group; got D={state.D}, value group "
            f"{state.vinfo[0].group_size} (kv_baselines.quant.kivi_decode.decode_attention_ref takes any)"
        )
    if S == 0 or M == 0 or T == 0:
        out = torch.zeros(S, M, D, dtype=torch.float32, device=dev)
        return out, torch.full((S, M, 1), float("-inf"), dtype=torch.float32, device=dev)
    kq, G = state.kinfo[0], state.kinfo[1]
    vq, cache_dtype = state.vinfo[0], state.kinfo[2]
    if block_t is None and D >= 256:  # a [32, 256] tile of 8-bit codes spills on sm_90: half the entries
        block_t = 16
    bt, tiles, nsplit = split_plan(T, S, block_t, tiles)
    q = query.contiguous()
    outp = torch.empty(S, nsplit, M, D, dtype=torch.float32, device=dev)
    lsep = torch.empty(S, nsplit, M, dtype=torch.float32, device=dev)
    kc, ks, kz, kr, vc, vs, vz, ring = (
        state.kc, state.ks, state.kz, state.kr, state.vc, state.vs, state.vz, state.ring,
    )  # fmt: skip
    for name, t in (("kc", kc), ("ks", ks), ("kz", kz), ("vc", vc), ("vs", vs), ("vz", vz), ("kr", kr), ("ring", ring)):
        if (t.stride(-1) != 1 and t.shape[-1] > 1) or (name in ("kr", "ring") and t.stride(1) != D):
            raise ValueError(f"the decode layout's {name} must be contiguous in its last dimension (rows: in two)")
    if ks.stride() != kz.stride() or vs.stride() != vz.stride():
        raise ValueError("the decode layout's scales and zeros must share their strides")
    # the aligned path's vector and word loads need 16-slot rows starting at 16-byte addresses
    aligned = rows_aligned((kc, vc, vs, vz), dims=(0, 1))
    if aligned_path and not aligned:
        raise ValueError(
            "aligned_path=True needs the decode layout's code and value-parameter rows 16-slot aligned (strides and "
            "base addresses multiples of 16); got strides "
            f"{[tuple(t.stride()[:2]) for t in (kc, vc, vs, vz)]}"
        )
    aligned = aligned and aligned_path is not False
    _kivi_decode_attention_kernel[(S, nsplit)](
        q, outp, lsep, kc, ks, kz, kr, vc, vs, vz, ring,
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), kr.stride(0),
        vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1), ring.stride(0),
        M, state.tk, state.nr, state.tv, state.nv, state.head, float(scale),
        D=D, G=G, GV=vq.group_size, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_T=bt, TILES=tiles,
        KBITS=kq.bits, VBITS=vq.bits, FMAX=float(torch.finfo(cache_dtype).max), OUT=DOT_CODE[cache_dtype],
        DOT=dot_mode(q, (cache_dtype,), tensor_cores), ALIGNED=aligned, num_warps=num_warps,
        # dequantize bit-exactly like read(): zero + code * scale rounds once either way where the product is exact
        # (a code of <= 8 bits times a 16-bit float's <= 11-bit significand), not for float32 scales
        enable_fp_fusion=all(t.dtype in (torch.float16, torch.bfloat16) for t in (ks, vs)),
    )  # fmt: skip
    out, lse = merge_splits(outp, lsep, num_warps)
    return out, lse.view(S, M, 1)
