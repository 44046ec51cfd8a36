"""SentenceKV (Zhu et al. 2025, arXiv:2504.00970) on kvcore's protocols: punctuation sentences, SnapKV prefill
eviction, and per-step retrieval of the sentences whose mean key best matches the query."""

from kv_baselines.sentence.plan import SentencePlan, SentenceScores
from kv_baselines.sentence.scorer import SENTENCE_EXTRA, SentenceKVScorer
from kv_baselines.sentence.segmentation import PUNCTUATION, is_sentence_end, sentence_ids
from kv_baselines.sentence.selector import SentenceSelector
from kv_baselines.sentence.store import SentenceKVStore

__all__ = [
    "PUNCTUATION",
    "SENTENCE_EXTRA",
    "SentenceKVScorer",
    "SentenceKVStore",
    "SentencePlan",
    "SentenceScores",
    "SentenceSelector",
    "is_sentence_end",
    "sentence_ids",
]
