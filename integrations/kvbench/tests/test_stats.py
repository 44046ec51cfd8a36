"""Paired bootstrap statistics on synthetic data with a known answer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.stats import PairedDiff, bootstrap_mean, paired_difference


def test_a_planted_difference_is_found_and_covered():
    # method = reference + 0.5 + noise: the interval must exclude 0 and contain the planted 0.5
    # (power: the mean 0.5 is 10 standard errors from 0, so every one of the 20 datasets must find it)
    covered = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        ref = rng.normal(size=100)
        method = ref + 0.5 + rng.normal(scale=0.5, size=100)
        d = paired_difference(method, ref, seed=seed)
        assert d.significant and d.low > 0, d
        assert d.n == 100
        covered += d.low < 0.5 < d.high
    assert covered >= 16, covered  # ~19 expected; Binomial(20, 0.95) < 16 has probability < 0.3%


def test_a_planted_accuracy_drop_on_binary_samples_is_found():
    # per-sample accuracies: the reference answers 45/50, the method loses 15 of those: drop 0.3
    ref = np.array([1.0] * 45 + [0.0] * 5)
    method = ref.copy()
    method[:15] = 0.0
    d = paired_difference(method, ref, seed=3)
    assert d.mean == pytest.approx(-0.3)
    assert d.significant and d.high < 0
    # a single changed sample out of 50 is not called significant
    one = ref.copy()
    one[0] = 0.0
    assert not paired_difference(one, ref, seed=3).significant


def test_no_difference_covers_zero_at_the_nominal_rate():
    # 200 independent datasets with zero true paired difference: a 95% interval must cover 0 in ~190 of them.
    # Binomial(200, 0.95) has sd 3.1; accept 181..199 (3 sd; the percentile bootstrap undercovers slightly at
    # n = 40). A interval that ignored the spread (too narrow) or was always huge (too wide) leaves this band.
    covered = 0
    widths = []
    for seed in range(200):
        rng = np.random.default_rng(10_000 + seed)
        ref = rng.normal(size=40)
        method = ref + rng.normal(size=40)  # difference ~ N(0, 1)
        d = paired_difference(method, ref, n_boot=1000, seed=seed)
        covered += d.low <= 0.0 <= d.high
        widths.append(d.high - d.low)
    assert 181 <= covered <= 199, covered
    # and the interval has the width theory predicts: 2 * 1.96 * sd / sqrt(n) ~ 0.62
    assert 0.5 < float(np.mean(widths)) < 0.72, np.mean(widths)


def test_same_seed_same_interval_and_degenerate_inputs():
    x = [0.1, 0.4, -0.2, 0.3]
    assert bootstrap_mean(x, seed=7) == bootstrap_mean(x, seed=7)
    one = bootstrap_mean([0.25])
    assert (one.mean, one.low, one.high, one.n) == (0.25, 0.25, 0.25, 1)
    assert not one.significant  # one pair has no spread to judge it by
    few = paired_difference([1.0, 1.1, 0.9], [0.0, 0.0, 0.0])
    assert few.low > 0 and not few.significant  # 3 pairs: the interval excludes 0, but 3 < MIN_PAIRS
    same = paired_difference([1.0, 1.0], [1.0, 1.0])
    assert same == PairedDiff(0.0, 0.0, 0.0, 2) and not same.significant


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="pair up"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="values must not be empty"):
        bootstrap_mean([])
    with pytest.raises(ValueError, match="reference must be finite"):
        paired_difference([1.0], [math.nan])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_mean([1.0, 2.0], confidence=1.5)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_mean([1.0, 2.0], n_boot=10)
    with pytest.raises(TypeError, match="values must be a sequence of numbers"):
        bootstrap_mean(["a", "b"])


def test_format_marks_significance():
    assert PairedDiff(0.12, 0.05, 0.19, 10).format(".2f") == "+0.12 [+0.05, +0.19]*"
    assert PairedDiff(0.01, -0.05, 0.07, 10).format(".2f") == "+0.01 [-0.05, +0.07]"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-100, 100), min_size=2, max_size=30),
    st.floats(-50, 50),
    st.integers(0, 2**31),
)
def test_shifting_the_method_shifts_mean_and_interval_by_the_same_amount(xs, shift, seed):
    # invariant: with the same seed the resampling indices are the same, so adding c to every method value adds c
    # to the mean and to both bounds (translation equivariance of the percentile bootstrap); low <= mean-bounds order
    ref = [0.0] * len(xs)
    a = paired_difference(xs, ref, seed=seed)
    b = paired_difference([x + shift for x in xs], ref, seed=seed)
    tol = 1e-9 * (1 + abs(shift) + max(abs(x) for x in xs))
    if a.low == a.high:  # constant differences: one-point interval stays one-point
        assert b.low == pytest.approx(b.high, abs=tol)
    assert b.mean == pytest.approx(a.mean + shift, abs=tol)
    assert b.low == pytest.approx(a.low + shift, abs=tol)
    assert b.high == pytest.approx(a.high + shift, abs=tol)
    assert a.low <= a.high
