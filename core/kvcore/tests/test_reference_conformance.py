"""Every kvcore reference (and the toys in ``toys.py``) passes its conformance suite."""

from __future__ import annotations

import pytest
from kvcore_toys import KeyNorm, MinMax, Surprisal, ToyTieredStore, WindowAttention, surprisal_extras

from kvcore import Budget, Compressor, DenseStore, Protection, TieredSelector, TopKSelector
from kvcore.testing import CompressorTests, QuantizerTests, ScorerTests, SelectorTests, StoreTests


class TestTopKSelector(SelectorTests):
    supports_granularities = ("head", "layer", "global")

    @pytest.fixture(params=[0.0, 0.2], ids=lambda f: f"head_floor={f}")
    def selector(self, request):
        return TopKSelector(head_floor=request.param)


class TestTieredSelector(SelectorTests):
    supports_granularities = ("head", "layer")
    tiered = True

    @pytest.fixture
    def selector(self):
        return TieredSelector(tiers=(16, 4, 2, 0))


class TestTieredSelectorFixedShares(SelectorTests):
    """HqeKV's setting: 1-bit and evict shares fixed, 4/2-bit shares solved from avg_bits (Eq. 3)."""

    supports_granularities = ("head", "layer")
    supports_token_budget = False
    tiered = True
    avg_bits_choices = (1.6, 2.2, 2.8)

    @pytest.fixture
    def selector(self):
        return TieredSelector(tiers=(4, 2, 1, 0), shares={1: 0.1, 0: 0.2})


class TestDenseStore(StoreTests):
    @pytest.fixture(params=[0, 4], ids=lambda g: f"growth={g}")
    def store_factory(self, request):
        return lambda: DenseStore(growth=request.param)


class TestToyTieredStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        return ToyTieredStore


class TestMinMax(QuantizerTests):
    @pytest.fixture(params=[(b, a) for a in ("token", "channel") for b in (1, 2, 3, 4, 8)], ids=str)
    def quantizer(self, request):
        return MinMax(bits=request.param[0], axis=request.param[1], group_size=4)


class TestWindowAttention(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return WindowAttention()


class TestSurprisal(ScorerTests):
    make_extras = staticmethod(surprisal_extras)

    @pytest.fixture
    def scorer(self):
        return Surprisal()


class TestCompressor(CompressorTests):
    @pytest.fixture(params=["head", "layer"])
    def compressor(self, request):
        budget = Budget(0.5, granularity=request.param)
        return Compressor(KeyNorm(), TopKSelector(), DenseStore, budget, Protection(1, 2))


class TestCompressorWithQueries(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return Compressor(WindowAttention(), TopKSelector(), DenseStore(), Budget(tokens=12), Protection(2, 4))


class TestCompressorWithExtras(CompressorTests):
    make_extras = staticmethod(surprisal_extras)

    @pytest.fixture
    def compressor(self):
        return Compressor(Surprisal(), TopKSelector(), DenseStore, Budget(0.75))
