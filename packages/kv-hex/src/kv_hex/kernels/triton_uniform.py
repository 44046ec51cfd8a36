"""Triton kernel: fused decode attention over a uniform HEX segment and the residual, addressed by arithmetic (HEX
§3.5; online softmax as in FlashAttention, Dao et al. 2022 §3.1; splits merged as in Flash-Decoding).

One program per (batch row, KV head, split) owns the ``G·Q`` query rows of that head (GQA without repeating K/V).
The first ``stack · seg_splits`` splits walk the segment's entries ``e = s·n + t`` in tiles of ``BLOCK_T`` (for a
stack of ``m`` segments, :func:`kv_hex.segment.stack_segments`, segment ``i`` holds this head's entries as its head
``(i·B + b)·H + h``): an entry's "full-precision row" bit is read from the segment's packed flags, its full row / code
row from one running count (:attr:`kv_hex.uniform.UniformPart.before`), its key statistics are the head's row (one
row per tile), its value statistics the (batch row, slot)'s or the code row's, its mask row is its slot ``t`` and its
overlay values start at the second running count; codes are dequantized and the overlay merged in registers by the
same tile loader as the general kernel (:func:`kv_hex.kernels.triton_dequant._entry_tile`). The remaining splits walk
the residual's full-precision rows ``[S, T_r, D]``. Every split writes its normalized output and log-sum-exp into one
buffer shared by all the calls of a step, merged by one launch of kvcodec's merge kernel; the scaled logits of the
residual (and, in full mode, of the segment) are written for the heavy-hitter accumulator. Lengths, stack size,
split counts and offsets are run-time arguments that are not specialised, so a decode compiles one variant per kind
of call. GPU speed is unmeasured.

This module needs ``triton``; :mod:`kv_hex.kernels.dispatch` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_hex.kernels.triton_attention import _head_queries
from kv_hex.kernels.triton_dequant import _OUT, _entry_tile, _nonempty
from kvcodec.kernels.triton_attention import merge_splits
from kvcodec.kernels.triton_dot import dot_mode, online_softmax_step, qk_dot, softmax_result

__all__ = ["uniform_attention_triton"]


@triton.jit(do_not_specialize=["n", "TR", "SEG_SPLITS", "STACK", "SPLIT0", "NSPLIT"])
def _uniform_attention(
    Q, OUTP, LSEP, SLOG, RLOG,
    FLAGS, BEFORE, HCOLS,
    KCODES, KROWS, KSCALE, KZERO, KOVER,
    VCODES, VROWS, VSCALE, VZERO, VOVER,
    RK, RV,
    n, TR, SEG_SPLITS, STACK, SPLIT0, NSPLIT, KPW, VPW, scale,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr,
    VLAYER: tl.constexpr, SEG_BLOCKS: tl.constexpr, RES_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SEG_LOGITS: tl.constexpr, RES_LOGITS: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    h = s % H
    b = s // H
    m, mmask, d, qmask, q, m_i, l_i, acc = _head_queries(Q, s, D, R, BLOCK_M, BLOCK_D, DOT)
    dmask = d < D
    N = STACK * tl.num_programs(0).to(tl.int64) * n  # entries of the segment (of every segment of a stack)
    if sp < STACK * SEG_SPLITS:
        # segment i of a stack holds this head's entries as its head (i·B + b)·H + h
        i = sp // SEG_SPLITS
        bx = i * (tl.num_programs(0) // H) + b
        sx = bx * H + h
        for blk in range(SEG_BLOCKS):
            t = ((sp - i * SEG_SPLITS) * SEG_BLOCKS + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < n
            e = sx.to(tl.int64) * n + t
            bit = (tl.load(FLAGS + (e >> 3), mask=tmask, other=0) >> (e & 7).to(tl.uint8)) & 1
            isfull = tmask & (bit != 0)
            quant = tmask & (bit == 0)
            cf = tl.load(BEFORE + e, mask=tmask, other=0).to(tl.int64)
            r = tl.where(quant, e - cf, 0)
            f = tl.where(isfull, cf, 0)
            off = tl.load(BEFORE + N + e, mask=quant, other=0).to(tl.int64) if W > 0 else r  # r: never read
            vg = bx.to(tl.int64) * n + t if VLAYER else r
            k = _entry_tile(KCODES, KROWS, KSCALE, KZERO, KOVER, HCOLS, quant, isfull, r, f, sx.to(tl.int64), off,
                            t, h, d, KPW, H, D, BITS, 2, W, OUT)  # fmt: skip
            v = _entry_tile(VCODES, VROWS, VSCALE, VZERO, VOVER, HCOLS, quant, isfull, r, f, vg, off, t, h, d, VPW,
                            H, D, BITS, 0, W, OUT)  # fmt: skip
            logits = qk_dot(q, k, DOT) * scale
            logits = tl.where(tmask[None, :], logits, float("-inf"))
            if SEG_LOGITS:
                tl.store(SLOG + e[None, :] * R + m[:, None], logits, mask=mmask[:, None] & tmask[None, :])
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    else:
        for blk in range(RES_BLOCKS):
            t = ((sp - STACK * SEG_SPLITS) * RES_BLOCKS + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < TR
            e = s.to(tl.int64) * TR + t
            rmask = tmask[:, None] & dmask[None, :]
            k = tl.load(RK + e[:, None] * D + d[None, :], mask=rmask, other=0.0).to(tl.float32)
            v = tl.load(RV + e[:, None] * D + d[None, :], mask=rmask, other=0.0).to(tl.float32)
            logits = qk_dot(q, k, DOT) * scale
            logits = tl.where(tmask[None, :], logits, float("-inf"))
            if RES_LOGITS:
                tl.store(RLOG + e[None, :] * R + m[:, None], logits, mask=mmask[:, None] & tmask[None, :])
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    out, lse = softmax_result(m_i, l_i, acc)
    row = (s * NSPLIT + SPLIT0 + sp) * R + m  # this launch's splits in the shared partials
    tl.store(OUTP + row[:, None] * D + d[None, :], out, mask=qmask)
    tl.store(LSEP + row, lse, mask=mmask)


def _splits(call, block_t: int, max_blocks: int, res_blocks: int) -> tuple[int, int, int]:
    """``(tiles per segment split, splits per segment, all splits)`` of one call's launch."""
    n = call.part.n
    nblk = min(triton.cdiv(n, block_t), max_blocks)
    seg_splits = triton.cdiv(n, nblk * block_t)
    TR = 0 if call.res_k is None else call.res_k.shape[1]
    res_splits = triton.cdiv(TR, res_blocks * block_t) if call.res_k is not None else 0
    return nblk, seg_splits, call.stack * seg_splits + res_splits


def uniform_attention_triton(
    query: torch.Tensor,
    calls: list,
    scale: float,
    *,
    res_blocks: int = 4,
    block_t: int = 32,
    max_blocks: int = 8,
    tensor_cores: bool | None = None,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """Triton :func:`~kv_hex.kernels.reference.uniform_attention` (same arguments, same results up to float32
    summation order): one launch per call writing its splits into one buffer of partial results, merged by one
    launch of kvcodec's merge kernel. Segment splits walk at most ``max_blocks`` tiles of ``block_t`` entries (at
    least 16, for ``tl.dot``); residual splits ``res_blocks`` tiles (a constant, so the residual's growth compiles
    nothing). A stack's segments are addressed in the kernel (no repeated query, no merge of its own).
    ``tensor_cores``: products in the cache dtype on the matrix units (as :mod:`kv_hex.kernels.triton_attention`)."""
    block_t = max(16, triton.next_power_of_2(block_t))
    dot = dot_mode(query, (calls[0].part.dtype,), tensor_cores)  # the calls' parts share the cache dtype
    if not dot:
        block_t = 16  # the IEEE float32 products: 32-entry tiles spill on sm_90 (144 bytes at Llama-3-8B's shape)
    B, Hq, Q, D = query.shape
    H = calls[0].part.H
    S = B * H
    G = Hq // H
    R = G * Q
    device = query.device
    shapes = [_splits(c, block_t, max_blocks, res_blocks) for c in calls]
    nsplit = sum(x[2] for x in shapes)
    outp = torch.empty(S, nsplit, R, D, device=device, dtype=torch.float32)
    lsep = torch.empty(S, nsplit, R, device=device, dtype=torch.float32)
    q = (query if dot else query.float()).reshape(B, H, G, Q, D).reshape(S, R, D).contiguous()
    split0 = 0
    logits = []
    for call, (nblk, seg_splits, splits) in zip(calls, shapes):
        part = call.part
        if part.dtype != calls[0].part.dtype:
            raise ValueError(f"the calls' parts must share one cache dtype, got {calls[0].part.dtype} and {part.dtype}")
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
        _uniform_attention[(S, splits)](
            q, outp, lsep, slg if slg is not None else lsep, rlg if rlg is not None else lsep,
            part.flags, part.before, _nonempty(part.hcols, (1,)),
            _nonempty(part.k_codes, (1, max(pw, 1))), _nonempty(part.k_rows, (1, D)),
            _nonempty(part.k_scale, (1,), torch.float32), _nonempty(part.k_zero, (1,), torch.float32),
            _nonempty(part.k_over, (1,), part.dtype),
            _nonempty(part.v_codes, (1, max(pw, 1))), _nonempty(part.v_rows, (1, D)),
            _nonempty(part.v_scale, (1,), torch.float32), _nonempty(part.v_zero, (1,), torch.float32),
            _nonempty(part.v_over, (1,), part.dtype),
            rk, rv, part.n, TR, seg_splits, call.stack, split0, nsplit, pw, part.v_codes.shape[1], float(scale),
            H=H, D=D, R=R, BITS=part.bits, W=part.hcols.shape[-1], OUT=_OUT[part.dtype], VLAYER=part.value_layer,
            SEG_BLOCKS=nblk, RES_BLOCKS=res_blocks, BLOCK_T=block_t, BLOCK_M=max(16, triton.next_power_of_2(R)),
            BLOCK_D=max(16, triton.next_power_of_2(D)), SEG_LOGITS=call.seg_logits, RES_LOGITS=call.res_logits,
            DOT=dot, num_warps=num_warps,
            enable_fp_fusion=False,  # keys and values dequantize bit-exactly as in read()
        )  # fmt: skip
        split0 += splits
        logits.append((slg, rlg))
    out, lse = merge_splits(outp, lsep)  # [S, R, D], [S, R]
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q), logits
