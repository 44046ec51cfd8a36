"""KIVITierSelector: KIVI's prefill layout after any eviction, and the KIVI compressor end to end."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_baselines.quant import KIVIStore, KIVITierSelector, UniformQuantizer
from kvcore import (
    EVICT,
    FULL,
    Budget,
    Compressor,
    DenseStore,
    Plan,
    Protection,
    Scorer,
    Scores,
    ScoringContext,
    Selector,
    TopKSelector,
)


class _NormScorer(Scorer):
    """Key norm as importance (a stand-in scorer local to these tests)."""

    def score(self, ctx: ScoringContext) -> Scores:
        return Scores(ctx.keys.float().norm(dim=-1))


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    T=st.integers(1, 40),
    ratio=st.sampled_from([0.0, 0.25, 0.6]),
    R=st.sampled_from([1, 4, 8]),
    bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tiers_follow_kivi_prefill_layout(B, H, T, ratio, R, bits, seed):
    g = torch.Generator().manual_seed(seed)
    scores = Scores(torch.rand(B, H, T, generator=g))
    budget = Budget(ratio=ratio)
    plan = KIVITierSelector(TopKSelector(), bits=bits, residual=R, value_bits=3).select(scores, budget)
    base = TopKSelector().select(scores, budget)
    assert torch.equal(plan.keep_keys, base.keep_keys) and torch.equal(plan.keep_values, base.keep_values)
    for b in range(B):
        for h in range(H):
            kept = base.keep_keys[b, h]
            n = int(kept.sum())
            kb = plan.key_bits[b, h][kept].tolist()
            vb = plan.value_bits[b, h][kept].tolist()
            assert kb == [bits] * (n - n % R) + [FULL] * (n % R)
            assert vb == [3] * max(0, n - R) + [FULL] * min(n, R)
            assert bool((plan.key_bits[b, h][~kept] == EVICT).all())


def test_is_a_kvcore_selector_and_checks_arguments():
    assert isinstance(KIVITierSelector(), Selector)
    with pytest.raises(ValueError, match="bits"):
        KIVITierSelector(bits=0)
    with pytest.raises(ValueError, match="value_bits"):
        KIVITierSelector(value_bits=9)
    with pytest.raises(ValueError, match="residual"):
        KIVITierSelector(residual=0)
    with pytest.raises(TypeError, match="base"):
        KIVITierSelector(base=object())


def test_compressor_with_eviction_then_decoding():
    """SnapKV-style eviction + KIVI quantization: compress a prompt, decode, count the tiers."""
    torch.manual_seed(0)
    B, H, T, D, R, G = 1, 2, 50, 8, 8, 4
    comp = Compressor(
        scorer=_NormScorer(),
        selector=KIVITierSelector(TopKSelector(), bits=2, residual=R),
        store=lambda: KIVIStore(UniformQuantizer(2, "channel", G), UniformQuantizer(2, "token", G), residual=R),
        budget=Budget(ratio=0.5),
        protect=Protection(recent=4),
    )
    keys, values = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    ctx = ScoringContext(keys=keys, values=values, positions=torch.arange(T)[None] + 100)
    store = comp.compress(ctx)
    n = T // 2
    view = store.read()
    assert torch.equal(store.seq_lengths(), torch.full((B, H), n))
    assert bool((view.positions[0, :, -4:] == torch.arange(T - 4, T) + 100).all())  # recent window kept
    counts = store.entry_counts()
    assert bool((counts["keys_quantized"] == n - n % R).all()) and bool((counts["values_full"] == R).all())
    for step in range(5):
        store.append(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.tensor([[T + 100 + step]]))
    counts = store.entry_counts()
    assert bool((counts["keys_quantized"] == R * ((n + 5) // R)).all())
    assert bool((counts["values_quantized"] == n + 5 - R).all())
    out = store.read().attend(torch.randn(B, 4, 1, D))
    assert out.shape == (B, 4, 1, D) and bool(torch.isfinite(out).all())
    # the same entries at full precision for reference: the quantized store is smaller
    dense = Compressor(
        scorer=_NormScorer(),
        selector=TopKSelector(),
        store=DenseStore,
        budget=Budget(ratio=0.5),
        protect=Protection(recent=4),
    ).compress(ctx)
    assert bool((dense.seq_lengths() == n).all())
    assert store.nbytes() < dense.nbytes()


def test_plan_from_selector_round_trips_through_the_store():
    sel = KIVITierSelector(bits=4, residual=8)
    scores = Scores(torch.rand(1, 1, 20))
    plan = sel.select(scores, Budget(ratio=0.0))
    assert isinstance(plan, Plan)
    store = KIVIStore(UniformQuantizer(4, "channel", 4), UniformQuantizer(4, "token", 4), residual=8)
    k = torch.randn(1, 1, 20, 4)
    store.write(k, k, plan, torch.arange(20)[None])
    c = store.entry_counts()
    assert int(c["keys_residual"]) == 20 % 8 and int(c["values_residual"]) == 8
