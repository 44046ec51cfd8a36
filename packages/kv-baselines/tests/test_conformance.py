"""Every baseline scorer and ready-made eviction compressor adopts the kvcore conformance suites."""

import pytest

import kv_baselines as kb
from kvcore.testing import CompressorTests, ScorerTests


class TestRandomScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.RandomScorer(seed=1)


class TestKnormScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.KnormScorer()


class TestStreamingLLMScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.StreamingLLMScorer()


class TestSnapKVScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.SnapKVScorer(window=4)


class TestH2OScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.H2OScorer()


class TestConstantScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.ConstantScorer()


class TestKnormCompressor(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return kb.knorm(0.5)


class TestStreamingLLMCompressor(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return kb.streaming_llm(0.5, n_sink=1)


class TestSnapKVCompressor(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return kb.snapkv(0.5, window=1)


class TestH2OCompressor(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return kb.h2o(0.5)


class TestFullCompressor(CompressorTests):
    evicts = False

    @pytest.fixture
    def compressor(self):
        return kb.full()


class TestChunkKVScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return kb.ChunkKVScorer(kb.SnapKVScorer(window=4), chunk=3)


class TestChunkKVCompressor(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return kb.chunkkv(0.5, chunk=3, window=1)
