"""The online-softmax tile steps shared by the fused decode-attention kernels (kvcodec.kernels.triton_dot), run by a
tiny kernel under Triton's interpreter on CPU (compiled on a GPU): over tiles of keys and values, both the ``p · v``
step and the transposed ``vᵀ · pᵀ`` step give softmax attention and its log-sum-exp."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl

from kvcodec.kernels.triton_dot import (
    DOT_CODE,
    as_dot,
    online_softmax_step,
    online_softmax_step_t,
    qk_dot,
    softmax_result,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _attend(Q, K, V, OUT, LSE, T, scale, M: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, TILES: tl.constexpr,
            TRANS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    m = tl.arange(0, M)
    d = tl.arange(0, D)
    q = as_dot(tl.load(Q + m[:, None] * D + d[None, :]), DOT)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([D, M], tl.float32) if TRANS else tl.zeros([M, D], tl.float32)
    for blk in range(TILES):
        t = blk * BT + tl.arange(0, BT)
        ok = t < T
        k = tl.load(K + t[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + t[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        logits = tl.where(ok[None, :], qk_dot(q, k, DOT) * scale, float("-inf"))
        if TRANS:
            m_i, l_i, acc = online_softmax_step_t(m_i, l_i, acc, logits, tl.trans(v), DOT)
        else:
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    out, lse = softmax_result(m_i, l_i, tl.trans(acc) if TRANS else acc)
    tl.store(OUT + m[:, None] * D + d[None, :], out)
    tl.store(LSE + m, lse)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [16, 37])
def test_both_tile_steps_give_softmax_attention(trans, dtype, T):
    # Invariant: whichever way the output accumulates, the result is softmax(q·kᵀ·scale)·v and its log-sum-exp, up
    # to float32 summation order (float16: the probabilities split in two float16 parts keep float32-level error)
    g = torch.Generator().manual_seed(T)
    M, D, BT = 16, 32, 16
    q, k, v = (torch.randn(n, D, generator=g).to(dtype) for n in (M, T, T))
    out = torch.empty(M, D)
    lse = torch.empty(M)
    tiles = -(-T // BT)
    args = [x.to(DEVICE) for x in (q, k, v, out, lse)]
    dot = DOT_CODE[dtype] if dtype != torch.float32 else 0
    _attend[(1,)](*args, T, 0.3, M=M, D=D, BT=BT, TILES=tiles, TRANS=trans, DOT=dot)
    logits = q.float() @ k.float().T * 0.3
    ref = torch.softmax(logits, -1) @ v.float()
    torch.testing.assert_close(args[3].cpu(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(args[4].cpu(), torch.logsumexp(logits, -1), atol=2e-5, rtol=2e-5)
