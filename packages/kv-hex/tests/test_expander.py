"""The mask properties P1-P6 of the HEX spec (HEX §3.2, App. A.1-A.3), on every generated mask."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hex.expander import (
    degrees,
    dense_mask,
    expander_mask,
    ramanujan_bound,
    random_mask,
    singular_values,
)
from kv_hex.precompute import load, main, precompute, save


@st.composite
def biregular_shapes(draw):
    """``(n, d, rho)`` with integer degrees d1, d2 >= 3 (where the Ramanujan bound is defined, Def. 2)."""
    d = draw(st.sampled_from((32, 48, 64, 96, 128, 192)))
    d1 = draw(st.integers(3, max(3, d // 8)))
    # n must make n*d1/d an integer >= 3
    step = d // math.gcd(d, d1)
    k = draw(st.integers(max(1, -(-3 * d // (d1 * step))), max(1, -(-3 * d // (d1 * step))) + 3))
    n = step * k
    return n, d, d1 / d


def check_biregular(t):
    m = dense_mask(t)
    assert (m.sum(1) == t.d1).all(), "P1: every token keeps exactly d1 channels"
    assert (m.sum(0) == t.d2).all(), "P1: every channel is kept by exactly d2 tokens"
    assert m.sum() == t.n * t.d1 == t.d * t.d2
    return m


@settings(max_examples=15, deadline=None, derandomize=False)
@given(biregular_shapes())
def test_biregular_ramanujan_mask_properties(shape):
    """P1-P4 hold for every biregular mask returned: degrees, σ1 = √(d1·d2) with constant singular vectors, σ2 within
    the Ramanujan bound (the generator retries until it is), and a positive spectral gap (connected: no token or
    channel isolated)."""
    n, d, rho = shape
    t = expander_mask(n, d, rho)
    d1, d2 = degrees(n, d, rho)
    assert (t.d1, t.d2) == (d1, d2) and d2 is not None and d1 >= 3 and d2 >= 3
    m = check_biregular(t).astype(np.float64)
    s = np.linalg.svd(m, compute_uv=False)
    assert s[0] == pytest.approx(math.sqrt(d1 * d2), rel=1e-9), "P2: σ1 = √(d1·d2)"
    ones_n, ones_d = np.ones(n) / math.sqrt(n), np.ones(d) / math.sqrt(d)
    assert np.allclose(m @ ones_d, math.sqrt(d1 * d2) * ones_n), "P2: constant singular vectors"
    assert t.bound == pytest.approx(ramanujan_bound(d1, d2))
    assert s[1] <= t.bound + 1e-9, f"P3: σ2 {s[1]} above the Ramanujan bound {t.bound}"
    assert t.sigma2 == pytest.approx(s[1], abs=1e-6)
    assert s[0] - s[1] > 0, "P4: spectral gap"


@settings(max_examples=15, deadline=None)
@given(biregular_shapes(), st.integers(0, 2**31 - 1))
def test_mixing_lemma_on_random_subsets(shape, seed):
    """P6: |e(S, T) - d1|S||T|/d| <= σ2 √(|S||T|) for random token subsets S and channel subsets T (the expander
    mixing lemma for biregular graphs; standard, not in the paper)."""
    n, d, rho = shape
    t = expander_mask(n, d, rho)
    m = dense_mask(t)
    rng = np.random.default_rng(seed)
    for _ in range(10):
        S = rng.random(n) < rng.uniform(0.05, 0.95)
        T = rng.random(d) < rng.uniform(0.05, 0.95)
        e = m[np.ix_(S, T)].sum()
        expected = t.d1 * S.sum() * T.sum() / d
        assert abs(e - expected) <= t.sigma2 * math.sqrt(S.sum() * T.sum()) + 1e-9


def test_static_and_deterministic():
    """P5: the same (n, d, ρ, seed) gives the same mask bit for bit (cached or regenerated), another seed another
    mask, and nothing but these numbers goes in (no K/V argument exists)."""
    a = expander_mask(96, 192, 0.03125)
    expander_mask.cache_clear()
    b = expander_mask(96, 192, 0.03125)
    assert a is not b and np.array_equal(a.cols, b.cols)
    assert expander_mask(96, 192, 0.03125) is b, "LRU cache"
    c = expander_mask(96, 192, 0.03125, seed=7)
    assert not np.array_equal(a.cols, c.cols)
    assert np.array_equal(c.cols, expander_mask.__wrapped__(96, 192, 0.03125, 7).cols)
    assert not a.cols.flags.writeable, "cached tables are read-only"


def test_paper_shapes_meet_the_bound():
    """The shapes HEX-3 uses on SmolLM2 (3 KV heads × 64) and on an 8-head × 128 model, for one block and a longer
    prefill segment: all biregular with d1, d2 >= 3, all within the bound; compact int16 tables."""
    for n, d in ((96, 192), (192, 192), (96, 1024), (192, 1024), (384, 1024)):
        t = expander_mask(n, d, 0.03125)
        check_biregular(t)
        assert t.bound is not None and t.sigma2 <= t.bound
        assert t.cols.dtype == np.int16 and t.cols.shape == (n, t.d1)
        assert t.nbytes == n * t.d1 * 2


def test_near_biregular_when_degree_is_not_an_integer():
    """Spec A3: ρ = 4.6875 % with n = 96, d = 128 gives d2 = 4.5: rows exact (d1 = 6), columns balanced 4/5, the bound
    (defined for biregular graphs) not checked."""
    t = expander_mask(96, 128, 0.046875)
    m = dense_mask(t)
    assert t.d1 == 6 and t.d2 is None and t.bound is None
    assert (m.sum(1) == 6).all() and set(np.unique(m.sum(0)).tolist()) <= {4, 5}
    assert m.sum() == 96 * 6


def test_tiny_and_empty_masks():
    """d1 = round(ρ·d) = 0 gives an empty mask; degrees below 2 are returned unchecked but still exact."""
    assert expander_mask(4, 8, 0.03125).d1 == 0 and not dense_mask(expander_mask(4, 8, 0.03125)).any()
    t = expander_mask(8, 4, 0.25)  # d1 = 1
    assert t.bound is None and (dense_mask(t).sum(1) == 1).all()


def test_random_control_has_the_same_density_but_no_structure():
    """The control mask keeps exactly as many elements as the expander, without the degree constraint."""
    e, r = expander_mask(96, 192, 0.03125), random_mask(96, 192, 0.03125)
    me, mr = dense_mask(e), dense_mask(r)
    assert me.sum() == mr.sum() == 96 * 6
    assert len(np.unique(mr.sum(1))) > 1, "a uniform random mask has varying row degrees"
    assert np.array_equal(mr, dense_mask(random_mask.__wrapped__(96, 192, 0.03125)))
    s = singular_values(mr, 2)
    assert s[1] > ramanujan_bound(6, 3), "this random draw is not Ramanujan (the structural difference)"


@pytest.mark.parametrize(
    ("n", "d", "rho"), [(0, 4, 0.5), (4, 0, 0.5), (4, 4, 0.0), (4, 4, 1.0), (4, 4, -0.1), (4, 4, float("nan"))]
)
def test_bad_shapes_and_densities_raise(n, d, rho):
    with pytest.raises(ValueError, match="n must|d must|rho must"):
        expander_mask(n, d, rho)


def test_unreachable_bound_raises_naming_the_degrees(monkeypatch):
    """A shape whose random draws never meet the bound raises after MAX_TRIES (here: the bound forced to 0)."""
    import kv_hex.expander as ex

    monkeypatch.setattr(ex, "MAX_TRIES", 3)
    monkeypatch.setattr(ex, "ramanujan_bound", lambda d1, d2: 0.0)
    with pytest.raises(ValueError, match=r"\(6, 3\)-biregular"):
        ex.expander_mask.__wrapped__(96, 192, 0.03125, 123)


def test_precompute_save_load_and_cli(tmp_path, capsys):
    tables = precompute(3, 64, [96, 192])
    assert set(tables) == {(96, 192), (192, 192)}
    path = tmp_path / "m.npz"
    save(str(path), tables, 0.03125)
    back = load(str(path))
    assert all(np.array_equal(back[k].cols, tables[k].cols) for k in tables)
    assert main(["--heads", "2", "--head-dim", "64", "--lengths", "96", "--out", str(tmp_path / "c.npz")]) == 0
    assert "n=96 d=128 d1=4 d2=3" in capsys.readouterr().out
    with pytest.raises(ValueError, match="scope"):
        precompute(3, 64, [96], scope="token")
