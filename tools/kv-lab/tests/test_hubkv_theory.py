"""The paper's theory as properties (§3.2; Appendix J: Prop. 1, Thm. 1, Prop. 2, Prop. 3; §3.1 oracle)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hubkv import HubKVConfig, local_hubs, refine, smd_discount
from kv_lab.hubkv.theory import (
    CoverageObjective,
    brute_force_select,
    gaussian_kernel,
    greedy_select,
    perturbation_bounds,
    ranking_stability_threshold,
    window_kernel,
)

score_lists = st.lists(st.floats(0.0, 1.0, allow_nan=False, width=32), min_size=1, max_size=12)
kernels = st.one_of(
    st.integers(0, 4).map(lambda k: ("window", k)),
    st.floats(0.3, 4.0).map(lambda b: ("gauss", b)),
)


def _kernel(spec):
    kind, arg = spec
    return window_kernel(arg) if kind == "window" else gaussian_kernel(arg)


def _naive_fsub(s, subset, kfun):
    """Eq. 4-5 written out with loops."""
    n = len(s)
    if not subset:
        return 0.0
    z = [sum(kfun(abs(j - x)) for x in range(n)) for j in range(n)]
    return sum(max(s[j] * kfun(abs(x - j)) / z[j] for j in subset) for x in range(n))


def _scalar_kernel(spec):
    kind, arg = spec
    if kind == "window":
        return lambda d: 1.0 if d <= arg else 0.0
    return lambda d: math.exp(-(d * d) / (2 * arg * arg))


# ----------------------------------------------------------------------------- Prop. 1


@settings(max_examples=80, deadline=None)
@given(s=score_lists, spec=kernels, data=st.data())
def test_prop1_fsub_matches_definition_and_is_monotone_submodular(s, spec, data):
    obj = CoverageObjective(s, _kernel(spec))
    n = len(s)
    sk = _scalar_kernel(spec)
    b_set = data.draw(st.sets(st.integers(0, n - 1)), label="B")
    a_set = data.draw(st.sets(st.sampled_from(sorted(b_set))) if b_set else st.just(set()), label="A")
    assert obj.value(b_set) == pytest.approx(_naive_fsub(s, b_set, sk), rel=1e-9, abs=1e-12)
    # monotone: A ⊆ B  =>  F(A) <= F(B)
    assert obj.value(a_set) <= obj.value(b_set) + 1e-12
    # submodular: Δ(v | A) >= Δ(v | B) for v ∉ B (Eq. 2)
    for v in range(n):
        if v in b_set:
            continue
        gain_a = obj.value(a_set | {v}) - obj.value(a_set)
        gain_b = obj.value(b_set | {v}) - obj.value(b_set)
        assert gain_a >= gain_b - 1e-12
        assert obj.gain(v, a_set) == pytest.approx(gain_a, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(s=score_lists, spec=kernels)
def test_prop1_singleton_utility_equals_score(s, spec):
    obj = CoverageObjective(s, _kernel(spec))
    for j, sj in enumerate(s):
        assert obj.value({j}) == pytest.approx(sj, rel=1e-12, abs=1e-15)
    assert obj.value(set()) == 0.0


# ----------------------------------------------------------------------------- Prop. 2


@settings(max_examples=40, deadline=None)
@given(s=st.lists(st.floats(0.0625, 1.0, width=32), min_size=2, max_size=12), spec=kernels, data=st.data())
def test_prop2_marginal_gain_equals_one_minus_overlap(s, spec, data):
    obj = CoverageObjective(s, _kernel(spec))
    i = data.draw(st.integers(0, len(s) - 1))
    h = data.draw(st.integers(0, len(s) - 1))
    assert obj.gain(i, {h}) == pytest.approx((1 - obj.overlap_ratio(i, h)) * s[i], abs=1e-12)


# ----------------------------------------------------------------------------- §3.1 greedy oracle


@settings(max_examples=40, deadline=None)
@given(s=st.lists(st.floats(0.0, 1.0, width=32), min_size=1, max_size=10), spec=kernels, data=st.data())
def test_greedy_oracle_reaches_one_minus_inv_e_of_optimum(s, spec, data):
    obj = CoverageObjective(s, _kernel(spec))
    budget = data.draw(st.integers(0, len(s)))
    chosen = greedy_select(obj, budget)
    assert len(chosen) == len(set(chosen)) == min(budget, len(s))
    _, opt = brute_force_select(obj, budget)
    assert obj.value(chosen) >= (1 - 1 / math.e) * opt - 1e-12
    assert obj.value(chosen) <= opt + 1e-12


# ----------------------------------------------------------------------------- Thm. 1


plateau_rows = st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(
    row=st.one_of(plateau_rows, st.lists(st.floats(0, 1, width=32), min_size=1, max_size=40)),
    kernel_size=st.sampled_from([1, 3, 5, 7]),
    gamma=st.floats(0.01, 0.99),
    ratio=st.floats(0.0, 0.99),
)
def test_thm1_strict_local_hub_stays_above_discounted_neighbours(row, kernel_size, gamma, ratio):
    s = torch.tensor(row, dtype=torch.float32)
    k = kernel_size // 2
    hubs = local_hubs(s[None], None, kernel_size)[0]
    s_tilde = smd_discount(s, hubs, gamma)
    z = refine(s[None, None], ratio, kernel_size=kernel_size, gamma=gamma)[0, 0]
    n = len(row)
    for h in range(n):
        window = [i for i in range(max(0, h - k), min(n, h + k + 1)) if i != h]
        if not all(row[h] > row[i] for i in window):
            continue  # not a strict (unique) local maximum
        assert bool(hubs[h]), "a strict local maximum must be a hub"
        for i in window:
            assert not bool(hubs[i])
            assert float(s_tilde[h]) > float(s_tilde[i])  # Thm. 1 on s̃
            assert float(z[h]) > float(z[i])  # and on the deployed score (same head, same β)


def test_every_plateau_has_exactly_one_hub_at_its_lowest_index():
    # isolated plateaus longer than the window: the lowest index of each plateau is a hub and
    # nothing else in the plateau can be (ties go to the lowest index, Eq. 6)
    s = torch.tensor([[0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.9, 0.9, 0.0]])
    hubs = local_hubs(s, None, 5)[0].tolist()
    for start, stop in [(1, 7), (9, 11)]:
        assert hubs[start] and not any(hubs[start + 1 : stop])


@settings(max_examples=40, deadline=None)
@given(row=plateau_rows, kernel_size=st.sampled_from([3, 5, 9]))
def test_global_argmax_is_a_hub(row, kernel_size):
    # basis of Prop. 4: the (lowest-index) global maximum is always a local hub
    s = torch.tensor([row])
    hubs = local_hubs(s, None, kernel_size)[0]
    assert bool(hubs[int(torch.argmax(s[0]))])  # torch.argmax returns the first maximal index


# ----------------------------------------------------------------------------- Prop. 3

configs = st.builds(
    HubKVConfig,
    kernel_size=st.sampled_from([1, 3, 5, 7]),
    gamma=st.floats(0.05, 0.95),
    tau=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    beta_min=st.sampled_from([0.5, 0.8]),
    beta_max=st.sampled_from([1.0, 1.2, 2.0]),
    p=st.sampled_from([1.0, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    cfg=configs,
    ratio=st.floats(0.0, 0.99),
    H=st.integers(1, 4),
    N=st.integers(2, 48),
    plateau=st.booleans(),
)
def test_prop3_bounded_perturbation_and_ranking_stability(seed, cfg, ratio, H, N, plateau):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 5, (2, H, N), generator=g).float() / 4 if plateau else torch.rand(2, H, N, generator=g)
    prot = torch.rand(2, 1, N, generator=g) < 0.2
    z = refine(s, ratio, prot, **cfg.as_kwargs()).double()
    unprot = ~prot.expand_as(s)
    lo, hi = perturbation_bounds(s, ratio, cfg)
    tol = 1e-6 * (1 + s.double())
    assert bool((z[unprot] >= lo[unprot] - tol[unprot]).all()), "Eq. 16 lower bound"
    assert bool((z[unprot] <= hi[unprot] + tol[unprot]).all()), "Eq. 16 upper bound"
    # Eq. 17 over every pair of unprotected tokens of the call (any heads, any leading index)
    thr = ranking_stability_threshold(ratio, cfg)
    sv, zv = s.double()[unprot], z[unprot]
    pair = sv[:, None] > thr * (1 + 1e-5) * sv[None, :]
    assert bool((zv[:, None] > zv[None, :])[pair].all())


def test_prop3_threshold_is_tight_at_its_extremes():
    # the bound of Eq. 16 is attained: a hub in a head with β = β_max reaches the upper factor,
    # a non-hub in a head with β = β_min the lower one
    cfg = HubKVConfig(tau=1.0, beta_min=0.8, beta_max=1.2)
    spiky = [0.0] * 20 + [1.0] + [0.0] * 20  # high coefficient of variation -> β clipped high
    flat = [0.5 + 0.01 * (i % 2) for i in range(41)]  # low CV -> β clipped low
    s = torch.tensor([[spiky, flat]])
    ratio = 0.9
    z = refine(s, ratio, **cfg.as_kwargs())
    lo, hi = perturbation_bounds(s, ratio, cfg)
    assert float(z[0, 0, 20]) == pytest.approx(float(hi[0, 0, 20]), rel=1e-6)
    assert float(z[0, 1, 2]) == pytest.approx(float(lo[0, 1, 2]), rel=1e-6)  # 0.5 < 0.51 neighbours


def test_theory_helpers_reject_bad_input():
    with pytest.raises(ValueError, match=">= 0"):
        CoverageObjective([0.5, -0.1])
    with pytest.raises(ValueError, match="finite"):
        CoverageObjective([0.5, math.nan])
    with pytest.raises(ValueError, match="K\\(0\\) > 0"):
        CoverageObjective([0.5, 0.2], lambda d: (d > 0).double())
    with pytest.raises(ValueError, match="budget"):
        greedy_select(CoverageObjective([0.1]), -1)
    with pytest.raises(ValueError, match="ratio"):
        perturbation_bounds(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="half_width"):
        window_kernel(-1)
    with pytest.raises(ValueError, match="bandwidth"):
        gaussian_kernel(0.0)
