"""Span weights, coarse entries and routing summaries (Eqs. 2–3), and the +log|S| identity (spec property 2)."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sekv import coarse_entries, routing_summaries, segment, span_weights


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 60), st.integers(0, 999), st.booleans())
def test_weights_are_a_distribution_per_span(n, seed, zeros):
    """w_t >= 0 and Σ_{t∈S} w_t = 1 for every span (uniform when the span's surprisal is all 0); 0 off spans."""
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(n, generator=g) * 4
    if zeros:
        h[: n // 2] = 0
    span_id, _ = segment(h, 2.0, 2, 3)
    w = span_weights(h, span_id)
    assert bool((w >= 0).all()) and bool((w[span_id < 0] == 0).all())
    for s in range(int(span_id.max()) + 1):
        torch.testing.assert_close(w[span_id == s].sum(), torch.tensor(1.0))
        if float(h[span_id == s].sum()) > 0:
            hs = h[span_id == s]
            torch.testing.assert_close(w[span_id == s], hs / hs.sum())


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.sampled_from((1, 2, 4)), st.integers(0, 999))
def test_routing_summaries_are_unit_and_equal_the_weighted_projection(Hkv, group, seed):
    """‖K̄_S‖ = 1 and K̄_S = normalize(Σ_t w_t W K_t) (Eq. 3), per query head from its KV head."""
    g = torch.Generator().manual_seed(seed)
    n, D, dp = 30, 8, 4
    h = torch.rand(n, generator=g) * 4
    span_id, _ = segment(h, 2.5, 2, 0)
    m = int(span_id.max()) + 1
    k = torch.randn(Hkv, n, D, generator=g)
    W = torch.randn(Hkv * group, dp, D, generator=g)
    w = span_weights(h, span_id)
    summ = routing_summaries(coarse_entries(k, span_id, w, m), W)
    torch.testing.assert_close(summ.norm(dim=-1), torch.ones(Hkv * group, m))
    for j in range(Hkv * group):
        for s in range(m):
            sel = span_id == s
            proj = (w[sel][:, None] * (k[j // group, sel] @ W[j].T)).sum(0)
            torch.testing.assert_close(summ[j, s], proj / proj.norm(), rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 20), st.integers(0, 999))
def test_identical_tokens_coarse_entry_with_log_bias_is_exact(length, seed):
    """A span of |S| identical (k, v): one coarse entry with bias +log|S| gives exactly the attention over the |S|
    tokens, next to other entries."""
    g = torch.Generator().manual_seed(seed)
    D = 8
    k, v = torch.randn(D, generator=g), torch.randn(D, generator=g)
    others_k, others_v = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)
    q = torch.randn(D, generator=g)
    span_id = torch.zeros(length, dtype=torch.long)
    w = span_weights(torch.rand(length, generator=g), span_id)
    ck = coarse_entries(k.expand(1, length, D), span_id, w, 1)[0, 0]
    cv = coarse_entries(v.expand(1, length, D), span_id, w, 1)[0, 0]

    def attend(keys, values, bias):
        p = torch.softmax(keys @ q / math.sqrt(D) + bias, -1)
        return p @ values

    exact = attend(torch.cat([others_k, k.expand(length, D)]), torch.cat([others_v, v.expand(length, D)]), 0.0)
    bias = torch.tensor([0.0] * 5 + [math.log(length)])
    coarse = attend(torch.cat([others_k, ck[None]]), torch.cat([others_v, cv[None]]), bias)
    torch.testing.assert_close(coarse, exact, rtol=1e-5, atol=1e-5)
