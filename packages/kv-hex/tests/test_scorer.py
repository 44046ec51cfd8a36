"""The heavy-hitter score (HEX §3.3) against a naive full-matrix computation, and global selection across heads."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hex import AccumulatedAttentionScorer
from kv_hex.kernels.reference import attention_column_sums, decode_attention
from kvcore import ScoringContext


def naive_sums(q, k, valid):
    """Σ over query heads of the group and queries of causal softmax(q kᵀ / √D), the T × T way."""
    B, Hq, W, D = q.shape
    H, T = k.shape[1], k.shape[2]
    G = Hq // H
    out = torch.zeros(B, H, T)
    for b in range(B):
        for j in range(Hq):
            h = j // G
            for i in range(W):
                t = T - W + i
                s = (k[b, h, : t + 1] @ q[b, j, i]) / math.sqrt(D)
                s = s.masked_fill(~valid[b, : t + 1], float("-inf"))
                if torch.isinf(s).all():
                    continue
                out[b, h, : t + 1] += torch.softmax(s, -1)
    return out


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.sampled_from((1, 2)), st.sampled_from((1, 2)), st.integers(2, 12), st.integers(0, 99))
def test_column_sums_equal_the_full_matrix(B, H, G, T, seed):
    g = torch.Generator().manual_seed(seed)
    W = int(torch.randint(1, T + 1, (1,), generator=g))
    q, k = torch.randn(B, H * G, W, 8, generator=g), torch.randn(B, H, T, 8, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, : int(torch.randint(0, T, (1,), generator=g))] = False  # left padding
    got = attention_column_sums(q, k, valid, 1 / math.sqrt(8), chunk=3)  # chunked: never T × T
    torch.testing.assert_close(got, naive_sums(q, k, valid), rtol=1e-5, atol=1e-5)


def test_global_scores_are_identical_across_heads_and_sum_every_head():
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 4, 10, 8)
    ctx = ScoringContext(keys=k, values=v, queries=q)
    glob = AccumulatedAttentionScorer().score(ctx).keys
    per = AccumulatedAttentionScorer(global_heads=False).score(ctx).keys
    assert torch.equal(glob[:, 0], glob[:, 1])
    torch.testing.assert_close(glob[:, 0], per.sum(1))
    # every query row's probabilities sum to 1: the total mass is Hq · W
    torch.testing.assert_close(per.sum(), torch.tensor(4.0 * 10))


def test_decode_attention_column_sums_are_the_probabilities():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8)
    bias = torch.zeros(2, 2, 5)
    bias[1, 1, 3:] = float("-inf")
    out, lse, sums = decode_attention(q, k, v, bias, 0.3)
    logits = (
        torch.einsum("bhqd,bhtd->bhqt", q, k.repeat_interleave(2, 1)) * 0.3 + bias.repeat_interleave(2, 1)[:, :, None]
    )
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(out, p @ v.repeat_interleave(2, 1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    torch.testing.assert_close(sums, p.view(2, 2, 2, 3, 5).sum((2, 3)))
    assert bool((sums[1, 1, 3:] == 0).all())
