"""KIVI's store composed by hand (``Compressor(..., TopKSelector(), kivi(bits).store)``) holds what ``kivi(bits,
evict=...)`` holds: KIVIStore carries KIVI's prefill layout as its tier policy (``kvcore.TierPolicy``), which the
Compressor applies to a keep-or-evict selector's plans. Pairs that cannot work are refused at construction."""

import dataclasses

import pytest
import torch

from kv_baselines import kivi, snapkv
from kv_baselines.quant import KIVIStore, KIVITierSelector, UniformQuantizer
from kvcore import EVICT, FULL, Compressor, DenseStore, Plan, PlanBits, ScoringContext, TierPolicy, TopKSelector


def _ctx(T: int, seed: int = 0) -> ScoringContext:
    g = torch.Generator().manual_seed(seed)
    return ScoringContext(
        keys=torch.randn(1, 2, T, 64, generator=g),
        values=torch.randn(1, 2, T, 64, generator=g),
        queries=torch.randn(1, 4, 64, 64, generator=g),
    )


def _by_hand(evict: Compressor, store) -> Compressor:
    """``evict``'s scorer, budget and protection with a plain ``TopKSelector`` and ``store``."""
    return dataclasses.replace(evict, selector=TopKSelector(), store=store)


@pytest.mark.parametrize(
    ("T", "ratio", "bits", "value_bits"), [(512, 0.75, 4, None), (700, 0.5, 2, None), (300, 0.25, 2, 4)]
)
def test_keep_or_evict_selector_with_kivi_store_holds_what_kivi_evict_holds(T, ratio, bits, value_bits):
    ctx = _ctx(T, seed=T)
    method = kivi(bits, evict=snapkv(ratio), value_bits=value_bits)
    reference = method.compress(ctx)
    store = _by_hand(snapkv(ratio), kivi(bits, value_bits=value_bits).store).compress(ctx)
    assert isinstance(store, KIVIStore) and isinstance(store, TierPolicy)
    assert store.nbytes() == reference.nbytes()
    for side in ("key_bits", "value_bits"):
        assert torch.equal(getattr(store.tiers(), side), getattr(reference.tiers(), side))
    got, want = store.read(), reference.read()
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert torch.equal(got.positions, want.positions)
    kept = int(store.seq_lengths()[0, 0])
    counts = store.entry_counts()  # KIVI's layout: whole residual blocks of keys quantized, the last R values not
    assert bool((counts["keys_quantized"] == kept - kept % 128).all())
    assert bool((counts["values_quantized"] == max(kept - 128, 0)).all())
    full = _by_hand(snapkv(ratio), DenseStore).compress(ctx)  # the same entries at full precision
    assert torch.equal(full.seq_lengths(), store.seq_lengths()) and store.nbytes() < full.nbytes()


def test_the_policy_is_kivis_prefill_layout():
    store = KIVIStore(UniformQuantizer(4, "channel", 4), UniformQuantizer(2, "token", 4), residual=8)
    keep = torch.rand(2, 3, 30, generator=torch.Generator().manual_seed(1)) < 0.6
    tiered = store.apply_tiers(Plan.from_keep(keep))  # what a keep-or-evict selector emits, laid out
    for b in range(2):
        for h in range(3):
            n = int(keep[b, h].sum())
            keys, values = tiered.key_bits[b, h][keep[b, h]].tolist(), tiered.bits_for_values[b, h][keep[b, h]].tolist()
            # keys: whole residual blocks at 4 bits, the last n mod R full precision; values: the last min(n, R) full
            assert keys == [4] * (n - n % 8) + [FULL] * (n % 8)
            assert values == [2] * max(n - 8, 0) + [FULL] * min(n, 8)
    assert bool((tiered.key_bits[~keep] == EVICT).all()) and bool((tiered.bits_for_values[~keep] == EVICT).all())
    with pytest.raises(TypeError, match="plan must be a kvcore.Plan"):
        store.apply_tiers(keep)


def test_kivi_tier_selector_declares_its_tiers():
    sel = KIVITierSelector(bits=3, value_bits=8)
    assert isinstance(sel, PlanBits) and sel.plan_bits == {EVICT, FULL, 3, 8}
    assert KIVITierSelector(bits=2).plan_bits == {EVICT, FULL, 2}


def test_a_selector_planning_other_widths_than_the_store_is_refused():
    with pytest.raises(ValueError, match=r"KIVITierSelector plans tiers \[2\] that store KIVIStore cannot hold"):
        dataclasses.replace(kivi(2, evict=snapkv(0.5)), store=kivi(4).store)
    with pytest.raises(ValueError, match=r"plans tiers \[4\] that store DenseStore cannot hold"):
        dataclasses.replace(kivi(4), store=DenseStore)
