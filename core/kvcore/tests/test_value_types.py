"""Plain unit tests of kvcore's value types and helpers, where the conformance suites do not reach."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import Budget, Plan, Protection, Scores, ScoringContext, solve_shares, storage_bytes, tier_counts
from kvcore.testing.strategies import left_padded_masks

FAST = settings(max_examples=25, deadline=None)


@FAST
@given(n=st.integers(0, 10**6), num=st.integers(0, 999), den=st.integers(1, 1000))
def test_budget_kept_is_the_exact_floor(n, num, den):
    ratio = Fraction(num % den, den)  # in [0, 1)
    assert Budget(ratio=float(ratio)).kept(n) == math.floor(n * (1 - ratio))


@FAST
@given(n=st.integers(0, 500), tokens=st.integers(1, 600))
def test_budget_tokens_kept_is_min(n, tokens):
    assert Budget(tokens=tokens).kept(n) == min(tokens, n)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(ratio=0.5, tokens=3), ValueError),
        (dict(ratio=1.0), ValueError),
        (dict(ratio=-0.1), ValueError),
        (dict(ratio="0.5"), TypeError),
        (dict(ratio=True), TypeError),
        (dict(tokens=0), ValueError),
        (dict(tokens=2.0), TypeError),
        (dict(granularity="token"), ValueError),
        (dict(avg_bits=17), ValueError),
    ],
)
def test_budget_rejects(kwargs, err):
    with pytest.raises(err):
        Budget(**kwargs)


def test_budget_defaults_to_keep_all():
    assert Budget().ratio == 0.0 and Budget().kept(7) == 7 and Budget(avg_bits=2.0).ratio is None


@FAST
@given(data=st.data(), sinks=st.integers(0, 5), recent=st.integers(0, 5))
def test_protection_mask_matches_a_loop(data, sinks, recent):
    B, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    valid = torch.rand(B, T, generator=g) > 0.3
    valid = data.draw(left_padded_masks(B, T, min_valid=0)) if data.draw(st.booleans()) else valid
    got = Protection(sinks, recent).mask(valid)
    for b in range(B):
        real = valid[b].nonzero().flatten().tolist()
        want = set(real[:sinks]) | set(real[max(0, len(real) - recent) :] if recent else [])
        assert set(got[b].nonzero().flatten().tolist()) == want


@pytest.mark.parametrize(
    ("kwargs", "err"), [(dict(sinks=-1), ValueError), (dict(recent=1.5), TypeError), (dict(sinks=True), TypeError)]
)
def test_protection_rejects(kwargs, err):
    with pytest.raises(err, match=next(iter(kwargs))):
        Protection(**kwargs)


@FAST
@given(tiers=st.lists(st.sampled_from([0, 1, 2, 3, 4, 8, 16]), min_size=2, max_size=5, unique=True), f=st.floats(0, 1))
def test_solve_shares_meets_eq3(tiers, f):
    avg = min(tiers) + f * (max(tiers) - min(tiers))
    shares = solve_shares(tuple(tiers), avg)
    assert abs(sum(shares.values()) - 1) < 1e-9 and abs(sum(b * s for b, s in shares.items()) - avg) < 1e-9
    assert sum(s > 0 for s in shares.values()) <= 2 and all(0 <= s <= 1 for s in shares.values())


def test_solve_shares_with_fixed_shares_and_errors():
    shares = solve_shares((4, 2, 1, 0), 2.2, {1: 0.1, 0: 0.2})  # HqeKV Alg. 1: 1-bit and evict shares fixed
    assert shares[1] == 0.1 and shares[0] == 0.2 and abs(4 * shares[4] + 2 * shares[2] + 0.1 - 2.2) < 1e-9
    with pytest.raises(ValueError, match="unreachable"):
        solve_shares((4, 2, 1, 0), 3.5, {1: 0.1, 0: 0.2})
    with pytest.raises(ValueError, match="outside"):
        solve_shares((4, 2), 5.0)
    with pytest.raises(ValueError, match="all tiers but two"):
        solve_shares((4, 2, 1, 0), 2.0, {1: 0.1})


@FAST
@given(raw=st.lists(st.floats(0.01, 1), min_size=1, max_size=5), n=st.integers(1, 300))
def test_tier_counts_floor_rule(raw, n):
    total = sum(raw)
    shares = {b: r / total for b, r in zip((16, 8, 4, 2, 0), raw)}
    counts = tier_counts(shares, n)
    target = sum(b * s for b, s in shares.items())
    got = sum(b * c for b, c in counts) / n
    assert sum(c for _, c in counts) == n and all(c >= 0 for _, c in counts)
    assert [b for b, _ in counts] == sorted(shares, reverse=True)
    assert target - max(shares) / n - 1e-9 <= got <= target + 1e-9


def test_plan_validation_and_average_bits():
    with pytest.raises(TypeError):
        Plan(torch.zeros(1, 2, 3, dtype=torch.int64))
    with pytest.raises(ValueError):
        Plan(torch.zeros(1, 2, 3, dtype=torch.uint8), torch.zeros(1, 2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        Plan(torch.zeros(1, 2, 3, dtype=torch.uint8), full_precision=torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError):
        Plan(torch.zeros(2, 3, dtype=torch.uint8))
    kb = torch.tensor([[[16, 4, 0, 2]]], dtype=torch.uint8)
    plan = Plan(kb, torch.tensor([[[16, 16, 0, 0]]], dtype=torch.uint8))
    assert plan.tiers() == {0, 2, 4, 16} and plan.average_bits() == (22 + 32) / 8
    assert plan.average_bits(torch.tensor([[False, True, True, True]])) == pytest.approx((6 + 16) / 6)
    assert torch.equal(Plan.from_keep(kb > 0).keep_keys, kb > 0) and Plan(kb).bits_for_values is kb


def test_scores_validation():
    with pytest.raises(TypeError):
        Scores(torch.zeros(1, 2, 3, dtype=torch.float16))
    with pytest.raises(ValueError):
        Scores(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        Scores(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4))
    s = Scores(torch.zeros(1, 2, 3))
    assert s.for_values is s.keys and s.shape == (1, 2, 3)


@pytest.mark.parametrize(
    "change, err",
    [
        (dict(keys=torch.zeros(2, 6, 8)), ValueError),
        (dict(keys=[0.0]), TypeError),
        (dict(values=torch.zeros(2, 3, 6, 8)), ValueError),
        (dict(keys=torch.zeros(2, 2, 6, 8).to(torch.int8)), TypeError),
        (dict(keys=torch.zeros(2, 2, 0, 8), values=torch.zeros(2, 2, 0, 8)), ValueError),
        (dict(queries=torch.zeros(2, 3, 4, 8)), ValueError),
        (dict(queries=torch.zeros(2, 4, 4, 6)), ValueError),
        (dict(positions=torch.zeros(2, 5, dtype=torch.long)), ValueError),
        (dict(positions=torch.zeros(2, 6)), ValueError),
        (dict(attention_mask=torch.ones(2, 6, dtype=torch.int64)), TypeError),
        (dict(attention_mask=torch.ones(3, 6, dtype=torch.bool)), ValueError),
        (dict(protected=torch.ones(2, 5, dtype=torch.bool)), ValueError),
    ],
)
def test_scoring_context_rejects(change, err):
    x = torch.zeros(2, 2, 6, 8)
    with pytest.raises(err):
        ScoringContext(**{"keys": x, "values": x, **change})


def test_scoring_context_defaults():
    ctx = ScoringContext(torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8), torch.zeros(2, 4, 3, 8))
    assert torch.equal(ctx.positions, torch.arange(6).expand(2, 6)) and bool(ctx.valid.all())
    assert (ctx.batch_size, ctx.num_kv_heads, ctx.seq_len) == (2, 2, 6)
    mask = torch.tensor([[False, True, True, True, True, True]]).expand(2, 6)
    assert torch.equal(ScoringContext(ctx.keys, ctx.values, attention_mask=mask).valid, mask)


def test_storage_bytes_counts_storages_once():
    x = torch.zeros(10, 4)
    assert storage_bytes([x, x[:2], x.view(40), None]) == 160 and storage_bytes([x[:2].clone()]) == 32
    assert storage_bytes([x], device="cpu") == 160 and storage_bytes([x], device="meta") == 0
