"""The kvcore conformance suites adopted by every HEX protocol object."""

import pytest

import kv_hex
from kv_hex import AccumulatedAttentionScorer, HEXConfig, HEXSelector, HEXStore
from kvcore.testing import CompressorTests, ScorerTests, SelectorTests, StoreTests


class TestAccumulatedAttentionScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return AccumulatedAttentionScorer()


class TestAccumulatedAttentionScorerPerHead(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return AccumulatedAttentionScorer(global_heads=False)


class TestHEXSelector(SelectorTests):
    """Heavy hitters at 25 %, no recent window and blocks of 1 (no residual), so the suite's score-order checks
    see HEX's tiers; the recent window and the residual are tested in test_selector.py."""

    @pytest.fixture
    def selector(self):
        return HEXSelector(bits=3, heavy_ratio=0.25, recent=0, block_size=1)


class TestHEXStoreShortBlocks(StoreTests):
    """Blocks of 4 tokens with a dense overlay (rho 0.25) and per-head values, so writes code entries with the
    overlay and appends compress full blocks (appended entries are then quantized: ``lossless_append = False``)."""

    lossless_append = False

    @pytest.fixture
    def store_factory(self):
        return lambda: HEXStore(HEXConfig(bits=3, rho=0.25, block_size=4, value_scope="head", recent=1))


class TestHEXStoreHeadMasks(StoreTests):
    """HEX-4 with one (n, d_h) mask shared by every head and per-head value groups. Value groups across KV heads
    (the default) and full mode are checked in test_store.py: their error bound involves other heads' entries (and,
    in full mode, a second quantization of the held reconstruction), which the suite's per-head bound cannot see."""

    lossless_append = False

    @pytest.fixture
    def store_factory(self):
        return lambda: HEXStore(
            HEXConfig(bits=4, rho=0.25, block_size=4, value_scope="head", mask_scope="head", heavy_ratio=0.25)
        )


class TestHEXStorePaperBlocks(StoreTests):
    """The paper's blocks of 96 (per-head value groups, see above): the suite's short layers are compressed when
    the plan codes them, and appends stay in the fp16 residual, so they are lossless."""

    @pytest.fixture
    def store_factory(self):
        return lambda: HEXStore(HEXConfig(bits=3, value_scope="head"))


class TestHEXCompressor(CompressorTests):
    """HEX-3 with blocks of 8 so the suite's layers are compressed (and a dense overlay)."""

    evicts = False
    lossless_at_zero_ratio = False

    @pytest.fixture
    def compressor(self):
        return kv_hex.hex(3, block_size=8, rho=0.125)


class TestKCVTCompressor(CompressorTests):
    evicts = False
    lossless_at_zero_ratio = False

    @pytest.fixture
    def compressor(self):
        return kv_hex.kcvt(3, block_size=8)


class TestRandomMaskCompressor(CompressorTests):
    evicts = False
    lossless_at_zero_ratio = False

    @pytest.fixture
    def compressor(self):
        return kv_hex.random_mask(4, block_size=8, rho=0.125)
