"""Triton kernel of SEKV's routing gate (SEKV §3.3, Eqs. 4–5 and 9): projection, gate and threshold in one launch.

Same signature and result as :func:`kv_sekv.kernels.routing.routing_priority_torch`. One program per (batch row, KV
head, block of spans) loads each of the head's query heads' projection ``W^{(h)}`` ``[d′, D]`` once, projects every
decode query (Eq. 4), scores its block of unit routing summaries (Eq. 5, ``log|S|`` from the span lengths), applies
the head's threshold and the span's liveness (Eq. 9) and keeps the largest selecting gate — where the PyTorch path
runs a dozen operations per layer and step (einsum, matmul, log, sigmoid, comparisons, a repeat of the liveness
mask, a reduction); it also writes Stage 1's bias of the coarse entries (``log|S|`` where the span is alive), which
it has at hand. Products and sums in float32 (the shapes are tiny: ``d′ = 32``). The query heads per KV head
and the queries per step are compile-time loop bounds (the interpreter needs constant bounds); the span count is a
run-time argument. Tested against the reference under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch

from kvcore.checks import check_power_of_two

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "routing_priority_triton"]

if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _routing_kernel(
        q_ptr,
        w_ptr,
        tau_ptr,
        s_ptr,
        len_ptr,
        alive_ptr,
        out_ptr,
        bias_ptr,
        M,
        inv_sqrt_dp,
        H: tl.constexpr,
        GROUP: tl.constexpr,
        Q: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DP: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < M
        e = tl.arange(0, BLOCK_DP)
        emask = e < DP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        n = tl.load(len_ptr + b * M + m, mask=mmask, other=1)
        loglen = tl.log(tl.maximum(n, 1).to(tl.float32))
        alive = tl.load(alive_ptr + bh * M + m, mask=mmask, other=0) != 0
        best = tl.full([BLOCK_M], -1.0, tl.float32)
        for j in range(GROUP):
            hq = (bh % H) * GROUP + j  # query head
            w = tl.load(
                w_ptr + (hq * DP + e[:, None]) * D + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0
            )
            tau = tl.load(tau_ptr + hq)
            row = (b * (H * GROUP) + hq) * M + m
            s = tl.load(s_ptr + row[:, None] * DP + e[None, :], mask=mmask[:, None] & emask[None, :], other=0.0)
            s = s.to(tl.float32)
            for qi in range(Q):
                qv = tl.load(q_ptr + ((b * (H * GROUP) + hq) * Q + qi) * D + d, mask=dmask, other=0.0)
                qp = tl.sum(w.to(tl.float32) * qv.to(tl.float32)[None, :], 1)  # Eq. 4, [BLOCK_DP]
                gate = tl.sigmoid(tl.sum(s * qp[None, :], 1) * inv_sqrt_dp + loglen)  # Eq. 5
                best = tl.maximum(best, tl.where((gate > tau) & alive, gate, -1.0))  # Eq. 9
        tl.store(out_ptr + bh * M + m, best, mask=mmask)
        tl.store(bias_ptr + bh * M + m, tl.where(alive, loglen, float("-inf")), mask=mmask)  # Stage 1's coarse bias


def routing_priority_triton(
    query: torch.Tensor,
    W: torch.Tensor,
    tau: torch.Tensor,
    summary: torch.Tensor,
    length: torch.Tensor,
    alive: torch.Tensor,
    block_m: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~kv_sekv.kernels.routing.routing_priority_torch` (same arguments and result;
    ``block_m`` spans per program)."""
    if not HAS_TRITON:
        raise ImportError("routing_priority_triton needs triton (pip install kv-sekv[triton])")
    check_power_of_two("block_m", block_m)
    B, Hq, Q, D = query.shape
    H, M = alive.shape[1], alive.shape[2]
    DP = W.shape[1]
    out = torch.empty(B, H, M, dtype=torch.float32, device=query.device)
    bias = torch.empty(B, H, M, dtype=torch.float32, device=query.device)
    if B * H * M == 0:
        return out, bias
    block_m = max(16, min(block_m, triton.next_power_of_2(M)))
    _routing_kernel[(B * H, triton.cdiv(M, block_m))](
        query.contiguous(), W.float().contiguous(), tau.float().contiguous(), summary.contiguous(),
        length.contiguous(), alive.contiguous().view(torch.uint8), out, bias, M, 1.0 / math.sqrt(DP),
        H=H, GROUP=Hq // H, Q=Q, D=D, DP=DP, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DP=triton.next_power_of_2(DP), BLOCK_M=block_m,
    )  # fmt: skip
    return out, bias
