"""Eq. 3 solver, Table 9 presets, tier counts with the rounding repair (spec properties 1 and 10)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_hqekv import PRESETS, HqeKVConfig, Shares, feasible, preset, solve_eq3, tier_counts

unit = st.floats(0.0, 1.0, allow_nan=False)
bits = st.floats(0.0, 4.0, allow_nan=False)


@given(bits, unit, unit)
def test_eq3_solution_satisfies_both_equations(b, x3, x4):
    """δ1, δ2 from Alg. 1 (with the /2) satisfy 4δ1 + 2δ2 + δ3 = B and Σδ = 1 for every (B, x3, x4)."""
    d1, d2 = solve_eq3(b, x3, x4)
    assert 4 * d1 + 2 * d2 + x3 == pytest.approx(b, abs=1e-9)
    assert d1 + d2 + x3 + x4 == pytest.approx(1.0, abs=1e-9)


@given(bits, unit, unit)
def test_feasible_iff_nonnegative(b, x3, x4):
    """A trial is feasible exactly when δ1 >= 0 and δ2 >= 0; feasible shares give B average bits."""
    d1, d2 = solve_eq3(b, x3, x4)
    s = feasible(b, x3, x4)
    assert (s is not None) == (d1 >= 0 and d2 >= 0)
    if s is not None and x3 + x4 <= 1:
        assert s.avg_bits == pytest.approx(b, abs=1e-6)


def test_presets_match_their_bits():
    """Every Table 9 preset sums to 1 and gives its advertised average bits (to the table's precision)."""
    for name, s in PRESETS.items():
        target = float(name.split("-")[-1])
        assert s.avg_bits == pytest.approx(target, abs=5e-3), name
        assert sum(s.as_tuple()) == pytest.approx(1.0)
    assert preset("llama-2") is PRESETS["llama-2"]
    with pytest.raises(ValueError, match="unknown HqeKV preset"):
        preset("llama-9")


@given(st.integers(0, 400), st.sampled_from(sorted(PRESETS)), st.integers(0, 3))
def test_counts_sum_and_fp16(n, name, fp16):
    """Counts sum to n, fp16 = min(fp16_blocks, n), none negative; evict is round(n'·δ4) (never repaired)."""
    s = PRESETS[name]
    c = tier_counts(n, s, fp16)
    assert c.blocks == n and c.fp16 == min(fp16, n)
    assert min(c.as_tuple()) >= 0
    rest = n - c.fp16
    assert c.evict == min(rest, int(rest * s.evict + 0.5))


@given(st.integers(8, 2000), st.floats(0.1, 0.6), st.floats(0.0, 0.3))
def test_achieved_bits_within_rounding_bound(n, x3, x4):
    """|achieved code bits - B| <= 4 / n_nonfp16 when the 1-bit count needs no spill (spec ambiguity j)."""
    b = 2.0
    s = feasible(b, x3, x4)
    if s is None:
        return
    c = tier_counts(n, s, 2)
    rest = n - 2
    if rest * s.q1 >= 3:  # the repair stays inside the 1-bit count
        assert abs(c.code_bits - s.avg_bits) <= 4 / rest + 1e-9


def test_bad_shares_and_config():
    with pytest.raises(ValueError, match="sum to 1"):
        Shares(0.5, 0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match="avg_bits"):
        PRESETS["llama-2"].check_bits(3.2)
    with pytest.raises(ValueError, match="q4"):
        Shares(-0.1, 0.6, 0.5, 0.0)
    with pytest.raises(ValueError, match="multiple of block"):
        HqeKVConfig(block=32, period=48)
    with pytest.raises(ValueError, match="window"):
        HqeKVConfig(window=0)
    with pytest.raises(TypeError, match="joint_evict"):
        HqeKVConfig(joint_evict=1)
    with pytest.raises(ValueError, match="avg_bits"):
        solve_eq3(float("nan"), 0.1, 0.1)
    c = HqeKVConfig()
    assert (c.block, c.period, c.window, c.alpha, c.beta, c.fp16_blocks, c.trials) == (32, 32, 20, 2.0, 4.0, 2, 200)
