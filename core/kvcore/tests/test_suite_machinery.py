"""Tests of the conformance machinery itself: the no-override guard, the memory walker, the bit packer, the
strategies and the skips by capability flag."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from kvcore_toys import KeyNorm, MinMax, ToyTieredStore

from kvcore import (
    Budget,
    Compressor,
    DenseStore,
    Plan,
    Scores,
    TopKSelector,
    packed_width,
    reference_attention,
    storage_bytes,
)
from kvcore.testing import (
    CompressorTests,
    QuantizerTests,
    ScorerTests,
    SelectorTests,
    StoreTests,
    overridden_standard_tests,
    pack_codes,
    reachable_bytes,
    reachable_tensors,
    unpack_codes,
)
from kvcore.testing.strategies import (
    KINDS,
    budgets_below_protected,
    fill,
    kv_samples,
    left_padded_masks,
)

FAST = settings(max_examples=20, deadline=None)


# -- the guard -------------------------------------------------------------------------------------------
class Faithful(ScorerTests):
    stochastic = True  # flags and fixtures may change freely


class Overrides(ScorerTests):
    def test_pure(self, scorer):  # a silent override
        pass


class OverridesWithXfail(SelectorTests):
    @pytest.mark.xfail(reason="ties broken by higher index, by design")
    def test_ties_break_by_lower_index(self, selector):
        pass


class XfailWithoutReason(StoreTests):
    @pytest.mark.xfail
    def test_crop(self, store_factory):
        pass


class Deletes(StoreTests):
    test_reorder = None


class Grandchild(Overrides):
    pass


def test_guard_accepts_faithful_subclasses_and_xfail_with_reason():
    assert overridden_standard_tests(Faithful) == [] and overridden_standard_tests(OverridesWithXfail) == []
    assert overridden_standard_tests(ScorerTests) == []


def test_guard_flags_silent_overrides_and_deletions():
    assert overridden_standard_tests(Overrides) == ["test_pure"]
    assert overridden_standard_tests(Grandchild) == ["test_pure"]
    assert overridden_standard_tests(XfailWithoutReason) == ["test_crop"]
    assert overridden_standard_tests(Deletes) == ["test_reorder"]


def test_guard_test_fails_on_a_silent_override():
    with pytest.raises(AssertionError, match="test_pure"):
        Overrides().test_no_overrides_DO_NOT_OVERRIDE()
    Faithful().test_no_overrides_DO_NOT_OVERRIDE()


def test_skips_name_the_flag():
    with pytest.raises(pytest.skip.Exception, match="supports_crop"):
        type("NoCrop", (StoreTests,), {"supports_crop": False})().test_crop(DenseStore)
    with pytest.raises(pytest.skip.Exception, match="supports_granularities"):
        SelectorTests().test_kept_count_exact(TopKSelector(), "global")
    with pytest.raises(pytest.skip.Exception, match="can_attend"):
        StoreTests().test_attend_fused_matches_reference(DenseStore)
    with pytest.raises(pytest.skip.Exception, match="can_attend"):
        type("NoAttend", (StoreTests,), {"can_attend": False})().test_attend_rejects_bad_queries(ToyTieredStore)


def test_retier_suite_exercises_demotion_and_eviction():
    """The re-tiering property draws plans that demote (on a store with ``can_demote``) and evict."""
    seen = []

    class Recording(ToyTieredStore):
        def retier(self, plan):
            t = self.tiers()
            seen.append(
                (
                    bool((plan.keep_keys & (plan.key_bits < t.key_bits)).any()),
                    bool((t.keep_keys & ~plan.keep_keys).any()),
                )
            )
            super().retier(plan)

    StoreTests().test_retier_keeps_untouched_entries(Recording)
    assert any(d for d, _ in seen) and any(e for _, e in seen), seen


# -- the walker ------------------------------------------------------------------------------------------
@dataclass
class Holder:
    a: torch.Tensor
    rest: object = None


class Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def test_walker_follows_containers_and_dedups_storages():
    x, y, z = torch.zeros(8), torch.zeros(4, dtype=torch.float64), torch.zeros(2, dtype=torch.int16)
    obj = Holder(x, [x[2:], {"k": (y, Slotted(z))}, {y}.__class__([1])])
    obj.rest.append(obj)  # a cycle
    assert reachable_bytes(obj) == 32 + 32 + 4 and len(list(reachable_tensors(obj))) == 4
    assert reachable_bytes(obj, device="meta") == 0 and reachable_bytes(Holder(x[:1].clone())) == 4


def test_walker_sees_what_dense_store_holds():
    store = DenseStore(growth=3)
    assert reachable_bytes(store) == 0
    store.append(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.arange(5)[None])
    store.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[5]]))
    # K and V [2 heads x 9 slots x 4] fp32, int32 positions, start/len/cap per head, the row's last position
    assert reachable_bytes(store) == store.nbytes() == 2 * 2 * 9 * 4 * 4 + 2 * 9 * 4 + 3 * 2 * 8 + 1 * 8


# -- the bit packer --------------------------------------------------------------------------------------
@FAST
@given(bits=st.integers(1, 8), d=st.integers(1, 20), rows=st.integers(1, 4), seed=st.integers(0, 99))
def test_pack_unpack_bijection(bits, d, rows, seed):
    codes = torch.randint(2**bits, (rows, d), generator=torch.Generator().manual_seed(seed))
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, packed_width(d, bits)) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits, d), codes)


def test_pack_layout_is_little_endian():
    # codes 1, 2, 3 at 3 bits: stream 100 010 110 (bit 0 first) -> byte 0 = 0b11010001, byte 1 = 0b0
    assert pack_codes(torch.tensor([[1, 2, 3]]), 3).tolist() == [[0b11010001, 0]]
    assert pack_codes(torch.tensor([[1, 15]]), 4).tolist() == [[0xF1]]


# -- strategies ------------------------------------------------------------------------------------------
@FAST
@given(x=kv_samples())
def test_kv_samples_shapes(x):
    B, H, T, D = x.keys.shape
    assert 1 <= B <= 3 and 1 <= H <= 4 and 1 <= T <= 48 and D in (4, 8, 16) and x.values.shape == x.keys.shape
    assert x.queries.shape[1] // H in (1, 2, 4) and x.queries.shape[1] % H == 0 and x.queries.shape[-1] == D
    if x.attention_mask is not None:  # left padding: once real, real to the end
        m = x.attention_mask.long()
        assert bool((m[:, 1:] >= m[:, :-1]).all() and m[:, -1].all())


@FAST
@given(case=budgets_below_protected(), g=st.sampled_from(["head", "layer"]))
def test_budgets_below_protected(case, g):
    T, protect, budget = case
    assert budget.kept(T) == int(protect.mask(torch.ones(1, T, dtype=torch.bool)).sum()) - 1


@pytest.mark.parametrize("kind", KINDS)
def test_fill_kinds(kind):
    x = fill((3, 50), torch.float16, kind, 1)
    assert x.dtype == torch.float16 and bool(torch.isfinite(x).all())
    assert (kind == "constant") == (x.unique().numel() == 1) and (kind != "plateau" or bool((x == x.round()).all()))


@FAST
@given(m=left_padded_masks(3, 5, min_valid=2))
def test_left_padded_masks_min_valid(m):
    assert m.shape == (3, 5) and bool((m.sum(-1) >= 2).all())


# -- packaging -------------------------------------------------------------------------------------------
def test_import_kvcore_stays_light():
    heavy = ("transformers", "pytest", "hypothesis", "triton")
    code = f"import sys, kvcore; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# -- the suites catch broken implementations ---------------------------------------------------------------
class Mutating(KeyNorm):
    def score(self, ctx):
        ctx.keys.mul_(2)
        return super().score(ctx)


class Noisy(KeyNorm):
    def score(self, ctx):
        return Scores(super().score(ctx).keys + torch.rand(ctx.keys.shape[:3]))


class LastFirst:
    """TopK on time-reversed input: equal scores favour *higher* indices."""

    def select(self, scores, budget, protected=None, valid=None):
        flip = lambda t: None if t is None else t.flip(-1)  # noqa: E731
        plan = TopKSelector().select(Scores(flip(scores.keys)), budget, flip(protected), flip(valid))
        return Plan(flip(plan.key_bits))


@dataclass(frozen=True)
class QuietlyQuantizes(TopKSelector):
    """Plans its kept entries at 4 bits while inheriting TopKSelector's ``plan_bits = {EVICT, FULL}``."""

    def select(self, scores, budget, protected=None, valid=None):
        keep = super().select(scores, budget, protected, valid).keep_keys
        return Plan(torch.where(keep, 4, 0).to(torch.uint8))


class Hoarder(DenseStore):
    """Keeps (and counts) the evicted entries too."""

    def write(self, keys, values, plan, positions):
        super().write(keys, values, plan, positions)
        self._all = keys.clone()


class Unaccounted(DenseStore):
    def write(self, keys, values, plan, positions):
        super().write(keys, values, plan, positions)
        self._copy = keys.clone()

    def nbytes(self, device=None):
        return super().nbytes(device) - (0 if self._copy is None else self._copy.untyped_storage().nbytes())

    def reset(self):
        super().reset()
        self._copy = None


_REVERSE = torch.tensor([int(f"{i:08b}"[::-1], 2) for i in range(256)], dtype=torch.uint8)


class BigEndian(MinMax):
    """Packs the bits of each byte in the opposite order to the documented layout (and reads them back so)."""

    def quantize(self, x):
        q = super().quantize(x)
        return dataclasses.replace(q, codes=_REVERSE[q.codes.long()])

    def dequantize(self, q):
        return super().dequantize(dataclasses.replace(q, codes=_REVERSE[q.codes.long()]))


class PerturbingRetier(DenseStore):
    """Rewrites a kept entry while re-tiering (what a dequantize-and-requantize pass does to some entries)."""

    def retier(self, plan):
        super().retier(plan)
        if len(self._k):
            self._k[0] = torch.where(self._k[0] == 0, 1, self._k[0] * 2)


class KeepsEvictedMemory(DenseStore):
    """Keeps the buffers from before a retier alive (and counts them, so nbytes() matches what is reachable)."""

    def reset(self):
        super().reset()
        self._old = None

    def retier(self, plan):
        old = (self._k, self._v)
        super().retier(plan)
        self._old = old

    def nbytes(self, device=None):
        return storage_bytes(
            [self._k, self._v, self._pos, self._start, self._len, self._cap, *(self._old or ())], device
        )


class MutatesBeforeRaising(DenseStore):
    """Applies the evictions of a plan before it notices the plan is bad."""

    def retier(self, plan):
        try:
            DenseStore.retier(copy.deepcopy(self), plan)
        except (ValueError, TypeError):
            held = self.tiers().keep_keys
            if isinstance(plan, Plan) and plan.key_bits.shape == held.shape:
                DenseStore.retier(self, Plan.from_keep(held & plan.keep_keys))
            raise
        DenseStore.retier(self, plan)


class TiersMarkPadding(DenseStore):
    """``tiers()`` reports padding as held (FULL)."""

    def tiers(self):
        return Plan(torch.full(self.read().positions.shape, 16, dtype=torch.uint8))


class AttendIgnoresBias(DenseStore):
    """A fused attend that forgets the logit bias (so it attends to the zero padding of ragged heads)."""

    can_attend = True

    def attend(self, query, scale=None):
        view = self.read(query)
        unbiased = dataclasses.replace(view, logit_bias=torch.zeros_like(view.logit_bias))
        return reference_attention(unbiased, query, scale)


class UncheckedReorder(DenseStore):
    """Reorders without validating the index: an out-of-range row escapes as an IndexError from the gather."""

    def reorder(self, index):
        _B, H = self._shape
        segs = (index[:, None] * H + torch.arange(H)).flatten()
        self._relayout(segs, self._len[segs])
        self._shape = (index.numel(), H)


class ResetsBeforeChecking(DenseStore):
    """Drops the held content first, then validates the new one (a rejected write loses the cache)."""

    def write(self, keys, values, plan, positions):
        self.reset()
        super().write(keys, values, plan, positions)


class GrowsBeforeChecking(DenseStore):
    """Makes room for an append before validating it (a rejected append leaves grown buffers: nbytes changes)."""

    def append(self, keys, values, positions):
        if self._k is not None and isinstance(keys, torch.Tensor) and keys.ndim == 4:
            B, H = self._shape
            self._relayout(torch.arange(B * H), self._len + keys.shape[2] + self.growth + 1)
        super().append(keys, values, positions)


@pytest.mark.parametrize(
    ("store", "message"),
    [
        (UncheckedReorder, "raised IndexError"),
        (ResetsBeforeChecking, "raised but left the store unreadable"),
        (GrowsBeforeChecking, r"raised but changed nbytes\(\)"),
    ],
    ids=["index-error-escapes", "resets-before-checking", "grows-before-checking"],
)
def test_bad_input_suite_catches_unclear_errors_and_partial_mutations(store, message):
    with pytest.raises(AssertionError, match=message):
        StoreTests().test_rejects_bad_input_atomically(store)


@pytest.mark.parametrize(
    "run",
    [
        lambda: ScorerTests().test_pure(Mutating()),
        lambda: ScorerTests().test_deterministic(Noisy()),
        lambda: type("T", (SelectorTests,), {})().test_ties_break_by_lower_index(LastFirst()),
        lambda: type("T", (SelectorTests,), {})().test_kept_count_exact(QuietlyQuantizes(), "head"),
        lambda: StoreTests().test_evicted_entries_hold_no_memory(Hoarder),
        lambda: StoreTests().test_write_read_roundtrip(Unaccounted),
        lambda: QuantizerTests().test_packing_bijection(BigEndian(bits=3)),
        lambda: StoreTests().test_retier_keeps_untouched_entries(PerturbingRetier),
        lambda: StoreTests().test_retier_identity_is_noop(PerturbingRetier),
        lambda: StoreTests().test_retier_keeps_untouched_entries(KeepsEvictedMemory),
        lambda: StoreTests().test_retier_evicted_entries_hold_no_memory(KeepsEvictedMemory),
        lambda: StoreTests().test_retier_rejects_bad_plans_atomically(MutatesBeforeRaising),
        lambda: StoreTests().test_tiers_follow_write_and_append(TiersMarkPadding),
        lambda: StoreTests().test_attend_fused_matches_reference(AttendIgnoresBias),
    ],
    ids=[
        "mutating-scorer",
        "noisy-scorer",
        "ties-to-higher-index",
        "plans-outside-plan-bits",
        "hoarding-store",
        "unaccounted-store",
        "big-endian",
        "retier-perturbs-kept",
        "retier-identity-perturbs",
        "retier-keeps-evicted-memory",
        "retier-keeps-evicted-memory-bytes",
        "retier-mutates-before-raising",
        "tiers-mark-padding",
        "attend-ignores-bias",
    ],
)
def test_suites_catch_broken_implementations(run):
    previous = settings.get_current_profile_name()  # e.g. the derandomized "ci" profile of the root conftest
    settings.register_profile("no-shrink", parent=settings.get_profile(previous), phases=[Phase.generate])
    settings.load_profile("no-shrink")
    try:
        with pytest.raises(AssertionError):
            run()
    finally:
        settings.load_profile(previous)


class _Zeros(KeyNorm):
    """Scores nothing from the keys, so NaN keys pass through to the store unless the compressor checks them."""

    def score(self, ctx):
        return Scores(torch.zeros(ctx.keys.shape[:3]))


class _Sink(DenseStore):
    """Accepts any layer without looking at it (so only the compressor's own check can refuse NaN)."""

    def write(self, keys, values, plan, positions):
        return None


class _Unvalidated(Compressor):
    """Declares ``validate=True`` but scores NaN inputs anyway (what ``test_rejects_non_finite_inputs`` catches)."""

    def score(self, ctx):
        return dataclasses.replace(self, validate=False).score(ctx) if self.validate else super().score(ctx)


def test_compressor_suite_catches_a_compressor_that_scores_non_finite_inputs():
    good = Compressor(KeyNorm(), TopKSelector(), DenseStore, Budget(ratio=0.5))
    CompressorTests().test_rejects_non_finite_inputs(good)
    bad = _Unvalidated(_Zeros(), TopKSelector(), _Sink, Budget(ratio=0.5))
    with pytest.raises((pytest.fail.Exception, AssertionError)):
        CompressorTests().test_rejects_non_finite_inputs(bad)
