"""Triton kernels: HqeKV window importance (§3.2, Alg. 2 l.5-9) tiled, never materialising more than a tile.

``A[b, j] = Σ_{h ∈ Hq} Σ_i softmax_j(q_i·k_j/√d + causal mask) / c_j`` over the ``m`` window queries. Two passes over
the keys, each over tiles of ``BLOCK_N`` keys, with the ``Hq/Hkv · m`` window rows of one KV head in registers
(``m = 20``: 80 rows for Llama-8B's GQA groups of 4):

1. the log-sum-exp of every window row, online (split over the keys; the splits' partial maxima and sums are
   combined on the host);
2. ``Σ_rows exp(logit - lse)`` for every key of the tile, written once per (KV head, key).

The ``[B, Hkv, N]`` per-head sums are added over KV heads and divided by ``c_j`` on the host. Logits are float32
``tl.dot`` products with IEEE precision (no TF32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kv_hqekv.kernels.reference import seen_by


@triton.jit
def _window_logits(q, k_ptr, b, h, n0, skb, skh, skn, skd, valid_ptr, N, M_WIN, sqrt_d, r, rmask, d, dmask,
                   HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < N
    koff = b.to(tl.int64) * skb + h.to(tl.int64) * skh + n.to(tl.int64) * skn
    k = tl.load(k_ptr + koff[:, None] + d[None, :].to(tl.int64) * skd, mask=nmask[:, None] & dmask[None, :], other=0.0)
    logits = tl.math.div_rn(tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee"), sqrt_d)
    i = r % M_WIN
    see = (n[None, :] <= (N - M_WIN + i)[:, None]) & nmask[None, :] & rmask[:, None]
    if HAS_VALID:
        see = see & (tl.load(valid_ptr + b.to(tl.int64) * N + n, mask=nmask, other=0) != 0)[None, :]
    return tl.where(see, logits, float("-inf")), n, nmask


@triton.jit
def _load_window(q_ptr, b, h, sqb, sqh, sqm, sqd, M_WIN, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    r = tl.arange(0, BLOCK_M)
    rmask = r < GROUP * M_WIN
    hq = h * GROUP + r // M_WIN
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    off = b.to(tl.int64) * sqb + hq.to(tl.int64) * sqh + (r % M_WIN).to(tl.int64) * sqm
    q = tl.load(q_ptr + off[:, None] + d[None, :].to(tl.int64) * sqd, mask=rmask[:, None] & dmask[None, :], other=0.0)
    return q.to(tl.float32), r, rmask, d, dmask


# the held length, the split count and the strides that follow them change at every re-plan: not specialised (an
# integer equal to 1 or divisible by 16 would compile a variant of its own, seen as a new compile at a re-plan in
# benchmarks/decode_census.py). The unit strides and the key token stride (the head dim) stay specialised.
_RUNTIME = ["sqb", "sqh", "sqm", "skb", "skh", "N", "M_WIN", "NSPLIT"]


@triton.jit(do_not_specialize=_RUNTIME)
def _window_lse_kernel(
    q_ptr, k_ptr, valid_ptr, max_ptr, sum_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, H, N, M_WIN, NSPLIT, sqrt_d,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, HAS_VALID: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    q, r, rmask, d, dmask = _load_window(q_ptr, b, h, sqb, sqh, sqm, sqd, M_WIN, GROUP, D, BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for t in range(TILES):
        n0 = (sp * TILES + t) * BLOCK_N
        logits, _, _ = _window_logits(
            q, k_ptr, b, h, n0, skb, skh, skn, skd, valid_ptr, N, M_WIN, sqrt_d, r, rmask, d, dmask, HAS_VALID, BLOCK_N
        )
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        m_i = m_new
    part = (pid.to(tl.int64) * NSPLIT + sp) * (GROUP * M_WIN) + r
    tl.store(max_ptr + part, m_i, mask=rmask)
    tl.store(sum_ptr + part, l_i, mask=rmask)


@triton.jit(do_not_specialize=[n for n in _RUNTIME if n != "NSPLIT"])
def _window_sum_kernel(
    q_ptr, k_ptr, valid_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, H, N, M_WIN, sqrt_d,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, HAS_VALID: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    q, r, rmask, d, dmask = _load_window(q_ptr, b, h, sqb, sqh, sqm, sqd, M_WIN, GROUP, D, BLOCK_M, BLOCK_D)
    lse = tl.load(lse_ptr + pid.to(tl.int64) * (GROUP * M_WIN) + r, mask=rmask, other=float("-inf"))
    seen = lse != float("-inf")
    lse = tl.where(seen, lse, 0.0)
    for t in range(TILES):
        n0 = (sp * TILES + t) * BLOCK_N
        logits, n, nmask = _window_logits(
            q, k_ptr, b, h, n0, skb, skh, skn, skd, valid_ptr, N, M_WIN, sqrt_d, r, rmask, d, dmask, HAS_VALID, BLOCK_N
        )
        p = tl.where(seen[:, None], tl.exp(logits - lse[:, None]), 0.0)
        tl.store(out_ptr + pid.to(tl.int64) * N + n, tl.sum(p, axis=0), mask=nmask)


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def window_importance_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor | None = None,
    normalize: bool = True,
    *,
    block_n: int = 64,
    tiles: int = 4,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton :func:`~kv_hqekv.importance.window_importance_ref` (same arguments, same results): ``block_n`` keys
    per tile, ``tiles`` tiles per program."""
    B, Hq, m, D = queries.shape
    H, N = keys.shape[1], keys.shape[2]
    group = Hq // H
    out = torch.zeros(B, N, dtype=torch.float32, device=keys.device)
    if B * H * N * m == 0:
        return out
    bn = _pow2(block_n)
    nsplit = triton.cdiv(N, bn * tiles)
    S, M = B * H, group * m
    mx = torch.empty(S, nsplit, M, dtype=torch.float32, device=keys.device)
    sm = torch.empty(S, nsplit, M, dtype=torch.float32, device=keys.device)
    vptr = (
        valid.to(torch.uint8).contiguous()
        if valid is not None
        else torch.zeros(1, dtype=torch.uint8, device=keys.device)
    )
    meta = dict(
        GROUP=group, D=D, BLOCK_M=_pow2(M), BLOCK_N=bn, BLOCK_D=_pow2(D), TILES=tiles, HAS_VALID=valid is not None
    )
    strides = (*queries.stride(), *keys.stride())
    sqrt_d = float(torch.tensor(math.sqrt(D), dtype=torch.float32))
    _window_lse_kernel[(S, nsplit)](
        queries, keys, vptr, mx, sm, *strides, H, N, m, nsplit, sqrt_d, **meta, num_warps=num_warps
    )
    top = mx.amax(1)
    top_safe = torch.where(torch.isfinite(top), top, 0.0)
    total = (sm * torch.exp(mx - top_safe[:, None])).sum(1)
    lse = torch.where(total > 0, top_safe + torch.log(torch.where(total > 0, total, 1.0)), float("-inf"))
    per_head = torch.zeros(S, N, dtype=torch.float32, device=keys.device)
    _window_sum_kernel[(S, nsplit)](
        queries, keys, vptr, lse.contiguous(), per_head, *strides, H, N, m, sqrt_d, **meta, num_warps=num_warps
    )
    out = per_head.view(B, H, N).sum(1)
    if normalize:
        out = out / seen_by(N, m, keys.device)
    return out
