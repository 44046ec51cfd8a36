"""kv_hf: plug any kvcore ``Compressor`` into a transformers (>= 5.17) causal LM's KV cache.

>>> cache = kv_hf.compressed_cache(model, compressor)            # a transformers Cache (layered API)
>>> out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
>>> cache.nbytes()                                               # bytes the Stores really hold

Importing this package registers the ``"kv_hf"`` / ``"kv_hf_eager"`` attention functions with transformers.
"""

from kv_hf import surprisal  # registers the "surprisal" extras provider
from kv_hf.attention import disable_attention, enable_attention, register_attention
from kv_hf.cache import CompressedCache, compressed_cache
from kv_hf.implementations import KV_HF_EAGER, KV_HF_SDPA
from kv_hf.layer import CompressedLayer
from kv_hf.options import CacheOptions
from kv_hf.prefill import prefill
from kv_hf.providers import PROVIDERS, Provider
from kv_hf.reconstruction import KVzipConfig, kvzip_scores  # registers the "kvzip_scores" extras provider
from kv_hf.reuse import answer_questions, generate_answer
from kv_hf.shared import CollectedPrefill, collect_prefill
from kv_hf.support import SUPPORTED_MODEL_TYPES, check_model

register_attention()

__version__ = "0.1.0"

__all__ = [
    "KV_HF_EAGER",
    "KV_HF_SDPA",
    "PROVIDERS",
    "SUPPORTED_MODEL_TYPES",
    "CacheOptions",
    "CollectedPrefill",
    "CompressedCache",
    "CompressedLayer",
    "KVzipConfig",
    "Provider",
    "answer_questions",
    "check_model",
    "collect_prefill",
    "compressed_cache",
    "disable_attention",
    "enable_attention",
    "generate_answer",
    "kvzip_scores",
    "prefill",
    "register_attention",
    "surprisal",
]
