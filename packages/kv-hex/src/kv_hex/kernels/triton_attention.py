"""Triton kernel: fused decode attention over one part of a HEX layer (HEX §3.5; online softmax as in
FlashAttention, Dao et al. 2022 §3.1; the split over entries as in Flash-Decoding).

One program per (batch row, KV head, split) owns the ``G·Q`` query rows of that head (GQA without repeating K/V)
and walks ``NUM_T_BLOCKS`` (a compile-time count) tiles of ``BLOCK_T`` of the head's entries. Each tile's keys and
values are reconstructed in registers by :func:`kv_hex.kernels.triton_dequant._side_tile` (packed codes
dequantized, the static mask's overlay values written over them, full-precision rows and residual rows read as
they are), so the dequantized cache never exists in memory. Each split returns its normalized output and
log-sum-exp, merged on the host; with ``logits=True`` it also writes every entry's scaled logits, from which the
store derives the attention each entry received (HEX §3.3's heavy-hitter accumulator) once every part's
log-sum-exp is known. Products run on the matrix units (``tl.dot``, query rows padded to 16): in the cache dtype
when the query shares it (the probabilities split into parts of that dtype, :mod:`kvcodec.kernels.triton_dot`),
else IEEE float32 (the interpreter's path: its bfloat16 ``tl.dot`` is wrong). GPU speed after this change is
unmeasured; with broadcast-and-sum products HEX-3 decoded at 0.11x DynamicCache's steps/s through kv-hf on an H200.

This module needs ``triton``; :mod:`kv_hex.kernels.dispatch` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_hex.kernels.triton_dequant import _OUT, _nonempty, _side_tile, side_args
from kvcodec.kernels.triton_dot import as_dot, dot_mode, online_softmax_step, qk_dot, softmax_result
from kvcore import merge_split_attention

__all__ = ["part_attention_triton"]


@triton.jit
def _head_queries(
    Q, s, D: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr
):
    """Head ``s``'s ``R`` query rows (``Q`` is ``[S, R, D]``) as a matrix-unit operand, their row and channel
    indices and masks, and an empty online-softmax state ``(m_i, l_i, acc)``."""
    m = tl.arange(0, BLOCK_M)
    mmask = m < R
    d = tl.arange(0, BLOCK_D)
    qmask = mmask[:, None] & (d < D)[None, :]
    q = as_dot(tl.load(Q + (s * R + m[:, None]) * D + d[None, :], mask=qmask, other=0.0), DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m, mmask, d, qmask, q, m_i, l_i, acc


@triton.jit
def _part_attention(
    Q, OUTP, LSEP, LOGITS, START, COUNT, SLOT, HCOLS,
    KIDX, KCODES, KROWS, KSCALE, KZERO, KGRP, KOVER, KOOFF,
    VIDX, VCODES, VROWS, VSCALE, VZERO, VGRP, VOVER, VOOFF,
    KPW, VPW, scale,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, OUT: tl.constexpr,
    VPC: tl.constexpr, NUM_T_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LOGITS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    h = s % H
    start = tl.load(START + s).to(tl.int64)
    count = tl.load(COUNT + s)
    m, mmask, d, qmask, q, m_i, l_i, acc = _head_queries(Q, s, D, R, BLOCK_M, BLOCK_D, DOT)
    for blk in range(NUM_T_BLOCKS):
        t = (sp * NUM_T_BLOCKS + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < count
        e = start + t
        slot = tl.load(SLOT + e, mask=tmask, other=0)
        k = _side_tile(KIDX, KCODES, KROWS, KSCALE, KZERO, KGRP, KOVER, KOOFF, HCOLS, e, tmask, slot, h, d, KPW,
                       H, D, BITS, True, W, OUT)  # fmt: skip
        v = _side_tile(VIDX, VCODES, VROWS, VSCALE, VZERO, VGRP, VOVER, VOOFF, HCOLS, e, tmask, slot, h, d, VPW,
                       H, D, BITS, VPC, W, OUT)  # fmt: skip
        logits = qk_dot(q, k, DOT)  # on the matrix units (kvcodec.kernels.triton_dot)
        logits = logits * scale
        logits = tl.where(tmask[None, :], logits, float("-inf"))
        if WRITE_LOGITS:
            tl.store(LOGITS + e[None, :] * R + m[:, None], logits, mask=mmask[:, None] & tmask[None, :])
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    out, lse = softmax_result(m_i, l_i, acc)
    row = (s * tl.num_programs(1) + sp) * R + m  # the split count is the grid's (no recompile as T grows)
    tl.store(OUTP + row[:, None] * D + d[None, :], out, mask=qmask)
    tl.store(LSEP + row, lse, mask=mmask)


def part_attention_triton(
    query: torch.Tensor,
    part,
    scale: float,
    logits: bool = False,
    block_t: int = 32,
    max_blocks: int = 8,
    tensor_cores: bool | None = None,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton :func:`~kv_hex.kernels.reference.part_attention` (same arguments, same results up to float32
    summation order). Each program walks at most ``max_blocks`` tiles of ``block_t`` entries (at least 16, for
    ``tl.dot``); longer heads are split across programs and merged by log-sum-exp. ``tensor_cores``: products in
    the cache dtype on the matrix units (the query and the part both float16 or both bfloat16; default: on CUDA
    when they are), else IEEE float32 (the interpreter's path: its bfloat16 ``tl.dot`` is wrong)."""
    block_t = max(16, triton.next_power_of_2(block_t))
    dot = dot_mode(query, (part.dtype,), tensor_cores)
    B, Hq, Q, D = query.shape
    H, S, T, N = part.H, part.B * part.H, part.T, part.num_entries
    G = Hq // H
    R = G * Q
    device = query.device
    lg = torch.empty(N, R, device=device, dtype=torch.float32) if logits else None
    if S == 0 or T == 0 or R == 0 or D == 0:
        out = torch.zeros(B, Hq, Q, D, device=device)
        return out, torch.full((B, Hq, Q), float("-inf"), device=device), lg
    nblk = min(triton.cdiv(T, block_t), max_blocks)
    nsplit = triton.cdiv(T, nblk * block_t)
    outp = torch.empty(S, nsplit, R, D, device=device, dtype=torch.float32)
    lsep = torch.empty(S, nsplit, R, device=device, dtype=torch.float32)
    q = (query if dot else query.float()).reshape(B, H, G, Q, D).reshape(S, R, D).contiguous()
    kargs, kpw = side_args(part.k, D)
    vargs, vpw = side_args(part.v, D)
    _part_attention[(S, nsplit)](
        q, outp, lsep, lg if logits else lsep, part.start.contiguous(), part.count.contiguous(),
        _nonempty(part.slot, (1,)), _nonempty(part.hcols, (1,)), *kargs, *vargs, kpw, vpw, float(scale),
        H=H, D=D, R=R, BITS=part.bits, W=part.hcols.shape[-1], OUT=_OUT[part.dtype], VPC=part.v.per_channel,
        NUM_T_BLOCKS=nblk, BLOCK_T=block_t, BLOCK_M=max(16, triton.next_power_of_2(R)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), WRITE_LOGITS=logits, DOT=dot,
        num_warps=num_warps,
        enable_fp_fusion=False,  # keys and values dequantize bit-exactly as in read()
    )  # fmt: skip
    out, lse = merge_split_attention(outp, lsep, dim=1)  # [S, R, D], [S, R]
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q), lg
