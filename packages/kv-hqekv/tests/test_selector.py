"""The block tier selector: the spec's properties 9-10 (its conformance suite is in test_conformance.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kv_hqekv import PRESETS, HqeKVSelector, Shares
from kvcore import EVICT, FULL, Budget, Scores

SHARES = Shares(0.3, 0.4, 0.2, 0.1)  # 2.2 average bits


ORDER = {FULL: 5, 4: 4, 2: 3, 1: 2, EVICT: 0}


def rank(t: torch.Tensor) -> torch.Tensor:
    return t.long().apply_(lambda b: ORDER[b])


@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(0, 12),
    st.integers(0, 31),
    st.sampled_from(sorted(PRESETS)),
    st.booleans(),
    st.integers(0, 999),
)
def test_blocks_ranked_by_mean(B, H, n_blocks, tail, name, joint, seed):
    """Higher tiers hold higher block metrics (K and V separately), ties by lower index; counts: fp16 = min(2, n),
    Σ = n, K counts = V counts; the s mod 32 tail is fp16; joint_evict evicts the same blocks for K and V."""
    G = 32
    N = n_blocks * G + tail
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=gen).round()  # ties happen
    ks, vs = base.expand(B, H, N).contiguous(), torch.randn(N, generator=gen).expand(B, H, N).contiguous()
    sel = HqeKVSelector(PRESETS[name], joint_evict=joint)
    plan = sel.select(Scores(ks, vs), Budget(avg_bits=PRESETS[name].avg_bits))
    P = n_blocks * G
    assert bool((plan.key_bits[..., P:] == FULL).all()) and bool((plan.bits_for_values[..., P:] == FULL).all())
    c = sel.counts(n_blocks)
    for bits, score in ((plan.key_bits, ks), (plan.bits_for_values, vs)):
        blk = bits[0, 0, :P].view(n_blocks, G)
        assert bool((blk == blk[:, :1]).all()), "a block has one tier"
        tier, metric = rank(blk[:, 0]), score[0, 0, :P].view(n_blocks, G).mean(-1)
        for i in range(n_blocks):
            for j in range(n_blocks):
                if tier[i] > tier[j] and not (joint and bits is plan.bits_for_values):
                    assert metric[i] > metric[j] or (metric[i] == metric[j] and i < j)
        got = [int((blk[:, 0] == w).sum()) for w in (FULL, 4, 2, 1, EVICT)]
        assert got == list(c.as_tuple())
    if joint:
        assert torch.equal(plan.key_bits == EVICT, plan.bits_for_values == EVICT)


def test_short_contexts_and_padding():
    """Below 32 tokens nothing is planned (all fp16); 32-63 tokens give one fp16 block; padding is evicted."""
    sel = HqeKVSelector(PRESETS["llama-2"])
    for N in (1, 31, 32, 63):
        plan = sel.select(Scores(torch.rand(1, 2, N)), Budget())
        assert bool((plan.key_bits == FULL).all())
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[1, :50] = False
    plan = sel.select(Scores(torch.rand(2, 2, 200)), Budget(), valid=valid)
    assert not bool(plan.keep_keys[1, :, :50].any())


def test_bad_inputs():
    sel = HqeKVSelector(PRESETS["llama-2"])
    s = Scores(torch.rand(1, 2, 64))
    with pytest.raises(ValueError, match="avg_bits"):
        sel.select(s, Budget(avg_bits=3.2))
    with pytest.raises(ValueError, match="budgeted by its shares"):
        sel.select(s, Budget(ratio=0.5))
    with pytest.raises(ValueError, match="NaN|finite"):
        Scores(torch.full((1, 2, 64), float("nan")))
    with pytest.raises(ValueError, match="finite"):
        Scores(-torch.full((1, 2, 64), float("inf")))
    with pytest.raises(TypeError, match="shares"):
        HqeKVSelector((0.1, 0.2, 0.3, 0.4))
    with pytest.raises(ValueError, match="sharing"):
        HqeKVSelector(PRESETS["llama-2"], sharing="batch")
    with pytest.raises(ValueError, match="protected"):  # 5 protected blocks, 2 fp16 slots
        sel.select(Scores(torch.rand(1, 2, 160)), Budget(), protected=torch.ones(1, 160, dtype=torch.bool))


def test_declares_tier_shares():
    """HqeKVSelector declares ``kvcore.TierShares``: its tiers and the Eq. 3 shares δ, the budget checked as
    ``select`` checks it."""
    from kvcore import TierShares, tier_shares

    shares = Shares(0.3, 0.4, 0.2, 0.1)
    sel = HqeKVSelector(shares)
    assert isinstance(sel, TierShares) and tier_shares(sel) is sel
    assert sel.tiers == (FULL, 4, 2, 1, EVICT)
    want = {4: shares.q4, 2: shares.q2, 1: shares.q1, EVICT: shares.evict}
    assert sel.resolve_shares(Budget(avg_bits=shares.avg_bits)) == want == sel.resolve_shares(Budget())
    with pytest.raises(ValueError, match="budgeted by its shares"):
        sel.resolve_shares(Budget(ratio=0.5))
    with pytest.raises(TypeError, match="kvcore.Budget"):
        sel.resolve_shares(0.5)
