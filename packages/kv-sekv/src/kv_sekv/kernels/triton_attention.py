"""Triton kernel of SEKV's Stage-1 decode attention with a per-entry logit bias, returning ``(out, lse)``.

Same signature and result as :func:`kv_sekv.kernels.reference.biased_attention_torch`. One program per (batch, query
head, query) streams its KV head's entries in blocks with an online softmax (FlashAttention, Dao et al. 2022, §3.1);
the dot products are elementwise products and sums in float32 (decode is memory-bound, and ``tl.dot`` on bf16 is
wrong in the interpreter). The number of blocks is a compile-time constant (the interpreter needs constant loop
bounds). Tested against the reference under ``TRITON_INTERPRET=1``; GPU speed is unmeasured.

Stage 2 (attention over a span from its low-rank factors) has no Triton kernel yet: the dispatch uses the PyTorch
reference on every device.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "biased_attention_triton"]

if HAS_TRITON:

    @triton.jit
    def _biased_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        b_ptr,
        o_ptr,
        lse_ptr,
        scale,
        N,
        sqb,
        sqh,
        sqq,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sbb,
        sbh,
        sob,
        soh,
        soq,
        slb,
        slh,
        HQ: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        N_BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        qi = tl.program_id(1)
        b = pid // HQ
        h = pid % HQ
        kh = h // GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + b * sqb + h * sqh + qi * sqq + d, mask=dmask, other=0.0).to(tl.float32)
        m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), 0)
        l = tl.sum(tl.zeros((BLOCK_N,), tl.float32), 0)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for i in range(N_BLOCKS):
            n = i * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < N
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + b * skb + kh * skh + n[:, None] * skn + d[None, :], mask=kv_mask, other=0.0)
            bias = tl.load(b_ptr + b * sbb + kh * sbh + n, mask=nmask, other=float("-inf")).to(tl.float32)
            s = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale + bias
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            corr = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe)
            v = tl.load(v_ptr + b * svb + kh * svh + n[:, None] * svn + d[None, :], mask=kv_mask, other=0.0)
            l = l * corr + tl.sum(p, 0)
            acc = acc * corr + tl.sum(p[:, None] * v.to(tl.float32), 0)
            m = m_new
        has = l > 0
        out = tl.where(has, acc / tl.where(has, l, 1.0), 0.0)
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(o_ptr + b * sob + h * soh + qi * soq + d, out, mask=dmask)
        tl.store(lse_ptr + b * slb + h * slh + qi, lse)


def biased_attention_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~kv_sekv.kernels.reference.biased_attention_torch` (same arguments and result)."""
    if not HAS_TRITON:
        raise ImportError("biased_attention_triton needs triton (pip install kv-sekv[triton])")
    B, Hkv, N, D = keys.shape
    Hq, Q = query.shape[1], query.shape[2]
    k, v = keys.contiguous(), values.contiguous()
    b = bias.float().contiguous()
    q = query.contiguous()
    out = torch.empty(B, Hq, Q, D, dtype=torch.float32, device=keys.device)
    lse = torch.empty(B, Hq, Q, dtype=torch.float32, device=keys.device)
    block_n = max(16, min(block_n, triton.next_power_of_2(max(N, 1))))
    _biased_attention_kernel[(B * Hq, Q)](
        q, k, v, b, out, lse, float(scale), N,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        HQ=Hq, GROUP=Hq // Hkv, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
        N_BLOCKS=triton.cdiv(max(N, 1), block_n),
    )  # fmt: skip
    return out, lse


def factored_attention_triton(query, key_factors, value_factors, scale):
    """No Triton kernel yet for Stage 2: the PyTorch reference (exact, on the query's device)."""
    from .reference import factored_attention_torch

    return factored_attention_torch(query, key_factors, value_factors, scale)
