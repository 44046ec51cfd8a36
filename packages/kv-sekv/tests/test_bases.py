"""Low-rank bases (Eqs. 6–8, 14, 18): tail energy, exact full rank, raw fallback, factored attention."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sekv import SpanBasis, reconstruction_error, truncated_svd
from kv_sekv.bases import factored_size
from kv_sekv.kernels import factored_attention_torch


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 24), st.integers(1, 12), st.integers(1, 12), st.integers(0, 999))
def test_gated_reconstruction_error_is_tail_energy(L, D, rank, seed):
    """‖K^{(R)} − K̂‖_F² = Σ_i (1 − m_i)² σ_i² (Eq. 14) for any gates; with gates 1 and R = min(L, D): K̂ = K;
    a rank-r truncation loses exactly Σ_{i>r} σ_i²."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, D, generator=g, dtype=torch.float64)
    U, s, Vh = truncated_svd(x, rank)
    U, s, Vh = U.double(), s.double(), Vh.double()
    R = min(L, D, rank)
    assert s.shape == (R,)
    m = torch.rand(R, generator=g, dtype=torch.float64)
    rank_R = (U * s) @ Vh
    gated = (U * (m * s)) @ Vh
    torch.testing.assert_close(((rank_R - gated) ** 2).sum(), reconstruction_error(s, m), rtol=1e-4, atol=1e-4)
    full = torch.linalg.svdvals(x)
    torch.testing.assert_close(((x - rank_R) ** 2).sum(), (full[R:] ** 2).sum(), rtol=1e-3, atol=1e-4)
    if min(L, D) == R:
        torch.testing.assert_close(rank_R, x, rtol=1e-4, atol=1e-4)


def test_raw_when_factors_are_larger_and_factors_otherwise():
    g = torch.Generator().manual_seed(0)
    H, D = 2, 8
    for L, rank in ((4, 4), (40, 2)):
        x = torch.randn(H, L, D, generator=g)
        U, s, Vh = truncated_svd(x, rank)
        basis = SpanBasis.build(x, U, s, Vh, torch.ones_like(s), 0.05, "cpu")
        r = s.shape[-1]
        if factored_size(L, D, r) >= L * D:
            assert basis.raw is not None and torch.equal(basis.raw, x)
        else:
            assert basis.rank == r
            held = sum(t.numel() for t in basis.tensors())
            assert held == H * factored_size(L, D, r)  # Eq. 18 per KV head


def test_gates_below_eps_are_dropped_and_folded():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 40, 8, generator=g)
    U, s, Vh = truncated_svd(x, 4)
    gates = torch.tensor([[0.9, 0.01, 0.5, 0.02]])
    basis = SpanBasis.build(x, U, s, Vh, gates, 0.05, "cpu")
    assert basis.rank == 2
    want = (U * (s * gates * (gates >= 0.05))) @ Vh
    torch.testing.assert_close(basis.reconstruct(), want[0][None], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20), st.integers(1, 8), st.integers(1, 3), st.integers(1, 3), st.integers(0, 999))
def test_factored_attention_equals_reconstruct_then_attend(L, r, G, Q, seed):
    """Stage 2 from the factors (never rebuilding K̂, V̂) equals attention over K̂ = U diag(σ) Vᵀ, V̂ likewise."""
    g = torch.Generator().manual_seed(seed)
    D = 8
    r = min(r, L, D)
    kf = (torch.randn(L, r, generator=g), torch.rand(r, generator=g), torch.randn(r, D, generator=g))
    vf = (torch.randn(L, r, generator=g), torch.rand(r, generator=g), torch.randn(r, D, generator=g))
    q = torch.randn(G, Q, D, generator=g)
    out, lse = factored_attention_torch(q, kf, vf, 1 / math.sqrt(D))
    K = (kf[0] * kf[1]) @ kf[2]
    V = (vf[0] * vf[1]) @ vf[2]
    logits = q @ K.T / math.sqrt(D)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ V, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 6), st.integers(0, 3)), min_size=0, max_size=7),
       st.integers(1, 3), st.integers(1, 2), st.integers(0, 999))  # fmt: skip
def test_factored_attention_batch_equals_per_span_then_merge(items, G, Q, seed):
    """The batched Stage 2 (padding, masking, scatter merge) equals one factored attention per (span, head)
    merged by log-sum-exp per group, for spans of mixed lengths and ranks (rank 0 = a raw span ``(K, 1, I)``),
    groups with several spans, one span or none."""
    from kv_sekv.kernels import factored_attention_batch_torch
    from kvcore.attention import merge_attention

    g = torch.Generator().manual_seed(seed)
    D, groups = 8, 4

    def factors(L, r):
        if r == 0:
            return torch.randn(L, D, generator=g), torch.ones(D), torch.eye(D)
        r = min(r, L)
        return torch.randn(L, r, generator=g), torch.rand(r, generator=g), torch.randn(r, D, generator=g)

    kf = [factors(L, r) for L, r, _ in items]
    vf = [factors(L, r if r == 0 else max(1, r - 1)) for L, r, _ in items]
    for i, (L, _, _) in enumerate(items):  # value factors span the same tokens
        assert vf[i][0].shape[0] == L
    group = torch.tensor([grp for _, _, grp in items], dtype=torch.long)
    q = torch.randn(groups, G, Q, D, generator=g)
    out, lse = factored_attention_batch_torch(q[group], kf, vf, 0.35, group, groups)
    assert out.shape == (groups, G, Q, D) and lse.shape == (groups, G, Q)
    for grp in range(groups):
        mine = [i for i, (_, _, x) in enumerate(items) if x == grp]
        if not mine:
            assert bool((out[grp] == 0).all()) and bool(torch.isneginf(lse[grp]).all())
            continue
        want = merge_attention([factored_attention_torch(q[grp], kf[i], vf[i], 0.35) for i in mine])
        torch.testing.assert_close(out[grp], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[grp], want[1], rtol=1e-5, atol=1e-5)
