"""The routing gate (Eqs. 4-5, 9) in one Triton launch == its PyTorch reference under TRITON_INTERPRET=1."""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from kv_sekv.kernels import routing_priority, routing_priority_torch
from kv_sekv.kernels.triton_routing import routing_priority_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


def _inputs(B, H, g, Q, M, D, DP, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    Hq = H * g
    query = torch.randn(B, Hq, Q, D, generator=gen).to(dtype)
    W = torch.randn(Hq, DP, D, generator=gen) / math.sqrt(D)
    summary = torch.nn.functional.normalize(torch.randn(B, Hq, M, DP, generator=gen), dim=-1).to(dtype)
    length = torch.randint(0, 6, (B, M), generator=gen)  # 0: a padding span
    alive = torch.rand(B, H, M, generator=gen) < 0.8
    tau = torch.rand(Hq, generator=gen) * 0.4 + 0.55  # some gates pass, some do not
    return [t.to(DEVICE) for t in (query, W, tau, summary, length, alive)]


@pytest.mark.parametrize(
    ("B", "H", "g", "Q", "M", "D", "DP"),
    [(1, 1, 1, 1, 3, 16, 8), (2, 2, 3, 2, 40, 24, 12), (1, 3, 2, 1, 70, 32, 32)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_matches_reference(B, H, g, Q, M, D, DP, dtype):
    """Several blocks of spans (70 in blocks of 16), head dims and d' that are not powers of two, GQA groups of 1-3,
    two queries, padding spans (length 0), dead spans and thresholds that select some spans and not others."""
    args = _inputs(B, H, g, Q, M, D, DP, dtype, seed=M + D)
    want, want_bias = routing_priority_torch(*args)
    got, got_bias = routing_priority_triton(*args, block_m=16)
    assert got.shape == got_bias.shape == (B, H, M) and got.dtype == got_bias.dtype == torch.float32
    torch.testing.assert_close(got_bias, want_bias, rtol=1e-6, atol=1e-6)  # log|S| where alive, -inf elsewhere
    selected = want >= 0
    if M >= 10:
        assert 0 < int(selected.sum()) < selected.numel()  # the case tests both outcomes
    assert torch.equal(got >= 0, selected)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert bool((got[~args[5]] == -1).all())  # a dead span is never selected


def test_routing_priority_is_the_largest_selecting_gate():
    """The reference against the formula written out per query head: sigmoid(W q . K / sqrt(d') + log max(|S|,1))
    above tau on an alive span, maximised over the KV head's query heads and queries, -1 otherwise."""
    B, H, g, Q, M, D, DP = 1, 2, 2, 2, 6, 8, 4
    query, W, tau, summary, length, alive = _inputs(B, H, g, Q, M, D, DP, torch.float32, seed=1)
    got, bias = routing_priority_torch(query, W, tau, summary, length, alive)
    for h in range(H):
        for m in range(M):
            best = -1.0
            for j in range(h * g, (h + 1) * g):
                for q in range(Q):
                    z = W[j] @ query[0, j, q] @ summary[0, j, m] / math.sqrt(DP) + math.log(max(int(length[0, m]), 1))
                    gate = 1 / (1 + math.exp(-float(z)))
                    if gate > float(tau[j]) and bool(alive[0, h, m]):
                        best = max(best, gate)
            assert float(got[0, h, m]) == pytest.approx(best, rel=1e-5)
            loglen = math.log(max(int(length[0, m]), 1)) if bool(alive[0, h, m]) else float("-inf")
            assert float(bias[0, h, m]) == pytest.approx(loglen, rel=1e-6)


def test_routing_dispatch_and_empty_and_bad_block():
    args = _inputs(1, 2, 2, 1, 0, 16, 8, torch.float32, seed=0)
    assert all(t.shape == (1, 2, 0) for t in routing_priority_triton(*args))
    args = _inputs(1, 2, 2, 1, 5, 16, 8, torch.float32, seed=2)
    if DEVICE == "cpu":  # the CPU path is the reference
        assert all(torch.equal(a, b) for a, b in zip(routing_priority(*args), routing_priority_torch(*args)))
    with pytest.raises(ValueError, match="block_m"):
        routing_priority_triton(*args, block_m=24)
