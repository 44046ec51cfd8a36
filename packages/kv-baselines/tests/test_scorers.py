"""Baseline scorers against independent naive references written from the papers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kv_baselines as kb
from kvcore import Budget, Protection, ScoringContext, ShortInputWarning, TopKSelector


def _ctx(B=2, H=2, G=2, T=40, D=8, W=None, seed=0, valid=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, H * G, W or T, D, generator=g)
    return ScoringContext(k, v, queries=q, attention_mask=valid)


def _naive_window_probs(ctx):
    """Per query head, per window query: softmax over causally visible, non-padding keys (repeat_kv style)."""
    B, Hq, W, D = ctx.queries.shape
    H, T = ctx.num_kv_heads, ctx.seq_len
    G = Hq // H
    out = torch.zeros(B, Hq, W, T)
    for b in range(B):
        for h in range(Hq):
            k = ctx.keys[b, h // G]
            for w in range(W):
                qi = T - W + w
                logits = []
                for t in range(T):
                    if t > qi or not bool(ctx.valid[b, t]):
                        logits.append(-math.inf)
                    else:
                        logits.append(float(ctx.queries[b, h, w] @ k[t]) / math.sqrt(D))
                out[b, h, w] = torch.softmax(torch.tensor(logits), 0)
    return out


def _naive_pool(x, kernel, how):
    """Pool the last dim with a centred window clipped at the edges (average over the positions that exist)."""
    out = torch.empty_like(x)
    T, r = x.shape[-1], kernel // 2
    for t in range(T):
        win = x[..., max(0, t - r) : min(T, t + r + 1)]
        out[..., t] = win.amax(-1) if how == "max" else win.mean(-1)
    return out


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_matches_naive_reference(pooling):
    ctx = _ctx(T=24, W=24)
    window, kernel = 6, 5
    small = ScoringContext(ctx.keys, ctx.values, queries=ctx.queries[:, :, -window:])
    got = kb.SnapKVScorer(window, kernel, pooling).score(small).keys
    probs = _naive_window_probs(small)  # [B, Hq, W, T]
    mean = probs.mean(dim=2)  # over window queries
    pooled = _naive_pool(mean, kernel, pooling).view(2, 2, 2, -1).mean(2)  # GQA mean over the group
    T = ctx.seq_len
    pooled[..., T - window :] = pooled.amax(-1, keepdim=True)
    torch.testing.assert_close(got, pooled, rtol=1e-5, atol=1e-6)


def test_h2o_is_cumulative_attention_mean_over_group():
    ctx = _ctx(T=16)
    got = kb.H2OScorer().score(ctx).keys
    probs = _naive_window_probs(ctx)
    ref = probs.sum(2).view(2, 2, 2, -1).mean(2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # every query row is a probability distribution: total mass = number of queries per head
    torch.testing.assert_close(got.sum(-1), torch.full((2, 2), 16.0), rtol=1e-5, atol=1e-4)


def test_padding_receives_no_attention():
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, :5] = False
    ctx = _ctx(T=20, valid=valid)
    s = kb.H2OScorer().score(ctx).keys
    assert torch.all(s[1, :, :5] == 0) and torch.all(s[1, :, 5:].sum(-1) > 0)


def test_knorm_is_negative_key_norm():
    ctx = _ctx()
    torch.testing.assert_close(kb.KnormScorer().score(ctx).keys, -torch.linalg.vector_norm(ctx.keys, dim=-1))


def test_random_is_deterministic_per_seed_and_layer():
    ctx = _ctx()
    a, b = kb.RandomScorer(3).score(ctx).keys, kb.RandomScorer(3).score(ctx).keys
    assert torch.equal(a, b)
    assert not torch.equal(a, kb.RandomScorer(4).score(ctx).keys)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.8])
def test_streaming_llm_keeps_sinks_and_most_recent(ratio):
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :7] = False
    ctx = _ctx(T=40, valid=valid)
    plan = TopKSelector().select(
        kb.StreamingLLMScorer(4).score(ctx), Budget(ratio=ratio), Protection(4).mask(valid), valid
    )
    for b in range(2):
        real = valid[b].nonzero().flatten().tolist()
        k = Budget(ratio=ratio).kept(len(real))
        expect = sorted(set(real[:4]) | set(real[len(real) - (k - 4) :]))
        for h in range(2):
            assert plan.keep_keys[b, h].nonzero().flatten().tolist() == expect


def test_streaming_llm_budget_below_sinks_keeps_the_sinks_or_refuses_when_strict():
    comp = kb.streaming_llm(0.95)
    with pytest.warns(ShortInputWarning):
        store = comp.compress(_ctx(T=40))
    assert store.seq_lengths().unique().tolist() == [comp.protect.sinks + comp.protect.recent]
    with pytest.raises(ValueError, match="protected"):
        dataclasses.replace(comp, strict=True).compress(_ctx(T=40))


def test_scorers_refuse_missing_queries():
    ctx = ScoringContext(torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4))
    for scorer in (kb.SnapKVScorer(4), kb.H2OScorer()):
        with pytest.raises(ValueError, match="queries"):
            scorer.score(ctx)


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"kernel_size": 4}, {"kernel_size": 0}, {"pooling": "median"}])
def test_snapkv_bad_config(kwargs):
    with pytest.raises(ValueError):
        kb.SnapKVScorer(**kwargs)


def test_ready_made_compressors_evict_real_bytes():
    ctx = _ctx(B=1, H=2, T=128, W=128)
    full = kb.full().compress(ctx).nbytes()
    for make in (kb.random, kb.knorm, kb.streaming_llm, kb.snapkv, kb.h2o):
        store = make(0.5).compress(ctx)
        assert store.seq_lengths().eq(64).all(), make.__name__
        assert store.nbytes() < 0.55 * full, make.__name__
