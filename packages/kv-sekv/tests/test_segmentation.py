"""Segmentation (§3.1–3.2) and the budget rule: invariants over random surprisal sequences."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sekv import fit_segmentation, segment

seqs = st.tuples(st.integers(1, 80), st.integers(0, 999)).map(
    lambda a: torch.rand(a[0], generator=torch.Generator().manual_seed(a[1])) * 5
)


@settings(max_examples=40, deadline=None)
@given(seqs, st.floats(0.0, 3.0), st.integers(1, 8), st.integers(0, 20))
def test_segment_invariants(h, thr, min_span, window):
    """Anchors are exactly the out-of-window tokens above the threshold plus the first; spans are the maximal runs
    between them of length >= L_min, numbered in order; everything else (window, short runs) is resident."""
    n = h.numel()
    span_id, anchors = segment(h, thr, min_span, window)
    in_window = torch.arange(n) >= n - window
    want = (h > thr) & ~in_window
    want[0] = not bool(in_window[0])
    assert torch.equal(anchors, want)
    assert not bool((span_id[anchors | in_window] >= 0).any())
    free = ~anchors & ~in_window
    # maximal runs of free tokens
    runs, cur = [], []
    for t in range(n):
        if free[t]:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    long_runs = [r for r in runs if len(r) >= min_span]
    for i, r in enumerate(long_runs):
        assert span_id[r].tolist() == [i] * len(r)
    for r in runs:
        if len(r) < min_span:
            assert span_id[r].tolist() == [-1] * len(r)


@settings(max_examples=40, deadline=None)
@given(seqs, st.floats(0.05, 1.0), st.floats(0.0, 0.5), st.sampled_from((0.0, 0.25, 0.5)))
def test_default_rule_fits_the_budget_or_raises(h, budget, summary_cost, zoom_share):
    """strict=False: the persistent part (resident tokens + coarse entries + summaries) fits the capacity less the
    zoom-in reserve, and the α used is at least the configured one; otherwise a ValueError explains the budget."""
    n = h.numel()
    cap = int(n * budget)
    try:
        seg = fit_segmentation(
            h, alpha=1.0, min_span=3, window=8, capacity=cap, summary_cost=summary_cost, zoom_share=zoom_share
        )
    except ValueError as err:
        assert "budget too small" in str(err)
        return
    assert seg.cost <= cap * (1 - zoom_share)
    assert seg.alpha >= 1.0 - 1e-9
    assert seg.window <= 0.25 * cap
    resident = int((seg.span_id < 0).sum())
    assert seg.cost == pytest.approx(resident + seg.n_spans * (1 + summary_cost))


def test_strict_is_literal_and_reports_the_budget_used():
    h = torch.tensor([0.0, 9, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    seg = fit_segmentation(h, alpha=1.0, min_span=3, window=4, capacity=2, strict=True)
    assert seg.alpha == 1.0 and seg.window == 4
    assert seg.used == pytest.approx(seg.cost / 16) and seg.cost > 2


def test_alpha_is_raised_until_it_fits():
    # many anchors at alpha=1: raising the threshold merges them into one long span
    h = torch.zeros(64)
    h[::4] = torch.linspace(5, 6, 16)
    loose = fit_segmentation(h, alpha=1.0, min_span=3, window=0, capacity=64, strict=True)
    tight = fit_segmentation(h, alpha=1.0, min_span=3, window=0, capacity=20)
    assert loose.cost > 20 >= tight.cost and tight.alpha > 1.0
    assert int(tight.anchors.sum()) < int(loose.anchors.sum())


def test_nothing_fits_raises():
    with pytest.raises(ValueError, match="budget too small"):
        fit_segmentation(torch.rand(40), alpha=1.0, min_span=3, window=0, capacity=1, summary_cost=0.5)


# -- max_span: spans cut to what the zoom share can reconstruct (our addition) ------------------------------------


@settings(max_examples=40, deadline=None)
@given(seqs, st.floats(0.0, 3.0), st.integers(1, 6), st.integers(1, 12))
def test_split_spans_cuts_long_spans_into_near_equal_consecutive_pieces(h, thr, min_span, extra):
    """With ``max_span``: anchors and resident tokens are unchanged; every span of the unbounded segmentation is cut
    into ``⌈|S| / max_span⌉`` consecutive pieces whose lengths differ by at most one, ids in token order."""
    max_span = min_span + extra - 1
    whole, anchors = segment(h, thr, min_span, 4)
    cut, anchors2 = segment(h, thr, min_span, 4, max_span=max_span)
    assert torch.equal(anchors, anchors2) and torch.equal(whole < 0, cut < 0)
    ids = cut[cut >= 0]
    assert bool((ids.diff() >= 0).all()) and (ids.numel() == 0 or int(ids.max()) + 1 == int(ids.unique().numel()))
    for s in whole[whole >= 0].unique().tolist():
        inside = cut[whole == s]
        lens = torch.bincount(inside - int(inside.min()))
        n = int((whole == s).sum())
        assert lens.numel() == -(-n // max_span) and int(lens.max()) <= max_span
        assert int(lens.max() - lens.min()) <= 1 and bool((lens > 0).all())


def test_auto_max_span_fits_spans_in_the_zoom_share_or_relaxes():
    """``"auto"``: spans no longer than the zoom share of the budget when the persistent part still fits; a budget
    too small for that many spans gets longer ones (doubled), never an error the unbounded rule would not raise."""
    h = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 5
    opts = dict(alpha=1.0, min_span=4, window=64, summary_cost=0.75, zoom_share=0.25)
    seg = fit_segmentation(h, capacity=200, max_span="auto", **opts)
    room = int(0.25 * 200)
    assert seg.n_spans > 0 and int(torch.bincount(seg.span_id[seg.span_id >= 0]).max()) <= room
    assert seg.cost <= 200 * 0.75
    tight = fit_segmentation(h, capacity=100, max_span="auto", **opts)  # 25-token pieces would not fit
    unbounded = fit_segmentation(h, capacity=100, **opts)
    assert tight.cost <= 75 and int(torch.bincount(tight.span_id[tight.span_id >= 0]).max()) > 25
    assert tight.n_spans >= unbounded.n_spans


def test_max_span_is_validated():
    from kv_sekv import SEKVConfig

    assert SEKVConfig(max_span="auto").max_span == "auto" and SEKVConfig(max_span=32).max_span == 32
    with pytest.raises(ValueError, match="max_span must be an int >= 16"):
        SEKVConfig(max_span=8)
    with pytest.raises(ValueError, match="max_span must be an int >= min_span, 'auto' or None"):
        SEKVConfig(max_span="short")
    with pytest.raises(TypeError, match="max_span must be an int"):
        SEKVConfig(max_span=2.5)
