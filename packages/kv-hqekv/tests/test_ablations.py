"""Table 6 ablations: each differs from HqeKV-3.2 in exactly the component it removes, and is registered."""

import pytest
import torch

from kv_hqekv import ABLATIONS, ablation, hqekv, preset
from kv_hqekv.ablations import no_evict_shares, random_shares
from kvcore import ScoringContext, registry


def test_each_ablation_changes_only_its_component():
    base = hqekv(3.2)
    base_scorer, base_selector = base.scorer, base.selector
    no_range = ablation("no-range")
    assert no_range.scorer.times_range is False and base_scorer.times_range is True
    assert no_range.selector.shares == base_selector.shares == preset("llama-3.2")
    for kind in ("random-ratio", "no-evict"):
        c = ablation(kind)
        assert c.scorer.times_range is True and c.selector.shares != base_selector.shares
        assert c.selector.shares.avg_bits == pytest.approx(3.2, abs=1e-9)  # the same average bits
        assert c.budget == hqekv(3.2).budget and c.name == f"hqekv-3.2-{kind}"
    uniform = ablation("uniform")
    assert uniform.selector.shares == base_selector.shares and uniform.scorer.times_range is True
    store, base_store = uniform.new_store(), base.new_store()
    assert store.one_bit == "uniform" and base_store.one_bit == "normalized"
    assert {b: type(q).__name__ for b, q in store.quantizers["v"].items()} == {
        4: "UniformQuantizer",
        2: "UniformQuantizer",
        1: "UniformOneBitQuantizer",
    }
    no_evict = ablation("no-evict").selector.shares
    assert no_evict.evict == 0.0 and no_evict.q1 == pytest.approx(preset("llama-3.2").q1)


def test_no_range_scores_values_like_keys():
    """Without the range factor the value metric is the key metric (HqeKV Eq. 5 without the range)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D, Q = 1, 2, 40, 8, 6
    keys, values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g) * 3
    queries = torch.randn(B, 2 * H, Q, D, generator=g)
    ctx = ScoringContext(keys=keys, values=values, queries=queries)
    ablated = ablation("no-range").scorer.score(ctx)
    full = hqekv(3.2).scorer.score(ctx)
    # kvcore.Scores: no separate value scores means the values are ranked by the key scores
    assert ablated.values is None and torch.allclose(ablated.keys, full.keys)
    assert full.values is not None and not torch.allclose(full.values, full.keys)


def test_random_shares_are_seeded_feasible_and_differ():
    a, b = random_shares(3.2, seed=0), random_shares(3.2, seed=0)
    assert a == b and a != random_shares(3.2, seed=1)
    for seed in range(20):
        s = random_shares(2.0, seed=seed)
        assert min(s.as_tuple()) >= 0 and s.avg_bits == pytest.approx(2.0, abs=1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="kind must be one of"):
        ablation("all-uniform")
    with pytest.raises(ValueError, match="bits must be one of"):
        ablation("no-range", bits=2.5)
    with pytest.raises(ValueError, match="no feasible shares without eviction"):
        no_evict_shares(preset("llama-3.2"), 0.01)  # 1-bit share alone exceeds the budget


def test_registered_for_kvbench():
    names = registry.discover()
    for kind in ABLATIONS:
        m = names[f"hqekv-3.2-{kind}"]
        assert m.budgets == frozenset() and m.default.avg_bits == 3.2
        assert m.build(m.default).name == f"hqekv-3.2-{kind}"


def test_uniform_ablation_holds_the_group_extremes_in_its_1_bit_tier():
    """w/o II end to end on one layer: the plan of HqeKV-3.2 is unchanged (same scorer, selector and shares), and
    every 1-bit entry of the ablation reads back as its group's minimum or maximum (min-max at 1 bit), where HqeKV's
    normalized tier reads back ``mean ± 0.674·std`` (strictly inside the range)."""
    from kvcore import Plan

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 256, 32
    keys, values = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    one = torch.zeros(B, H, T, dtype=torch.uint8)
    one[..., :128] = 1
    one[..., 128:] = 16
    read = {}
    for kind in ("uniform", "normal"):
        store = (ablation("uniform") if kind == "uniform" else hqekv(3.2)).new_store()
        store.write(keys, values, Plan(one, one.clone()), torch.arange(T)[None])
        read[kind] = store.read().values[..., :128, :]
    v = values[..., :128, :].reshape(B, H, 128, 1, 32)  # value groups: 32 channels of one token
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    u = read["uniform"].reshape(v.shape)
    at_lo, at_hi = torch.isclose(u, lo.expand_as(u), atol=1e-5), torch.isclose(u, hi.expand_as(u), atol=1e-5)
    assert bool((at_lo | at_hi).all()) and bool((at_hi == (v > (lo + hi) / 2)).all())
    n = read["normal"].reshape(v.shape)
    assert bool(((n > lo) & (n < hi)).all())
