"""Triton kernel: decode attention v2 (folded) over HEX's uniform segments and the residual (issue 43).

Same signature and contract as :func:`kv_hex.kernels.folded.uniform_decode_v2_ref` (its PyTorch reference, and
:func:`kv_hex.kernels.reference.uniform_attention`'s arguments and results): agreement with attention over the
dequantized entries within ``docs/protocols.md``'s tolerance, not bit for bit. The launch structure is
:mod:`kv_hex.kernels.triton_uniform`'s (one program per (batch row, KV head, split), segment splits then residual
splits, every call's splits into one buffer merged by one launch; entries addressed by arithmetic from the flags and
the two running counts); the segment tile is folded (:mod:`kv_hex.kernels.folded`):

* codes become float16 operands by their bits (:func:`code_tile`): the ``BITS`` bytes of a chunk of 8 codes are
  assembled into one word, and each lane ``j``'s field ``(w >> BITS·j) & mask`` is OR-ed into 1024.0's mantissa and
  1024 subtracted in float16 (exact) -- 3-bit codes straddle bytes, so the word is assembled first; the 8 lanes are
  joined in natural channel order;
* keys: the head's parameter row (one per segment) folded into the query once per program, ``q ⊙ s · scale`` as two
  float16 parts, times the raw codes on the matrix units, plus the bias ``q · z · scale``;
* values: ``round16(p_t s_t) · code`` plus ``Σ_t p_t z_t`` per query row (one statistic per entry);
* overlay: per tile, ``W`` steps each gathering one overlay channel per entry, its value and its code: the key logit
  gets ``q_c (o - s_c code - z_c) · scale`` (sparse), the value correction ``o - s_t code - z_t`` is selected into a
  dense ``[T, D]`` tile taken by one more product ``round16(p) · round16(Δ)``;
* full-precision entries (heavy hitters, the recent window) are read as rows under masks, as the current kernel.

This module needs ``triton``; :mod:`kv_hex.kernels.folded` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_hex.kernels.triton_dequant import _nonempty
from kvcodec.kernels.triton_attention import merge_splits
from kvcodec.kernels.triton_decode_v2 import _hdot
from kvcodec.kernels.triton_dot import _weights, as_dot, dot_mode, online_softmax_step, pv_dot, qk_dot

__all__ = ["code_tile", "supported", "uniform_decode_v2_triton"]

BITS_TAKEN = (2, 3, 4, 8)


@triton.jit
def _lane(w, BITS: tl.constexpr, J: tl.constexpr):
    """float16 code of lane ``J`` of the int32 words ``w`` (a chunk of 8 codes): the field OR-ed into 1024.0's
    mantissa, 1024 subtracted in float16 (both exact)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    h = (((w >> (BITS * J)) & MASK) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return h - 1024.0


@triton.jit
def code_tile(CODES, r, quant, PW, BITS: tl.constexpr, D: tl.constexpr):
    """float16 ``[BT, D]`` codes of code rows ``r [BT]`` (0 where not ``quant``), natural channel order: 8 codes per
    ``BITS`` bytes, assembled into one word per chunk (3 bits straddle bytes), lanes joined."""
    if BITS == 8:
        d = tl.arange(0, D)
        b = tl.load(CODES + r[:, None] * PW + d[None, :], mask=quant[:, None], other=0)
        return (b.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        K: tl.constexpr = D // 8
        kk = tl.arange(0, K)
        base = CODES + r[:, None] * PW + kk[None, :] * BITS
        w = tl.load(base, mask=quant[:, None], other=0).to(tl.int32)
        for i in tl.static_range(1, BITS):
            w = w | (tl.load(base + i, mask=quant[:, None], other=0).to(tl.int32) << (8 * i))
        x = tl.join(
            tl.join(tl.join(_lane(w, BITS, 0), _lane(w, BITS, 1)), tl.join(_lane(w, BITS, 2), _lane(w, BITS, 3))),
            tl.join(tl.join(_lane(w, BITS, 4), _lane(w, BITS, 5)), tl.join(_lane(w, BITS, 6), _lane(w, BITS, 7))),
        )  # [BT, K, i0, i1, i2]: lane i0 + 2 i1 + 4 i2
        BT: tl.constexpr = r.shape[0]
        return tl.reshape(tl.permute(x, (0, 1, 4, 3, 2)), (BT, D))


@triton.jit
def _one_code(CODES, r, c, ok, PW, BITS: tl.constexpr):
    """float32 code at channel ``c [BT]`` of code rows ``r [BT]`` (two bytes read and shifted: any width)."""
    bitpos = c * BITS
    byte = bitpos // 8
    b0 = tl.load(CODES + r * PW + byte, mask=ok, other=0).to(tl.int32)
    b1 = tl.load(CODES + r * PW + byte + 1, mask=ok & ((byte + 1) < PW), other=0).to(tl.int32)
    return (((b0 | (b1 << 8)) >> (bitpos % 8)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit(do_not_specialize=["n", "TR", "SEG_SPLITS", "STACK", "SPLIT0", "NSPLIT"])
def _folded_attention(
    Q, OUTP, LSEP, SLOG, RLOG,
    FLAGS, BEFORE, HCOLS,
    KCODES, KROWS, KSCALE, KZERO, KOVER,
    VCODES, VROWS, VSCALE, VZERO, VOVER,
    RK, RV,
    n, TR, SEG_SPLITS, STACK, SPLIT0, NSPLIT, KPW, VPW, scale,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
    VLAYER: tl.constexpr, SEG_BLOCKS: tl.constexpr, RES_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, SEG_LOGITS: tl.constexpr, RES_LOGITS: tl.constexpr, DOT: tl.constexpr,
    HALF: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    h = s % H
    b = s // H
    m = tl.arange(0, BLOCK_M)
    mmask = m < R
    d = tl.arange(0, D)
    qmask = mmask[:, None]
    q = tl.load(Q + (s * R + m[:, None]) * D + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    zs = tl.zeros([BLOCK_M], tl.float32)
    N = STACK * tl.num_programs(0).to(tl.int64) * n
    if sp < STACK * SEG_SPLITS:
        i = sp // SEG_SPLITS
        bx = i * (tl.num_programs(0) // H) + b
        sx = bx * H + h
        sx64 = sx.to(tl.int64)
        # the head's key parameters, folded into the query once per program
        ks = tl.load(KSCALE + sx64 * D + d).to(tl.float32) * scale
        kz = tl.load(KZERO + sx64 * D + d).to(tl.float32) * scale
        qf = q * ks[None, :]
        qh = qf.to(tl.float16)
        ql = (qf - qh.to(tl.float32)).to(tl.float16)
        bias = tl.sum(q * kz[None, :], 1)
        qd = as_dot(q, DOT)
        for blk in range(SEG_BLOCKS):
            t = ((sp - i * SEG_SPLITS) * SEG_BLOCKS + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < n
            e = sx64 * n + t
            bit = (tl.load(FLAGS + (e >> 3), mask=tmask, other=0) >> (e & 7).to(tl.uint8)) & 1
            isfull = tmask & (bit != 0)
            quant = tmask & (bit == 0)
            cf = tl.load(BEFORE + e, mask=tmask, other=0).to(tl.int64)
            r = tl.where(quant, e - cf, 0)
            kh = code_tile(KCODES, r, quant, KPW, BITS, D)
            logits = _hdot(qh, tl.trans(kh), HALF) + _hdot(ql, tl.trans(kh), HALF) + bias[:, None]
            vidx = bx.to(tl.int64) * n + t if VLAYER else r
            vs = tl.load(VSCALE + vidx, mask=quant, other=0.0).to(tl.float32)
            vz = tl.load(VZERO + vidx, mask=quant, other=0.0).to(tl.float32)
            if W > 0:
                off = tl.load(BEFORE + N + e, mask=quant, other=0).to(tl.int64)
                dv = tl.zeros([BLOCK_T, D], tl.float32)
                hc = (t.to(tl.int64) * H + h) * W
                for j in range(W):
                    c = tl.load(HCOLS + hc + j, mask=quant, other=-1)
                    ok = quant & (c >= 0)
                    cc = tl.where(ok, c, 0)
                    ko = tl.load(KOVER + off + j, mask=ok, other=0.0).to(tl.float32)
                    kcode = _one_code(KCODES, r, cc, ok, KPW, BITS)
                    ksc = tl.load(KSCALE + sx64 * D + cc, mask=ok, other=0.0).to(tl.float32)
                    kzc = tl.load(KZERO + sx64 * D + cc, mask=ok, other=0.0).to(tl.float32)
                    qc = tl.load(Q + (s * R + m[:, None]) * D + cc[None, :], mask=qmask & ok[None, :], other=0.0)
                    logits += qc.to(tl.float32) * (tl.where(ok, ko - (kcode * ksc + kzc), 0.0) * scale)[None, :]
                    vo = tl.load(VOVER + off + j, mask=ok, other=0.0).to(tl.float32)
                    vcode = _one_code(VCODES, r, cc, ok, VPW, BITS)
                    delta = vo - (vcode * vs + vz)
                    dv = tl.where((d[None, :] == c[:, None]) & ok[:, None], delta[:, None], dv)
            if FULL:
                fk = tl.load(KROWS + cf[:, None] * D + d[None, :], mask=isfull[:, None], other=0.0).to(tl.float32)
                lf = qk_dot(qd, fk, DOT) * scale
                logits = tl.where(isfull[None, :], lf, logits)
            logits = tl.where(tmask[None, :], logits, float("-inf"))
            if SEG_LOGITS:
                tl.store(SLOG + e[None, :] * R + m[:, None], logits, mask=mmask[:, None] & tmask[None, :])
            m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
            acc = acc * alpha[:, None]
            zs = zs * alpha
            pq = tl.where(quant[None, :], p, 0.0)
            ph = (pq * vs[None, :]).to(tl.float16)
            acc += _hdot(ph, code_tile(VCODES, r, quant, VPW, BITS, D), HALF)
            zs += tl.sum(pq * vz[None, :], 1)
            if W > 0:
                acc += _hdot(pq.to(tl.float16), dv.to(tl.float16), HALF)
            if FULL:
                fv = tl.load(VROWS + cf[:, None] * D + d[None, :], mask=isfull[:, None], other=0.0).to(tl.float32)
                acc += pv_dot(tl.where(isfull[None, :], p, 0.0), fv, DOT)
            m_i = m_new
    else:
        qd = as_dot(q, DOT)
        for blk in range(RES_BLOCKS):
            t = ((sp - STACK * SEG_SPLITS) * RES_BLOCKS + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < TR
            e = s.to(tl.int64) * TR + t
            k = tl.load(RK + e[:, None] * D + d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            v = tl.load(RV + e[:, None] * D + d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            logits = qk_dot(qd, k, DOT) * scale
            logits = tl.where(tmask[None, :], logits, float("-inf"))
            if RES_LOGITS:
                tl.store(RLOG + e[None, :] * R + m[:, None], logits, mask=mmask[:, None] & tmask[None, :])
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    seen = l_i > 0
    out = (acc + zs[:, None]) / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (s * NSPLIT + SPLIT0 + sp) * R + m
    tl.store(OUTP + row[:, None] * D + d[None, :], out, mask=qmask)
    tl.store(LSEP + row, lse, mask=mmask)


def supported(query: torch.Tensor, calls: list) -> bool:
    """Whether the kernel takes the calls: a float16 / bfloat16 cache and query, a power-of-two head dim of at least
    16, codes of 2, 3, 4 or 8 bits."""
    part = calls[0].part
    D = part.D
    return (
        query.dtype in (torch.float16, torch.bfloat16)
        and all(c.part.dtype == query.dtype and c.part.bits in BITS_TAKEN for c in calls)
        and D >= 16
        and not D & (D - 1)
    )


def uniform_decode_v2_triton(
    query: torch.Tensor,
    calls: list,
    scale: float,
    *,
    res_blocks: int = 4,
    block_t: int = 32,
    max_blocks: int = 8,
    num_warps: int = 4,
    tensor_cores: bool | None = None,
    full_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """Triton :func:`~kv_hex.kernels.folded.uniform_decode_v2_ref` (same arguments and results up to the contract):
    one launch per call, one merge. ``ValueError`` for calls it does not take (:func:`supported`). Splits as
    :func:`kv_hex.kernels.triton_uniform.uniform_attention_triton`; ``tensor_cores``: the float16 operands on the
    matrix units (default on CUDA; else their float32 values in IEEE products, as the interpreter needs).
    ``full_rows=False`` compiles the full-row branches out (wrong for a segment holding full rows: a measurement
    option for the instruction counts)."""
    if not supported(query, calls):
        raise ValueError(
            "uniform_decode_v2_triton needs a float16/bfloat16 cache and query, a power-of-two head dim >= 16 and "
            f"codes of {BITS_TAKEN} bits (kv_hex.kernels.folded.uniform_decode_v2_ref takes any)"
        )
    half = query.is_cuda if tensor_cores is None else bool(tensor_cores)
    dot = dot_mode(query, (calls[0].part.dtype,), None) if half else 0
    block_t = max(16, triton.next_power_of_2(block_t))
    B, Hq, Q, D = query.shape
    H = calls[0].part.H
    S, R = B * H, Hq // H * Q
    device = query.device
    shapes = []
    for c in calls:
        nblk = min(triton.cdiv(c.part.n, block_t), max_blocks)
        seg_splits = triton.cdiv(c.part.n, nblk * block_t)
        TR = 0 if c.res_k is None else c.res_k.shape[1]
        res_splits = triton.cdiv(TR, res_blocks * block_t) if c.res_k is not None else 0
        shapes.append((nblk, seg_splits, c.stack * seg_splits + res_splits))
    nsplit = sum(x[2] for x in shapes)
    outp = torch.empty(S, nsplit, R, D, device=device, dtype=torch.float32)
    lsep = torch.empty(S, nsplit, R, device=device, dtype=torch.float32)
    q = query.reshape(B, H, Hq // H, Q, D).reshape(S, R, D).contiguous()
    split0 = 0
    logits = []
    for call, (nblk, seg_splits, splits) in zip(calls, shapes):
        part = call.part
        if B * call.stack != part.B or part.H != H:
            raise ValueError(
                f"a call of {call.stack} segment(s) over batch {B}, {H} KV heads needs {B * call.stack} rows and "
                f"{H} heads, got {part.B} and {part.H}"
            )
        TR = 0 if call.res_k is None else call.res_k.shape[1]
        slg = torch.empty(part.num_entries, R, device=device, dtype=torch.float32) if call.seg_logits else None
        rlg = torch.empty(S * TR, R, device=device, dtype=torch.float32) if call.res_logits else None
        rk = _nonempty(call.res_k.reshape(-1, D) if TR else part.k_rows[:0], (1, D), part.dtype)
        rv = _nonempty(call.res_v.reshape(-1, D) if TR else part.v_rows[:0], (1, D), part.dtype)
        pw = part.k_codes.shape[1]
        _folded_attention[(S, splits)](
            q, outp, lsep, slg if slg is not None else lsep, rlg if rlg is not None else lsep,
            part.flags, part.before, _nonempty(part.hcols, (1,)),
            _nonempty(part.k_codes, (1, max(pw, 1))), _nonempty(part.k_rows, (1, D)),
            _nonempty(part.k_scale, (1,), torch.float32), _nonempty(part.k_zero, (1,), torch.float32),
            _nonempty(part.k_over, (1,), part.dtype),
            _nonempty(part.v_codes, (1, max(pw, 1))), _nonempty(part.v_rows, (1, D)),
            _nonempty(part.v_scale, (1,), torch.float32), _nonempty(part.v_zero, (1,), torch.float32),
            _nonempty(part.v_over, (1,), part.dtype),
            rk, rv, part.n, TR, seg_splits, call.stack, split0, nsplit, pw, part.v_codes.shape[1], float(scale),
            H=H, D=D, R=R, BITS=part.bits, W=part.hcols.shape[-1], VLAYER=part.value_layer,
            SEG_BLOCKS=nblk, RES_BLOCKS=res_blocks, BLOCK_T=block_t, BLOCK_M=max(16, triton.next_power_of_2(R)),
            SEG_LOGITS=call.seg_logits, RES_LOGITS=call.res_logits, DOT=dot, HALF=half, FULL=full_rows,
            num_warps=num_warps,
        )  # fmt: skip
        split0 += splits
        logits.append((slg, rlg))
    out, lse = merge_splits(outp, lsep)
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q), logits
