"""kv_baselines: the baselines users compare against, as kvcore protocol objects and ready-made compressors.

Scorers: Random, Knorm, StreamingLLM, SnapKV, ChunkKV (whole chunks over a base scorer), H2O, KVzip (its scores
come from an adapter's reconstruction pass).
Quantizers: uniform asymmetric min-max (1/2/3/4/8 bits, per-channel or per-token groups, KIVI).
Store: KIVI's quantized store with a full-precision residual.
"""

from kv_baselines.compressors import chunkkv, full, h2o, kivi, knorm, kvzip, random, snapkv, snapkv_kivi, streaming_llm
from kv_baselines.quant import KIVIStore, KIVITierSelector, UniformQuantizer
from kv_baselines.scorers import (
    ChunkKVScorer,
    ConstantScorer,
    H2OScorer,
    KnormScorer,
    KVzipScorer,
    RandomScorer,
    SnapKVScorer,
    StreamingLLMScorer,
)

__all__ = [
    "ChunkKVScorer",
    "ConstantScorer",
    "H2OScorer",
    "KIVIStore",
    "KIVITierSelector",
    "KVzipScorer",
    "KnormScorer",
    "RandomScorer",
    "SnapKVScorer",
    "StreamingLLMScorer",
    "UniformQuantizer",
    "chunkkv",
    "full",
    "h2o",
    "kivi",
    "knorm",
    "kvzip",
    "random",
    "snapkv",
    "snapkv_kivi",
    "streaming_llm",
]
