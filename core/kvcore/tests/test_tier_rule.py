"""The tier rule of ``kvcore.Compressor``: a keep-or-evict selector (``PlanBits.plan_bits == {EVICT, FULL}``) paired
with a quantizing store gets the store's own tier policy (``TierPolicy.apply_tiers``) or is refused at construction;
a selector planning widths the store cannot hold is refused; undeclared selectors are not checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvcore_toys import KeyNorm, ToyTieredStore

from kvcore import (
    EVICT,
    FULL,
    Budget,
    Compressor,
    DenseStore,
    Plan,
    PlanBits,
    Protection,
    ScoringContext,
    TieredSelector,
    TierPolicy,
    TopKSelector,
    replan,
)

B, H, T, D = 2, 2, 24, 8


class ToyPolicyStore(ToyTieredStore):
    """ToyTieredStore with a tier policy of its own: every kept entry at 4 bits but the last kept one of each head
    (a one-entry full-precision residual)."""

    def apply_tiers(self, plan: Plan) -> Plan:
        def lay_out(keep: torch.Tensor) -> torch.Tensor:
            last = keep & (keep.flip(-1).cumsum(-1).flip(-1) == 1)
            return torch.where(last, FULL, torch.where(keep, 4, EVICT)).to(torch.uint8)

        return Plan(lay_out(plan.keep_keys), lay_out(plan.keep_values))


class Undeclared:
    """A keep-or-evict selector that does not declare ``plan_bits`` (a selector written before PlanBits)."""

    def select(self, scores, budget, protected=None, valid=None):
        return TopKSelector().select(scores, budget, protected, valid)


def _ctx(seed: int = 0) -> ScoringContext:
    g = torch.Generator().manual_seed(seed)
    return ScoringContext(keys=torch.randn(B, H, T, D, generator=g), values=torch.randn(B, H, T, D, generator=g))


def _comp(selector, store, **kw) -> Compressor:
    return Compressor(KeyNorm(), selector, store, Budget(ratio=0.5), Protection(recent=2), **kw)


def test_reference_selectors_declare_their_tiers():
    assert isinstance(TopKSelector(), PlanBits) and TopKSelector().plan_bits == {EVICT, FULL}
    assert TieredSelector(tiers=(16, 4, 0)).plan_bits == {EVICT, 4, FULL}
    assert TieredSelector(tiers=(4, 2)).plan_bits == {EVICT, 2, 4}
    assert not isinstance(Undeclared(), PlanBits)
    assert isinstance(ToyPolicyStore(), TierPolicy) and not isinstance(ToyTieredStore(), TierPolicy)
    assert not isinstance(DenseStore(), TierPolicy)


def test_keep_or_evict_selector_with_a_quantizing_store_without_policy_is_refused():
    with pytest.raises(ValueError, match=r"ToyTieredStore quantizes .* TopKSelector only keeps or evicts"):
        _comp(TopKSelector(), ToyTieredStore)
    with pytest.raises(ValueError, match="TierPolicy"):  # a prototype is checked the same way
        _comp(TopKSelector(), ToyTieredStore())
    comp = _comp(TopKSelector(), ToyPolicyStore)
    with pytest.raises(ValueError, match="only keeps or evicts"):  # a store handed to compress() too
        comp.compress(_ctx(), ToyTieredStore())
    with pytest.raises(ValueError, match="only keeps or evicts"):
        comp.compress_layers([_ctx()], [ToyTieredStore()])


def test_store_policy_tiers_what_a_keep_or_evict_selector_keeps():
    ctx = _ctx(1)
    comp = _comp(TopKSelector(), ToyPolicyStore)
    store = comp.compress(ctx)
    selected = comp.plan(ctx)  # the selector's own plan: keep or evict
    assert selected.tiers() == {EVICT, FULL}
    held = store.tiers()
    # the store holds exactly what the selector kept, tiered by the store's policy
    assert torch.equal(store.seq_lengths(), selected.keep_keys.sum(-1))
    assert held.tiers() == {4, FULL}
    assert torch.equal((held.key_bits == FULL).sum(-1), torch.ones(B, H, dtype=torch.long))
    assert torch.equal(comp.plan_for(store, selected).key_bits, ToyPolicyStore().apply_tiers(selected).key_bits)
    # and holds fewer bytes than the same entries at full precision
    dense = _comp(TopKSelector(), DenseStore).compress(ctx)
    assert torch.equal(dense.seq_lengths(), store.seq_lengths())
    assert store.nbytes() < dense.nbytes()


def test_store_policy_applies_to_every_layer_and_global_selection():
    ctxs = [_ctx(s) for s in range(3)]
    comp = Compressor(KeyNorm(), TopKSelector(), ToyPolicyStore, Budget(ratio=0.5, granularity="global"))
    stores = comp.compress_layers(ctxs)
    for c, store, plan in zip(ctxs, stores, comp.plan_layers(ctxs)):
        ref = ToyPolicyStore()
        ref.write(c.keys, c.values, ToyPolicyStore().apply_tiers(plan), c.positions)
        assert store.tiers().tiers() == {EVICT, 4, FULL}  # heads are ragged under a global selection: padding
        assert torch.equal(store.tiers().key_bits, ref.tiers().key_bits)
        assert torch.equal(store.seq_lengths(), plan.keep_keys.sum(-1))


def test_replan_after_a_policy_write_only_evicts():
    comp = _comp(TopKSelector(), ToyPolicyStore)
    store = comp.compress(_ctx(2))
    held = store.tiers()
    plan = replan(store, comp)  # keep-or-evict, capped at the held tiers: no demotion asked of the store
    kept = plan.keep_keys
    assert torch.equal(plan.key_bits[kept], held.key_bits[kept])


def test_selector_planning_widths_the_store_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"TieredSelector plans tiers \[4\] that store DenseStore cannot hold"):
        Compressor(KeyNorm(), TieredSelector(tiers=(16, 4, 0)), DenseStore, Budget(avg_bits=8))
    with pytest.raises(ValueError, match=r"plans tiers \[1\]"):
        Compressor(KeyNorm(), TieredSelector(tiers=(4, 1, 0)), ToyTieredStore, Budget(avg_bits=2))
    ok = Compressor(KeyNorm(), TieredSelector(tiers=(4, 2, 0)), ToyTieredStore, Budget(avg_bits=2))
    assert ok.compress(_ctx()).tiers().tiers() <= {EVICT, 2, 4}


def test_undeclared_selectors_are_not_checked():
    comp = _comp(Undeclared(), ToyTieredStore)  # no plan_bits: written as it comes
    store = comp.compress(_ctx())
    assert store.tiers().tiers() <= {EVICT, FULL}


def test_bad_declarations_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Lying(TopKSelector):
        plan_bits = frozenset({EVICT, 12})

    with pytest.raises(TypeError, match="plan_bits"):
        _comp(Lying(), DenseStore)

    class NotAPlan(ToyPolicyStore):
        def apply_tiers(self, plan):
            return plan.key_bits

    with pytest.raises(TypeError, match=r"NotAPlan.apply_tiers must return a kvcore.Plan"):
        _comp(TopKSelector(), NotAPlan).compress(_ctx())
