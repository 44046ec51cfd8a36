"""Expected Attention against a loop-based reference written from the paper and kvpress's recipe."""

from __future__ import annotations

import math

import pytest
import torch

import kv_baselines as kb
from kv_baselines.scorers import ROPE_EXTRA
from kvcore import Budget, ScoringContext, registry


def _inv_freq(D, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def _rotation(p, inv_freq, D):
    """The RoPE matrix of position ``p`` (HF rotate_half layout), built entry by entry."""
    R = torch.eye(D, dtype=torch.float64)
    h = len(inv_freq)
    for i in range(h):
        a = p * float(inv_freq[i])
        R[i, i], R[i, i + h] = math.cos(a), -math.sin(a)
        R[i + h, i], R[i + h, i + h] = math.sin(a), math.cos(a)
    return R


def _ctx(B=2, H=2, G=2, T=14, W=None, D=8, seed=0, valid=None, inv_freq=None):
    """Keys and queries rotated by RoPE at their positions, as a model's are."""
    g = torch.Generator().manual_seed(seed)
    W = W or T
    inv = _inv_freq(D) if inv_freq is None else inv_freq
    pos = torch.arange(T)
    rot = torch.stack([_rotation(int(p), inv, D) for p in pos]).float()  # [T, D, D]
    k = torch.einsum("tij,bhtj->bhti", rot, torch.randn(B, H, T, D, generator=g) + 0.5)
    q = torch.einsum("tij,bhtj->bhti", rot[T - W :], torch.randn(B, H * G, W, D, generator=g) + 1.0)
    v = torch.randn(B, H, T, D, generator=g)
    return ScoringContext(k, v, queries=q, attention_mask=valid, extras={ROPE_EXTRA: inv.float()})


def _naive(ctx, n_future, n_sink, cov=True, vnorm=True, eps=0.0):
    B, Hq, W, D = ctx.queries.shape
    H, T = ctx.num_kv_heads, ctx.seq_len
    G = Hq // H
    inv = ctx.extras[ROPE_EXTRA].double()
    out = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        real = [t for t in range(T) if bool(ctx.valid[b, t])]
        sinks = set(real[:n_sink])
        nxt = max(int(ctx.positions[b, t]) for t in real) + 1
        Rbar = sum(_rotation(nxt + f, inv, D) for f in range(n_future)) / n_future
        for h in range(Hq):
            pre = []
            for w in range(W):
                t = T - W + w
                if t in real and t not in sinks:
                    R = _rotation(int(ctx.positions[b, t]), inv, D)
                    pre.append(R.T @ ctx.queries[b, h, w].double())
            mu = sum(pre) / len(pre) if pre else torch.zeros(D, dtype=torch.float64)
            S = sum(torch.outer(x - mu, x - mu) for x in pre) / max(1, len(pre)) if pre else torch.zeros(D, D)
            mu_bar, S_bar = Rbar @ mu, Rbar @ S.double() @ Rbar.T
            logits = []
            for t in range(T):
                if t not in real or t in sinks:
                    logits.append(-math.inf)
                    continue
                k = ctx.keys[b, h // G, t].double()
                x = float(mu_bar @ k) / math.sqrt(D)
                if cov:
                    x += float(k @ S_bar @ k) / (2 * D)
                logits.append(x)
            out[b, h // G] += torch.softmax(torch.tensor(logits, dtype=torch.float64), 0).nan_to_num(0.0) / G
        for hk in range(H):
            for t in range(T):
                if vnorm:
                    out[b, hk, t] = (out[b, hk, t] + eps) * ctx.values[b, hk, t].double().norm()
                if t not in real:
                    out[b, hk, t] = 0.0
        top = out[b].max()
        for t in sinks:
            out[b, :, t] = top
    return out.float()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"use_covariance": False},
        {"use_vnorm": False},
        {"epsilon": 0.01, "n_sink": 0},
        {"n_future_positions": 1, "n_sink": 2},
    ],
)
def test_matches_naive_reference(kw):
    valid = torch.ones(2, 14, dtype=torch.bool)
    valid[1, :3] = False
    ctx = _ctx(valid=valid)
    ctx = ScoringContext(
        ctx.keys,
        ctx.values,
        queries=ctx.queries,
        attention_mask=valid,
        positions=(torch.arange(14) - torch.tensor([[0], [3]])).clamp(min=0),
        extras=ctx.extras,
    )
    scorer = kb.ExpectedAttentionScorer(n_future_positions=kw.pop("n_future_positions", 16), **kw)
    ref = _naive(ctx, scorer.n_future_positions, scorer.n_sink, scorer.use_covariance, scorer.use_vnorm, scorer.epsilon)
    torch.testing.assert_close(scorer.score(ctx).keys, ref, rtol=1e-4, atol=1e-6)


def test_query_window_and_partial_rotary():
    """A shorter statistics window uses only the last queries; a partial rotary embedding rotates only its dims."""
    inv = _inv_freq(4)  # rotary dim 4 of D = 8
    ctx = _ctx(T=12, W=5, inv_freq=inv)
    scorer = kb.ExpectedAttentionScorer(n_future_positions=8, stats_window=5)
    assert scorer.query_window == 5
    ref = _naive(ctx, 8, 4)
    torch.testing.assert_close(scorer.score(ctx).keys, ref, rtol=1e-4, atol=1e-6)


def test_scores_invariant_to_shifting_every_position():
    """RoPE scores depend on relative positions only: shifting the prompt (keys, queries, positions and so the future
    positions) by ``s`` leaves the expected attention unchanged, which needs the queries' rotation undone exactly."""
    ctx = _ctx(T=10, D=8)
    scorer = kb.ExpectedAttentionScorer(n_future_positions=4, n_sink=1)
    s = 37
    R = _rotation(s, ctx.extras[ROPE_EXTRA].double(), 8).float()
    shifted = ScoringContext(
        torch.einsum("ij,bhtj->bhti", R, ctx.keys),
        ctx.values,
        queries=torch.einsum("ij,bhtj->bhti", R, ctx.queries),
        positions=torch.arange(10).expand(2, 10) + s,
        extras=ctx.extras,
    )
    torch.testing.assert_close(scorer.score(shifted).keys, scorer.score(ctx).keys, rtol=1e-4, atol=1e-6)


def test_sinks_kept_and_registered():
    ctx = _ctx(B=1, T=40, W=40)
    comp = kb.expected_attention(0.5)
    store = comp.compress(ctx)
    assert store.seq_lengths().eq(20).all()
    plan = comp.plan(ctx)
    assert bool(plan.keep_keys[..., :4].all())
    c = registry.discover()["expected_attention"].build(Budget(ratio=0.75))
    assert c.name == "expected_attention" and c.budget.ratio == 0.75 and c.protect.sinks == 4
    s = c.scorer
    assert (s.n_future_positions, s.n_sink, s.use_covariance, s.use_vnorm, s.epsilon) == (512, 4, True, True, 0.0)
    assert s.needs_queries and s.needs_values and s.query_window is None and ROPE_EXTRA in s.needs_extras


@pytest.mark.parametrize(
    ("kw", "error", "name"),
    [
        ({"n_future_positions": 0}, ValueError, "n_future_positions"),
        ({"n_sink": -1}, ValueError, "n_sink"),
        ({"n_sink": 1.0}, TypeError, "n_sink"),
        ({"use_covariance": 1}, TypeError, "use_covariance"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"stats_window": 0}, ValueError, "stats_window"),
    ],
)
def test_bad_config_names_the_argument(kw, error, name):
    with pytest.raises(error, match=name):
        kb.ExpectedAttentionScorer(**kw)


def test_missing_or_malformed_frequencies():
    ctx = _ctx(T=8)
    scorer = kb.ExpectedAttentionScorer()
    with pytest.raises(ValueError, match=ROPE_EXTRA):
        scorer.score(ScoringContext(ctx.keys, ctx.values, queries=ctx.queries))
    for bad in (torch.ones(9), torch.ones(2, 2), torch.tensor([float("nan")]), [1.0]):
        with pytest.raises(ValueError, match=ROPE_EXTRA):
            scorer.score(ScoringContext(ctx.keys, ctx.values, queries=ctx.queries, extras={ROPE_EXTRA: bad}))
