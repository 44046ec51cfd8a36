"""kv_baselines: the baselines users compare against, as kvcore protocol objects and ready-made compressors.

Scorers: Random, Knorm, StreamingLLM, SnapKV, ChunkKV (whole chunks over a base scorer), H2O, KVzip (its scores
come from an adapter's reconstruction pass), FastKVzip (a trained gate predicting KVzip's scores from each entry's
key and value), Expected Attention (RoPE-rotated query statistics).
Selectors: PyramidKV's per-layer budgets.
SentenceKV: punctuation sentences, SnapKV prefill, per-step sentence retrieval (scorer, selector, store).
Quantizers: uniform asymmetric min-max (1/2/3/4/8 bits, per-channel or per-token groups, KIVI).
Store: KIVI's quantized store with a full-precision residual.
"""

from kv_baselines.compressors import (
    chunkkv,
    expected_attention,
    fastkvzip,
    full,
    h2o,
    kivi,
    knorm,
    kvzip,
    pyramidkv,
    random,
    sentencekv,
    snapkv,
    snapkv_kivi,
    streaming_llm,
)
from kv_baselines.quant import KIVIStore, KIVITierSelector, UniformQuantizer
from kv_baselines.scorers import (
    ChunkKVScorer,
    ConstantScorer,
    ExpectedAttentionScorer,
    FastKVzipConfig,
    FastKVzipGate,
    FastKVzipScorer,
    H2OScorer,
    KnormScorer,
    KVzipScorer,
    RandomScorer,
    SnapKVScorer,
    StreamingLLMScorer,
)
from kv_baselines.selectors import PyramidSelector
from kv_baselines.sentence import SentenceKVScorer, SentenceKVStore, SentenceSelector

__all__ = [
    "ChunkKVScorer",
    "ConstantScorer",
    "ExpectedAttentionScorer",
    "FastKVzipConfig",
    "FastKVzipGate",
    "FastKVzipScorer",
    "H2OScorer",
    "KIVIStore",
    "KIVITierSelector",
    "KVzipScorer",
    "KnormScorer",
    "PyramidSelector",
    "RandomScorer",
    "SentenceKVScorer",
    "SentenceKVStore",
    "SentenceSelector",
    "SnapKVScorer",
    "StreamingLLMScorer",
    "UniformQuantizer",
    "chunkkv",
    "expected_attention",
    "fastkvzip",
    "full",
    "h2o",
    "kivi",
    "knorm",
    "kvzip",
    "pyramidkv",
    "random",
    "sentencekv",
    "snapkv",
    "snapkv_kivi",
    "streaming_llm",
]
