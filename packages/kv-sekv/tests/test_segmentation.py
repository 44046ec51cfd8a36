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
