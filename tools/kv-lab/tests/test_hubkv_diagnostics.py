"""Appendix I diagnostics (Observations 1–3) against loop-based readings of the paper's text."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_lab.hubkv import diagnostics as dg

importance_lists = st.lists(
    st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0, width=32)), min_size=2, max_size=200
)


def _naive_order(x):
    return sorted(range(len(x)), key=lambda i: (-x[i], i))


def _naive_segment(i, t, n_seg):
    return (i * n_seg) // t


# ----------------------------------------------------------------------------- preprocessing


def test_content_region_drops_sinks_and_recent_window():
    scores = torch.arange(2 * 3 * 2048, dtype=torch.float32).reshape(2, 3, 2048)
    c = dg.content_region(scores)
    assert c.shape == (2, 3, 2048 - 4 - 40)  # floor(0.02 * 2048) = 40 (Appendix I: 2,004 left)
    assert torch.equal(c, scores[..., 4:2008])
    with pytest.raises(ValueError, match="no content"):
        dg.content_region(torch.zeros(1, 5), n_sink=4, recent_frac=0.2)
    with pytest.raises(ValueError, match="recent_frac"):
        dg.content_region(scores, recent_frac=1.0)


def test_token_importance_is_mean_over_layers_and_heads():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(3, 2, 10, generator=g)
    imp = dg.token_importance(s)
    for i in range(10):
        assert float(imp[i]) == pytest.approx(sum(float(s[l, h, i]) for l in range(3) for h in range(2)) / 6)


# ----------------------------------------------------------------------------- Observation 1


@settings(max_examples=60, deadline=None)
@given(x=importance_lists, n_seg=st.integers(1, 80), data=st.data())
def test_marginal_coverage_matches_loop(x, n_seg, data):
    steps = data.draw(st.integers(1, len(x)))
    gains = dg.marginal_coverage(x, n_segments=n_seg, steps=steps)
    covered, expect = set(), []
    for i in _naive_order(x)[:steps]:
        seg = _naive_segment(i, len(x), n_seg)
        expect.append(0.0 if seg in covered else 1.0 / n_seg)
        covered.add(seg)
    assert gains.tolist() == pytest.approx(expect)
    assert float(gains.sum()) <= 1.0 + 1e-12


def test_marginal_coverage_random_order_baseline():
    x = [float(i % 7) for i in range(128)]
    order = list(range(128))
    random.Random(0).shuffle(order)
    gains = dg.marginal_coverage(x, n_segments=64, steps=50, order=order)
    seen = {_naive_segment(i, 128, 64) for i in order[:50]}
    assert float(gains.sum()) == pytest.approx(len(seen) / 64)
    with pytest.raises(ValueError, match="steps"):
        dg.marginal_coverage(x, steps=129)


@settings(max_examples=40, deadline=None)
@given(x=importance_lists, n_seg=st.integers(1, 64))
def test_coverage_curve_matches_loop_and_is_monotone(x, n_seg):
    order = dg.ranking(x)
    assert order.tolist() == _naive_order(x)
    budgets = list(range(0, len(x) + 1))
    cov = dg.coverage_curve(order, len(x), budgets, n_seg)
    for k, c in zip(budgets, cov.tolist()):
        segs = {_naive_segment(i, len(x), n_seg) for i in _naive_order(x)[:k]}
        assert c == pytest.approx(len(segs) / n_seg)
        assert c <= min(k, n_seg) / n_seg + 1e-12
    assert bool((cov[1:] >= cov[:-1]).all())


# ----------------------------------------------------------------------------- Observation 2


@settings(max_examples=40, deadline=None)
@given(x=st.lists(st.floats(0.0, 1.0, width=32), min_size=3, max_size=120), data=st.data())
def test_autocorrelation_matches_formula(x, data):
    mean = sum(x) / len(x)
    c = [v - mean for v in x]
    denom = sum(v * v for v in c) / len(c)
    max_lag = data.draw(st.integers(1, len(x) - 1))
    if denom <= 1e-12:
        return
    r = dg.autocorrelation(x, max_lag=max_lag)
    for d in range(1, max_lag + 1):
        num = sum(c[i] * c[i + d] for i in range(len(x) - d)) / (len(x) - d)
        assert float(r[d - 1]) == pytest.approx(num / denom, rel=1e-9, abs=1e-9)


def test_autocorrelation_separates_local_from_alternating_signals():
    smooth = [math.sin(2 * math.pi * i / 200) for i in range(400)]  # slow: strongly local
    alternating = [(-1.0) ** i for i in range(400)]
    assert float(dg.autocorrelation(smooth, 5)[0]) > 0.95
    assert float(dg.autocorrelation(alternating, 5)[0]) < -0.95
    with pytest.raises(ValueError, match="constant"):
        dg.autocorrelation([0.3] * 10, 3)
    with pytest.raises(ValueError, match="max_lag"):
        dg.autocorrelation([0.1, 0.2, 0.3], 3)


# ----------------------------------------------------------------------------- Observation 3


@settings(max_examples=40, deadline=None)
@given(x=importance_lists, window=st.sampled_from([1, 3, 7, 9]), discount=st.floats(0.0, 1.0))
def test_nms_scores_match_loop(x, window, discount):
    k = window // 2
    got = dg.nms_scores(x, window, discount).tolist()
    for i, v in enumerate(x):
        neigh = x[max(0, i - k) : i + k + 1]
        expect = v if v == max(neigh) else v * discount
        assert got[i] == pytest.approx(expect)


@settings(max_examples=30, deadline=None)
@given(n_bumps=st.integers(2, 12), seed=st.integers(0, 1000))
def test_nms_covers_every_cluster_while_topk_stays_in_the_first(n_bumps, seed):
    # one cluster per segment (bump width 9 > NMS window 7). The top cluster's peak is 1 and its
    # flanks (>= 0.8) exceed every other peak (<= 0.79), so Top-K spends its first 9 picks there;
    # every other peak (>= 0.35) exceeds a discounted flank (<= 0.3 * 0.95), so NMS ranks all
    # cluster peaks first.
    rng = random.Random(seed)
    seg_width = 20
    t = n_bumps * seg_width
    x = [0.0] * t
    top = rng.randrange(n_bumps)
    heights = [1.0 if b == top else rng.uniform(0.35, 0.79) for b in range(n_bumps)]
    for b, h in enumerate(heights):
        centre = b * seg_width + seg_width // 2
        for d in range(-4, 5):
            x[centre + d] = h * (1 - 0.05 * abs(d))
    res = dg.nms_coverage(x, budgets=range(1, n_bumps + 1), n_segments=n_bumps)
    assert res["nms"].tolist() == pytest.approx([k / n_bumps for k in range(1, n_bumps + 1)])
    assert res["topk"].tolist()[:9] == pytest.approx([1 / n_bumps] * min(9, n_bumps))
    assert bool((res["nms"] >= res["topk"]).all())


def test_diagnostics_reject_bad_inputs():
    with pytest.raises(ValueError, match="1-D"):
        dg.autocorrelation([[0.1, 0.2]], 1)
    with pytest.raises(ValueError, match="finite"):
        dg.marginal_coverage([0.1, float("nan")], steps=1)
    with pytest.raises(ValueError, match="window"):
        dg.nms_scores([0.1, 0.2], window=4)
    with pytest.raises(ValueError, match="discount"):
        dg.nms_scores([0.1, 0.2], discount=1.5)
    with pytest.raises(ValueError, match="n_segments"):
        dg.segment_ids(10, 0)
