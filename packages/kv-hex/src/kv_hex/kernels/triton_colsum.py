"""Triton kernel: accumulated causal attention column sums at prefill without the ``T × T`` matrix (HEX §3.3).

Two passes over tiles (FlashAttention's decomposition, Dao et al. 2022 §3.1): pass 1 computes each query row's
log-sum-exp with an online maximum; pass 2 recomputes the logits tile by tile and adds ``exp(s - lse)`` down each
key column, over the queries and the query heads of each KV head's GQA group. Memory is ``O(B·Hq·W)`` for the
log-sum-exps. Same signature and result (up to float32 summation order) as
:func:`kv_hex.kernels.reference.attention_column_sums`. Loop bounds are compile-time constants (``tl.constexpr``)
and dots run in float32 (``input_precision="ieee"``: with a GPU's default TF32 dot the kernel failed its 1e-4
test tolerance on an H200), so the kernel also runs in Triton's interpreter. GPU speed is unmeasured.

This module needs ``triton``; :mod:`kv_hex.kernels.dispatch` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["attention_column_sums_triton"]


@triton.jit
def _row_lse(
    Q, K, VALID, LSE, scale,
    T: tl.constexpr, W: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr,
    BQ: tl.constexpr, BT: tl.constexpr, NT: tl.constexpr,
):  # fmt: skip
    pid_q, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hq = pid_bh // HQ, pid_bh % HQ
    h = hq // G
    qi = pid_q * BQ + tl.arange(0, BQ)
    d = tl.arange(0, D)
    q = tl.load(Q + ((b * HQ + hq) * W + qi[:, None]) * D + d[None, :], mask=qi[:, None] < W, other=0.0)
    q = q.to(tl.float32)
    m = tl.full([BQ], float("-inf"), tl.float32)
    acc = tl.zeros([BQ], tl.float32)
    for it in range(NT):
        t = it * BT + tl.arange(0, BT)
        k = tl.load(K + ((b * (HQ // G) + h) * T + t[:, None]) * D + d[None, :], mask=t[:, None] < T, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        ok = tl.load(VALID + b * T + t, mask=t < T, other=0) != 0
        allowed = (t[None, :] <= (T - W + qi)[:, None]) & ok[None, :] & (t[None, :] < T)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - safe) + tl.sum(tl.exp(s - safe[:, None]), 1)
        m = m_new
    lse = tl.where(acc > 0, tl.log(acc) + m, float("-inf"))
    tl.store(LSE + (b * HQ + hq) * W + qi, lse, mask=qi < W)


@triton.jit
def _col_sums(
    Q, K, VALID, LSE, OUT, scale,
    T: tl.constexpr, W: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr,
    BQ: tl.constexpr, BT: tl.constexpr, NQ: tl.constexpr,
):  # fmt: skip
    pid_t, pid_bh = tl.program_id(0), tl.program_id(1)
    H = HQ // G
    b, h = pid_bh // H, pid_bh % H
    t = pid_t * BT + tl.arange(0, BT)
    d = tl.arange(0, D)
    k = tl.load(K + ((b * H + h) * T + t[:, None]) * D + d[None, :], mask=t[:, None] < T, other=0.0).to(tl.float32)
    ok = tl.load(VALID + b * T + t, mask=t < T, other=0) != 0
    total = tl.zeros([BT], tl.float32)
    for g in range(G):
        hq = h * G + g
        for iq in range(NQ):
            qi = iq * BQ + tl.arange(0, BQ)
            q = tl.load(Q + ((b * HQ + hq) * W + qi[:, None]) * D + d[None, :], mask=qi[:, None] < W, other=0.0)
            lse = tl.load(LSE + (b * HQ + hq) * W + qi, mask=qi < W, other=float("-inf"))
            s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee") * scale
            allowed = (t[None, :] <= (T - W + qi)[:, None]) & ok[None, :] & (qi[:, None] < W) & (t[None, :] < T)
            allowed = allowed & (lse[:, None] > float("-inf"))
            safe = tl.where(lse == float("-inf"), 0.0, lse)
            p = tl.where(allowed, tl.exp(s - safe[:, None]), 0.0)
            total += tl.sum(p, 0)
    tl.store(OUT + (b * H + h) * T + t, total, mask=t < T)


def attention_column_sums_triton(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, block_q: int = 16, block_t: int = 16
) -> torch.Tensor:
    """Triton version of :func:`kv_hex.kernels.reference.attention_column_sums` (float32 ``[B, Hkv, T]``)."""
    B, Hq, W, D = queries.shape
    H, T = keys.shape[1], keys.shape[2]
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton column-sum kernel needs a power-of-two head dim >= 16, got {D}")
    G = Hq // H
    q, k = queries.contiguous(), keys.contiguous()
    v = valid.to(torch.int8).contiguous()
    lse = torch.empty(B, Hq, W, device=keys.device, dtype=torch.float32)
    out = torch.empty(B, H, T, device=keys.device, dtype=torch.float32)
    nt, nq = triton.cdiv(T, block_t), triton.cdiv(W, block_q)
    _row_lse[(nq, B * Hq)](q, k, v, lse, float(scale), T, W, D, Hq, G, block_q, block_t, nt)
    _col_sums[(nt, B * H)](q, k, v, lse, out, float(scale), T, W, D, Hq, G, block_q, block_t, nq)
    return out
