"""Triton kernel: decode attention v2 over KIVI's packed decode layout, in the folded formulation (issue 43).

Same contract as :func:`kvcodec.decode_v2.kivi_decode_v2_ref` (its PyTorch reference, same signature): agreement
with attention over the dequantized cache within ``docs/protocols.md``'s tolerance, not bit for bit. Over a tile of
``BLOCK_T`` entries whose keys and values are all quantized (every tile but the last few, next to the residual),
nothing is dequantized:

* **codes become float16 operands by their bits**: each code byte is widened to 16 bits (two ``prmt`` per four
  bytes) and each lane ``j`` of it is masked *in place* and OR-ed into the mantissa of 1024.0 (``0x6400``): one
  ``lop3`` per two codes gives ``h = 1024 + 2^(bits·j) · code`` exactly, and one ``fma.rn.f16x2``,
  ``h · 2^-(bits·j) - 1024 · 2^-(bits·j)``, the code itself, exactly -- no shift, no int → float conversion. (Leaving
  the 1024 in the operand and subtracting ``1024 Σ q'`` from the float32 result instead costs one instruction per
  two codes less, but the large offset's float32 accumulation error moved lse by ~2e-3 at logits of a few units.) On
  CUDA both steps are inline PTX (:func:`code_halves` with ``ASM``); the interpreter, which cannot run PTX, runs the
  *twin*: the same masks, ORs, bitcast and multiply-add in plain Triton (``test_code_conversion_is_exact``). The
  lanes are joined into one operand per side (:func:`code_rows`), channels in the order the joins leave them
  (bit-reversed within a byte, :func:`lane_channel`), which the query, the parameters, the full-precision rows and
  the outputs follow: one matrix product per side (and query part);
* **keys** (per channel within groups of ``G`` tokens, ``BLOCK_T`` dividing ``G``: one group per tile): the group's
  scales and the softmax scale are folded into the query, ``q' = q ⊙ s_g`` (once per query row, then spread over
  the matrix rows), as two float16 parts (hi + lo: one part alone moved lse by up to ~1e-2), and its zeros into one
  bias per query row, ``q · z_g``: the logits are ``q'_hi · code + q'_lo · code + bias`` over the raw codes;
* **values** (per token in channel groups of ``GV``): each token's scale is folded into its probability per channel
  group, ``p'_c = round16(p ⊙ s_c)``, and its zeros into one correction per (query row, channel group),
  ``Σ_t p z_c``. The ``M`` query rows of the KV head are replicated once per channel group as the matrix product's
  rows (``ROWS = max(16, C · next_pow2(M))``, row ``c · MB + m``): a GQA group of 4 query heads at 4 channel groups
  fills exactly the 16 rows the matrix units pad ``M`` to anyway. Row ``(c, m)`` accumulates ``p'_c · code`` for
  every channel and the epilogue keeps the channels of group ``c`` only (a masked store).

Tiles that reach the residual take the same folded products under masks plus the full-precision rows (key
residual, value FIFO) as they are, in the cache dtype's products. Nothing is rounded to the cache dtype: the result
is attention over the codes dequantized in float32 (up to the operand roundings above), which ``read()`` rounds.
The GQA group's query rows are the products' ``M`` dimension, the entries are split across programs
(Flash-Decoding, ``TILES`` compile-time tiles per program; the counts are run-time arguments) and the splits merged
by log-sum-exp (:func:`kvcodec.kernels.triton_attention.merge_splits`).

Products: float16 operands on the matrix units (``HALF``, CUDA) whatever the cache dtype (codes up to 8 bits are
exact in float16; the folded ``q ⊙ s`` and ``p ⊙ s`` are rounded to it -- the tolerance's main term); the
interpreter casts the same float16 values to float32 (its float16/bfloat16 ``tl.dot`` is not trustworthy), which
the GPU's exact float16 products with float32 accumulation also compute. sm_90 machine code at Llama-3-8B's
shape: ~83 / 80 warp instructions per entry at 2 / 4 bits (v1: 140; ``benchmarks/sm90_decode_v2.py``,
``docs/results/2026-11-28-gpu-decode-v2.md``). This module needs ``triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.kernels.alignment import rows_aligned
from kvcodec.kernels.triton_attention import merge_splits, split_plan
from kvcodec.kernels.triton_dot import _weights, as_dot, dot_mode, pv_dot, qk_dot


@triton.jit
def widen_bytes(b, ASM: tl.constexpr):
    """int16 of each uint8 ``b`` (zero-extended): two ``prmt`` per four bytes on CUDA (``ASM``), a cast otherwise."""
    if ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0, 0x5150;\n\tprmt.b32 $1, $2, 0, 0x5352;",
            "=r,=r,r", [b], dtype=tl.int16, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        return b.to(tl.int16)


@triton.jit
def lane_code(w, BITS: tl.constexpr, J: tl.constexpr, ASM: tl.constexpr):
    """float16 code of lane ``J`` of each int16 ``w`` (a widened byte), exact: the lane's bits masked in place and
    OR-ed into 1024.0's mantissa (``h = 1024 + 2^(BITS·J) · code``), then ``h · 2^-(BITS·J) - 1024 · 2^-(BITS·J)``
    in one fused multiply-add (both steps exact). On CUDA one ``lop3`` and one ``fma.rn.f16x2`` per two codes; the
    twin is the same AND, OR, bitcast and multiply-add in Triton."""
    MASK: tl.constexpr = ((1 << BITS) - 1) << (BITS * J)
    INV: tl.constexpr = 1.0 / (1 << (BITS * J))
    if ASM:
        return tl.inline_asm_elementwise(
            "{\n\t.reg .b32 h;\n\tlop3.b32 h, $1, $2, 0x64006400, 0xEA;\n\tfma.rn.f16x2 $0, h, $3, $4;\n\t}",
            "=r,r,r,r,r",
            [w, tl.full(w.shape, MASK, tl.int16), tl.full(w.shape, INV, tl.float16),
             tl.full(w.shape, -1024.0 * INV, tl.float16)],
            dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
    else:
        h = ((w & MASK) | 0x6400).to(tl.float16, bitcast=True)
        return (h.to(tl.float32) * INV - 1024.0 * INV).to(tl.float16)


@triton.jit
def code_halves(byte, BITS: tl.constexpr, ASM: tl.constexpr):
    """``L = 8 // BITS`` float16 tensors shaped like ``byte`` (uint8 packed codes): lane ``j``'s codes, exact, with no
    shift and no int -> float conversion (:func:`lane_code`)."""
    w = widen_bytes(byte, ASM)
    out = ()
    for j in tl.static_range(8 // BITS):
        out = out + (lane_code(w, BITS, j, ASM),)
    return out


@triton.jit
def code_rows(byte, BITS: tl.constexpr, ASM: tl.constexpr):
    """float16 ``[P * L, N]`` codes of token-inner bytes ``uint8 [P, N]``: the lanes of :func:`code_halves` joined into
    one operand, row ``d' = p * L + i`` holding channel :func:`lane_channel` ``(d')`` (lane ``bitrev(i)``: the order
    the joins leave them in, kept as it is -- the products take any channel order the query and the outputs share)."""
    h = code_halves(byte, BITS, ASM)
    P: tl.constexpr = byte.shape[0]
    N: tl.constexpr = byte.shape[1]
    if BITS == 8:
        return h[0]
    elif BITS == 4:
        return tl.reshape(tl.permute(tl.join(h[0], h[1]), (0, 2, 1)), (P * 2, N))
    elif BITS == 2:
        x = tl.join(tl.join(h[0], h[1]), tl.join(h[2], h[3]))
        return tl.reshape(tl.permute(x, (0, 2, 3, 1)), (P * 4, N))
    else:
        x = tl.join(
            tl.join(tl.join(h[0], h[1]), tl.join(h[2], h[3])), tl.join(tl.join(h[4], h[5]), tl.join(h[6], h[7]))
        )
        return tl.reshape(tl.permute(x, (0, 2, 3, 4, 1)), (P * 8, N))


@triton.jit
def lane_channel(dp, BITS: tl.constexpr):
    """The channel of row ``dp`` of :func:`code_rows`: ``(dp // L) * L + bitrev_L(dp % L)``."""
    L: tl.constexpr = 8 // BITS
    i = dp % L
    if L == 4:
        i = ((i & 1) << 1) | (i >> 1)
    elif L == 8:
        i = ((i & 1) << 2) | (i & 2) | (i >> 2)
    return dp - dp % L + i


@triton.jit
def _hdot(a, b, HALF: tl.constexpr):
    """``a · b`` in float32 of float16 operands: the matrix units (``HALF``) or IEEE float32 of the same values."""
    if HALF:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _rows(x, CR: tl.constexpr):
    """``x [MB, ...]`` repeated ``CR`` times along a new leading axis and flattened into it: ``[CR * MB, ...]`` (row
    ``c * MB + m`` is ``x[m]``), the query rows' values spread over the channel groups' copies, not recomputed."""
    if len(x.shape) == 1:
        return tl.reshape(tl.broadcast_to(x[None, :], (CR, x.shape[0])), (CR * x.shape[0],))
    else:
        return tl.reshape(tl.broadcast_to(x[None, :, :], (CR, x.shape[0], x.shape[1])), (CR * x.shape[0], x.shape[1]))


@triton.jit
def _key_logits(
    qk, kc_ptr, ks_ptr, kz_ptr, base_c, base_p, kp, ch, t, g, live, s_kcp, s_kpc, scale,
    CR: tl.constexpr, BLOCK_T: tl.constexpr, KBITS: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
    KSPLIT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """float32 ``[CR * MB, BLOCK_T]`` scaled logits of entries ``t`` (one key group ``g``) from their raw codes:
    ``round16(q ⊙ s_g · scale) · code`` (two float16 parts where ``KSPLIT``) plus the bias ``q · z_g · scale``; ``qk``
    the query ``[MB, D]`` over channels ``ch`` (:func:`lane_channel`), ``kp`` the code bytes. ``MASKED``: only the
    entries where ``live [BLOCK_T]`` are read (the others' logits are garbage; callers select)."""
    ptrs = kc_ptr + base_c + kp[:, None] * s_kcp + t[None, :]
    byte = tl.load(ptrs, mask=live[None, :], other=0) if MASKED else tl.load(ptrs)
    kh = code_rows(byte, KBITS, ASM)
    par = base_p + ch * s_kpc + g
    if MASKED:
        pmask = (ch * 0 + tl.sum(live.to(tl.int32), 0)) > 0  # a tile without a quantized key reads no parameter
        sc = tl.load(ks_ptr + par, mask=pmask, other=0.0).to(tl.float32) * scale
        zr = tl.load(kz_ptr + par, mask=pmask, other=0.0).to(tl.float32) * scale
    else:
        sc = tl.load(ks_ptr + par).to(tl.float32) * scale
        zr = tl.load(kz_ptr + par).to(tl.float32) * scale
    # the fold runs once per query row ([MB, D]) and is then spread over the ROWS = CR * MB matrix rows
    qf = qk * sc[None, :]
    qh = qf.to(tl.float16)
    logits = _hdot(_rows(qh, CR), kh, HALF)
    if KSPLIT:  # q' as two float16 parts (~2^-22 of it): float16's own 2^-11 moves lse by ~1e-3
        logits += _hdot(_rows((qf - qh.to(tl.float32)).to(tl.float16), CR), kh, HALF)
    return logits + _rows(tl.sum(qk * zr[None, :], 1), CR)[:, None]


@triton.jit
def _value_step(
    acc, zs, alpha, p, vc_ptr, vs_ptr, vz_ptr, base_c, base_p, vp, t, live, s_vcp, s_vpc,
    C: tl.constexpr, CR: tl.constexpr, MB: tl.constexpr, VBITS: tl.constexpr, HALF: tl.constexpr,
    ASM: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """The accumulators ``acc [ROWS, D]`` (channels in :func:`code_rows` order) and ``zs [ROWS]`` rescaled by ``alpha``
    and advanced by the quantized values of entries ``t`` (where ``live`` if ``MASKED``) under probabilities ``p
    [ROWS, BLOCK_T]``: row ``(c, m)`` adds ``round16(p ⊙ s_c) · code`` (every channel; the epilogue keeps group
    ``c``'s) and ``p · z_c``."""
    cg = tl.arange(0, CR)  # channel group of each copy of the query rows (CR >= C; the copies past C read nothing)
    par = base_p + cg[:, None] * s_vpc + t[None, :]
    ptrs = vc_ptr + base_c + vp[:, None] * s_vcp + t[None, :]
    if MASKED:
        ok = (cg < C)[:, None] & live[None, :]
        byte = tl.load(ptrs, mask=live[None, :], other=0)
    else:
        ok = (cg < C)[:, None]
        byte = tl.load(ptrs)
    vsr = tl.load(vs_ptr + par, mask=ok, other=0.0).to(tl.float32)  # [CR, BLOCK_T], spread over the MB query rows
    vzr = tl.load(vz_ptr + par, mask=ok, other=0.0).to(tl.float32)
    vsr = tl.reshape(tl.broadcast_to(vsr[:, None, :], (CR, MB, vsr.shape[1])), (CR * MB, vsr.shape[1]))
    vzr = tl.reshape(tl.broadcast_to(vzr[:, None, :], (CR, MB, vzr.shape[1])), (CR * MB, vzr.shape[1]))
    ph = (p * vsr).to(tl.float16)
    zs = zs * alpha + tl.sum(p * vzr, 1)
    return acc * alpha[:, None] + _hdot(ph, tl.trans(code_rows(byte, VBITS, ASM)), HALF), zs


@triton.jit
def _folded_tile(
    qk, m_i, l_i, acc, zs, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, base_kc, base_kp, base_vc, base_vp,
    kp, kch, vp, t, g, s_kcp, s_kpc, s_vcp, s_vpc, scale,
    C: tl.constexpr, CR: tl.constexpr, MB: tl.constexpr, BLOCK_T: tl.constexpr, KBITS: tl.constexpr,
    VBITS: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr, KSPLIT: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_T`` entries ``t`` (one key group at offset ``g``) whose keys and values are all quantized:
    the folded path, no mask -- the logits from the raw key codes (:func:`_key_logits`), the online-softmax step and
    the values' folded products (:func:`_value_step`). Returns the running ``(m_i, l_i, acc, zs)``. Shared by the
    contiguous kernel and the paged one (:mod:`kvcodec.kernels.triton_decode_v2_paged`)."""
    every = t >= 0
    logits = _key_logits(qk, kc_ptr, ks_ptr, kz_ptr, base_kc, base_kp, kp, kch, t, g, every, s_kcp, s_kpc, scale,
                         CR, BLOCK_T, KBITS, HALF, ASM, KSPLIT, False)  # fmt: skip
    m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
    acc, zs = _value_step(acc, zs, alpha, p, vc_ptr, vs_ptr, vz_ptr, base_vc, base_vp, vp, t, every, s_vcp, s_vpc,
                          C, CR, MB, VBITS, HALF, ASM, False)  # fmt: skip
    return m_new, l_i, acc, zs


@triton.jit
def _full_key_logits(qk, kr_ptr, base, rows, live, kch, scale, D: tl.constexpr, CR: tl.constexpr, DOT: tl.constexpr):
    """float32 ``[CR * MB, BLOCK_T]`` scaled logits of full-precision key rows ``rows`` (row stride ``D``, from
    ``base``; only the rows where ``live`` are read, the others' logits are garbage: callers select), the product in
    the cache dtype on the matrix units where ``DOT`` (exact products)."""
    kt = tl.load(kr_ptr + base + rows[None, :] * D + kch[:, None], mask=live[None, :], other=0.0)
    return qk_dot(as_dot(_rows(qk, CR), DOT), tl.trans(kt.to(tl.float32)), DOT) * scale


@triton.jit
def _full_value_step(acc, p, ring_ptr, base, rows, live, vch, D: tl.constexpr, DOT: tl.constexpr):
    """``acc`` advanced by full-precision value rows ``rows`` (row stride ``D``, from ``base``) under the
    probabilities ``p`` where ``live`` (channels in ``vch`` order)."""
    vt = tl.load(ring_ptr + base + rows[None, :] * D + vch[:, None], mask=live[None, :], other=0.0)
    return acc + pv_dot(tl.where(live[None, :], p, 0.0), tl.trans(vt.to(tl.float32)), DOT)


@triton.jit
def _store_split(outp_ptr, lsep_ptr, row0, acc, zs, m_i, l_i, mrow, crow, qok, vch, D: tl.constexpr, GV: tl.constexpr):
    """The split's normalised output (row ``(c, m)`` keeps channel group ``c``'s channels) and log-sum-exp (``-inf``
    where nothing was seen) at query rows ``row0 + m``."""
    seen = l_i > 0
    inv = 1.0 / tl.where(seen, l_i, 1.0)
    row = row0 + mrow
    keep = qok[:, None] & (crow[:, None] == (vch // GV)[None, :])  # row (c, m) holds channel group c's outputs
    tl.store(outp_ptr + row[:, None] * D + vch[None, :], (acc + zs[:, None]) * inv[:, None], mask=keep)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lsep_ptr + row, lse, mask=qok & (crow == 0))


@triton.jit
def _load_query(q_ptr, qrow0, M, kch, D: tl.constexpr, MB: tl.constexpr):
    """float32 ``[MB, D]`` query rows ``qrow0 .. qrow0 + M - 1`` (zeros past ``M``) over the key operand's channels
    ``kch`` (the softmax scale goes with the parameters)."""
    mq = tl.arange(0, MB)
    q = tl.load(q_ptr + (qrow0 + mq)[:, None] * D + kch[None, :], mask=(mq < M)[:, None], other=0.0)
    return q.to(tl.float32)


_RUNTIME = ["tk", "nr", "tv", "nv", "head", "s_kcs", "s_kcp", "s_kps", "s_kpc", "s_vcs", "s_vcp", "s_vps", "s_vpc"]


@triton.jit(do_not_specialize=_RUNTIME)
def _decode_v2_kernel(
    q_ptr, outp_ptr, lsep_ptr,
    kc_ptr, ks_ptr, kz_ptr, kr_ptr, vc_ptr, vs_ptr, vz_ptr, ring_ptr,
    s_kcs, s_kcp, s_kps, s_kpc, s_krs, s_vcs, s_vcp, s_vps, s_vpc, s_rgs,
    M, tk, nr, tv, nv, head, scale,
    D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, MB: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr, TILES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    DOT: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr, KSPLIT: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    s64 = s.to(tl.int64)
    if ALIGNED:  # the host checked these are multiples of 16 (kvcodec.kernels.alignment): code and value-parameter
        s_kcs = s_kcs // 16 * 16  # rows then load as vectors
        s_kcp = s_kcp // 16 * 16
        s_vcs = s_vcs // 16 * 16
        s_vcp = s_vcp // 16 * 16
        s_vps = s_vps // 16 * 16
        s_vpc = s_vpc // 16 * 16
    KL: tl.constexpr = 8 // KBITS
    KP: tl.constexpr = D // KL
    VL: tl.constexpr = 8 // VBITS
    VP: tl.constexpr = D // VL
    C: tl.constexpr = D // GV
    r = tl.arange(0, ROWS)
    mrow = r % MB  # row (c, m) = c * MB + m: query row m, value channel group c
    crow = r // MB
    qok = mrow < M
    kp = tl.arange(0, KP)
    vp = tl.arange(0, VP)
    dd = tl.arange(0, D)
    kch = lane_channel(dd, KBITS)  # the channel of each row of the key operand (code_rows order)
    vch = lane_channel(dd, VBITS)
    tt = tl.arange(0, BLOCK_T)
    CR: tl.constexpr = ROWS // MB
    qk = _load_query(q_ptr, s64 * M, M, kch, D, MB)
    acc = tl.zeros([ROWS, D], tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    zs = tl.zeros([ROWS], tl.float32)  # Σ p z_c: the value zeros, one correction per row (c, m)
    T = tk + nr
    qend = tl.minimum(tk, tv)
    ring = tl.maximum(nv, 1)
    base_kc = s64 * s_kcs
    base_kp = s64 * s_kps
    base_vc = s64 * s_vcs
    base_vp = s64 * s_vps
    for blk in range(TILES):
        t0 = (sp * TILES + blk) * BLOCK_T
        t = t0 + tt
        g = t0 // G
        if t0 + BLOCK_T <= qend:  # every entry quantized on both sides: the folded path, no mask
            m_i, l_i, acc, zs = _folded_tile(
                qk, m_i, l_i, acc, zs, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, base_kc, base_kp, base_vc,
                base_vp, kp, kch, vp, t, g, s_kcp, s_kpc, s_vcp, s_vpc, scale, C, CR, MB, BLOCK_T, KBITS, VBITS,
                HALF, ASM, KSPLIT,
            )  # fmt: skip
        else:  # next to the residual: the same folded products, masked, and the full-precision rows
            tmask = t < T
            kq = tmask & (t < tk)
            kres = tmask & (t >= tk)
            logits = _key_logits(qk, kc_ptr, ks_ptr, kz_ptr, base_kc, base_kp, kp, kch, t, g, kq, s_kcp, s_kpc,
                                 scale, CR, BLOCK_T, KBITS, HALF, ASM, KSPLIT, True)  # fmt: skip
            lres = _full_key_logits(qk, kr_ptr, s64 * s_krs, tl.maximum(t - tk, 0), kres, kch, scale, D, CR, DOT)
            logits = tl.where(kq[None, :], logits, tl.where(kres[None, :], lres, float("-inf")))
            m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
            vq = tmask & (t < tv)
            vres = tmask & (t >= tv)
            acc, zs = _value_step(acc, zs, alpha, p, vc_ptr, vs_ptr, vz_ptr, base_vc, base_vp, vp, t, vq,
                                  s_vcp, s_vpc, C, CR, MB, VBITS, HALF, ASM, True)  # fmt: skip
            slot = (tl.maximum(t - tv, 0) + head) % ring
            acc = _full_value_step(acc, p, ring_ptr, s64 * s_rgs, slot, vres, vch, D, DOT)
            m_i = m_new
    _store_split(outp_ptr, lsep_ptr, (s64 * tl.num_programs(1) + sp) * M, acc, zs, m_i, l_i, mrow, crow, qok, vch,
                 D, GV)  # fmt: skip


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(cache) -> bool:
    """Whether the kernel takes a :class:`~kvcodec.decode_v2.PackedKIVI`: float16 or bfloat16 cache, power-of-two
    head dim, key group ``G >= 16`` and value group, codes of 1/2/4/8 bits with at least 16 bytes per token and side
    (the per-lane products' inner dimension)."""
    D = cache.D
    return (
        cache.dtype in (torch.float16, torch.bfloat16)
        and _pow2(D)
        and all(b in (1, 2, 4, 8) and D // (8 // b) >= 16 for b in (cache.kbits, cache.vbits))
        and _pow2(cache.group)
        and cache.group >= 16
        and _pow2(cache.vgroup)
        and D % cache.vgroup == 0
    )


def kivi_decode_v2_triton(
    query: torch.Tensor,
    cache,
    scale: float,
    *,
    block_t: int | None = None,
    tiles: int | None = None,
    num_warps: int = 4,
    tensor_cores: bool | None = None,
    asm: bool | None = None,
    key_split: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kvcodec.decode_v2.kivi_decode_v2_ref`: ``(out float32 [S, M, D], lse float32 [S, M, 1])`` of
    ``query [S, M, D]`` over a :class:`~kvcodec.decode_v2.PackedKIVI`, within ``docs/protocols.md``'s tolerance of
    attention over the dequantized cache. ``ValueError`` for a cache the kernel does not take (:func:`supported`).

    ``block_t`` entries per tile (default and at most the key group ``G``, at most 32 by default; at least 16),
    ``tiles`` tiles per program (default :func:`~kvcodec.kernels.triton_attention.split_plan`).
    ``tensor_cores``: float16 operands on the matrix units (default: on CUDA) or their values in IEEE float32.
    ``asm``: the inline-PTX code conversion (default: on CUDA) or its plain-Triton twin. ``key_split``: the folded
    query ``q ⊙ s`` as two float16 parts, two products per lane (default; one part alone keeps the lse within only
    ~2e-3 of the reference at logits of unit scale x sqrt(d), outside the contract)."""
    if not supported(cache):
        raise ValueError(
            "kivi_decode_v2_triton needs a float16/bfloat16 cache, a power-of-two head dim, key group >= 16 and value "
            f"group, >= 16 code bytes per token; got dtype {cache.dtype}, D={cache.D}, G={cache.group}, "
            f"GV={cache.vgroup}, bits {cache.kbits}/{cache.vbits} (kvcodec.decode_v2.kivi_decode_v2_ref takes any)"
        )
    S, M, D = query.shape
    dev = query.device
    T = cache.length
    if S == 0 or M == 0 or T == 0:
        out = torch.zeros(S, M, D, dtype=torch.float32, device=dev)
        return out, torch.full((S, M, 1), float("-inf"), dtype=torch.float32, device=dev)
    G = cache.group
    bt = min(G, block_t if block_t is not None else 32)
    if bt < 16 or not _pow2(bt):
        raise ValueError(f"block_t must be a power of two >= 16 dividing the key group {G}, got {block_t!r}")
    bt, tiles, nsplit = split_plan(T, S, bt, tiles)
    half = query.is_cuda if tensor_cores is None else bool(tensor_cores)
    asm = query.is_cuda if asm is None else bool(asm)
    C = D // cache.vgroup
    MB = triton.next_power_of_2(M)
    rows = max(16, C * MB)
    kc, ks, kz, kr, vc, vs, vz, ring = (
        cache.kc, cache.ks, cache.kz, cache.kr, cache.vc, cache.vs, cache.vz, cache.ring,
    )  # fmt: skip
    for name, t in (("kc", kc), ("ks", ks), ("kz", kz), ("vc", vc), ("vs", vs), ("vz", vz)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, t in (("kr", kr), ("ring", ring)):
        if t.shape[1] > 1 and (t.stride(1) != D or t.stride(2) != 1):
            raise ValueError(f"{name} rows must be contiguous")
    if ks.stride() != kz.stride() or vs.stride() != vz.stride():
        raise ValueError("scales and zeros must share their strides")
    q = query.contiguous()
    # the residual rows' products: in the cache dtype on the matrix units where the query shares it (exact products)
    dot = dot_mode(q, (cache.dtype,), True) if half and q.dtype == cache.dtype else 0
    outp = torch.empty(S, nsplit, M, D, dtype=torch.float32, device=dev)
    lsep = torch.empty(S, nsplit, M, dtype=torch.float32, device=dev)
    _decode_v2_kernel[(S, nsplit)](
        q, outp, lsep, kc, ks, kz, kr, vc, vs, vz, ring,
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), kr.stride(0),
        vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1), ring.stride(0),
        M, cache.tk, cache.nr, cache.tv, cache.nv, cache.head, float(scale),
        D=D, G=G, GV=cache.vgroup, MB=MB, ROWS=rows, BLOCK_T=bt, TILES=tiles, KBITS=cache.kbits,
        VBITS=cache.vbits, DOT=dot, HALF=half, ASM=asm, KSPLIT=key_split,
        ALIGNED=rows_aligned((kc, vc, vs, vz), dims=(0, 1)),
        num_warps=num_warps,
    )  # fmt: skip
    out, lse = merge_splits(outp, lsep, num_warps)
    return out, lse.view(S, M, 1)
