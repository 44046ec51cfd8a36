"""The optional capabilities kvcore declares as protocols (``AttendingStore``, ``TierShares``): read from the
declaration, a declaration without its method refused with a clear error, and the suites taking them from there."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvcore_toys import ToyTieredStore

import kvcore
from kvcore import (
    AttendingStore,
    Budget,
    DenseStore,
    Plan,
    Scores,
    Selector,
    Store,
    TieredSelector,
    TierShares,
    TopKSelector,
    attends,
    tier_shares,
)
from kvcore.testing import SelectorTests, StoreTests


# -- AttendingStore ---------------------------------------------------------------------------------------------
class DeclaresAttendWithout(DenseStore):
    """Declares fused attention but has no ``attend``."""

    can_attend = True


class AttendNotCallable(DenseStore):
    can_attend = True
    attend = None


class AttendNotBool(DenseStore):
    can_attend = 1


def test_attends_reads_the_declaration():
    assert attends(DenseStore()) is False
    assert not isinstance(DenseStore(), AttendingStore)  # no attend method
    store = ToyTieredStore()
    assert attends(store) is True
    assert isinstance(store, AttendingStore) and isinstance(store, Store)


@pytest.mark.parametrize("cls", [DeclaresAttendWithout, AttendNotCallable])
def test_declared_attend_without_the_method_is_refused(cls):
    with pytest.raises(TypeError, match=r"declares can_attend = True but has no attend\(query, scale=None\)"):
        attends(cls())


def test_can_attend_must_be_a_bool():
    with pytest.raises(TypeError, match="can_attend must be a bool"):
        attends(AttendNotBool())


def test_store_suite_refuses_a_declared_attend_without_the_method():
    with pytest.raises(TypeError, match="can_attend = True"):
        StoreTests().test_declares_capabilities(DeclaresAttendWithout)
    with pytest.raises(TypeError, match="can_attend = True"):
        StoreTests().test_attend_fused_matches_reference(DeclaresAttendWithout)


def test_store_suite_takes_can_attend_from_the_declaration():
    """Left ``None``, the suite's flag is the store's declaration: a declaring store is tested, a dense one skipped."""
    calls = []

    class Recording(ToyTieredStore):
        def attend(self, query, scale=None):
            calls.append(1)
            return super().attend(query, scale)

    StoreTests().test_attend_rejects_bad_queries(Recording)
    assert calls
    with pytest.raises(pytest.skip.Exception, match="can_attend=False"):
        StoreTests().test_attend_rejects_bad_queries(DenseStore)


def test_kv_hf_style_adapter_check_is_at_construction():
    """An adapter reads the declaration once, through ``attends``: the refusal names the store."""
    with pytest.raises(TypeError, match="DeclaresAttendWithout"):
        attends(DeclaresAttendWithout())


# -- TierShares -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeclaresTiersWithout:
    """Declares ``tiers`` but has no ``resolve_shares``."""

    tiers: tuple[int, ...] = (4, 2, 0)

    def select(self, scores, budget, protected=None, valid=None) -> Plan:
        return TieredSelector(self.tiers, {4: 0.5, 2: 0.25, 0: 0.25}).select(scores, budget, protected, valid)


@dataclasses.dataclass(frozen=True)
class BadTiers(TieredSelector):
    def __post_init__(self) -> None:  # skip TieredSelector's own validation
        pass


def test_tier_shares_reads_the_declaration():
    sel = TieredSelector(tiers=(4, 2, 0))
    assert tier_shares(sel) is sel and isinstance(sel, TierShares) and isinstance(sel, Selector)
    assert tier_shares(TopKSelector()) is None and not isinstance(TopKSelector(), TierShares)


def test_declared_tiers_without_resolve_shares_is_refused():
    sel = DeclaresTiersWithout()
    assert isinstance(sel, Selector) and not isinstance(sel, TierShares)
    with pytest.raises(TypeError, match=r"declares tiers \(4, 2, 0\) but has no resolve_shares\(budget\)"):
        tier_shares(sel)


@pytest.mark.parametrize("tiers", [(), (4, 12), (4.0, 0), (True, 0), "42"])
def test_declared_tiers_must_be_widths(tiers):
    with pytest.raises(TypeError, match="declares tiers="):
        tier_shares(BadTiers(tiers=tiers))


def test_selector_suite_refuses_a_declared_tiers_without_resolve_shares():
    with pytest.raises(TypeError, match="resolve_shares"):
        SelectorTests().test_average_bits_budget(DeclaresTiersWithout())


def test_selector_suite_takes_tiered_and_shares_from_the_declaration():
    """``tiered`` and ``tiers`` left ``None`` come from ``TierShares``; ``expected_shares`` is ``resolve_shares``."""
    suite, sel = SelectorTests(), TieredSelector(tiers=(16, 4, 2, 0))
    assert suite.is_tiered(sel) and not suite.is_tiered(TopKSelector())
    assert suite.declared_tiers(sel) == (16, 4, 2, 0)
    budget = Budget(avg_bits=5.0)
    assert suite.expected_shares(sel, budget) == sel.resolve_shares(budget)
    assert suite.expected_shares(TopKSelector(), budget) is None
    suite.test_average_bits_budget(sel)  # runs (not skipped): tiered from the declaration
    with pytest.raises(pytest.skip.Exception, match="tiered=True"):
        suite.test_kept_count_exact(sel, "head")
    with pytest.raises(pytest.skip.Exception, match="tiered=False"):
        suite.test_average_bits_budget(TopKSelector())
    flagged = type("Flagged", (SelectorTests,), {"tiered": False, "tiers": (8, 0)})()
    assert not flagged.is_tiered(sel) and flagged.declared_tiers(sel) == (8, 0)  # flags override


def test_selector_suite_checks_shares_through_the_declaration():
    """A ``resolve_shares`` the plans do not follow fails the suite's share check."""

    @dataclasses.dataclass(frozen=True)
    class WrongShares(TieredSelector):
        def resolve_shares(self, budget):  # declares shares its plans do not follow
            shares = super().resolve_shares(budget)
            return {b: (1.0 if b == max(shares) else 0.0) for b in shares}

        def select(self, scores, budget, protected=None, valid=None):
            return TieredSelector(self.tiers).select(scores, budget, protected, valid)

    with pytest.raises(AssertionError, match="-bit count"):
        SelectorTests().test_average_bits_budget(WrongShares(tiers=(16, 4, 2, 0)))


def test_exported():
    for name in ("AttendingStore", "TierShares", "attends", "tier_shares"):
        assert name in kvcore.__all__
    scores = Scores(torch.randn(1, 1, 8))
    assert TieredSelector(tiers=(4, 0), shares={4: 0.5, 0: 0.5}).select(scores, Budget()).key_bits.shape == (1, 1, 8)


def test_compressor_refuses_a_declared_capability_without_its_method():
    from kvcore_toys import KeyNorm

    with pytest.raises(TypeError, match="resolve_shares"):
        kvcore.Compressor(KeyNorm(), DeclaresTiersWithout(), DenseStore())
    with pytest.raises(TypeError, match="can_attend = True"):
        kvcore.Compressor(KeyNorm(), TopKSelector(), DeclaresAttendWithout())

    @dataclasses.dataclass(frozen=True)
    class Undeclared:  # no plan_bits: the Compressor builds no store at construction
        def select(self, scores, budget, protected=None, valid=None) -> Plan:
            return TopKSelector().select(scores, budget, protected, valid)

    factory = kvcore.Compressor(KeyNorm(), Undeclared(), DeclaresAttendWithout)  # a factory: checked per store
    with pytest.raises(TypeError, match="can_attend = True"):
        factory.new_store()
