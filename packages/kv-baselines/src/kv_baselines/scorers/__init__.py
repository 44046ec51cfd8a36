"""Baseline scorers."""

from kv_baselines.scorers.chunkkv import ChunkKVScorer
from kv_baselines.scorers.expected_attention import ROPE_EXTRA, ExpectedAttentionScorer
from kv_baselines.scorers.fastkvzip import FastKVzipConfig, FastKVzipGate, FastKVzipScorer
from kv_baselines.scorers.h2o import H2OScorer
from kv_baselines.scorers.kvzip import KVZIP_EXTRA, KVzipScorer
from kv_baselines.scorers.simple import ConstantScorer, KnormScorer, RandomScorer, StreamingLLMScorer
from kv_baselines.scorers.snapkv import SnapKVScorer

__all__ = [
    "KVZIP_EXTRA",
    "ROPE_EXTRA",
    "ChunkKVScorer",
    "ConstantScorer",
    "ExpectedAttentionScorer",
    "FastKVzipConfig",
    "FastKVzipGate",
    "FastKVzipScorer",
    "H2OScorer",
    "KVzipScorer",
    "KnormScorer",
    "RandomScorer",
    "SnapKVScorer",
    "StreamingLLMScorer",
]
