"""The methods kv-baselines registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

Every factory takes a :class:`kvcore.Budget` and keeps the method's own granularity, protection, scorer and
store; only how much is kept (``ratio`` / ``tokens``) comes from the budget. Quantization-only KIVI takes a
ratio too: 0 gives plain KIVI (Liu et al. 2024, §3), a ratio above 0 (or a token budget) composes SnapKV
eviction with KIVI quantization of what is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kv_baselines import compressors as c
from kvcore import Budget, Compressor
from kvcore.registry import Method

__all__ = ["METHODS"]


def _at(comp: Compressor, budget: Budget) -> Compressor:
    """``comp`` keeping ``budget``'s ratio / tokens / avg bits at ``comp``'s own granularity."""
    return comp.with_budget(ratio=budget.ratio, tokens=budget.tokens, avg_bits=budget.avg_bits)


def _kivi(bits: int) -> Callable[[Budget], Compressor]:
    def make(budget: Budget) -> Compressor:
        if budget.tokens is None and not budget.ratio:
            return c.kivi(bits)
        return _at(c.snapkv_kivi(0.0, bits), budget)

    make.__name__ = f"kivi_{bits}"
    return make


METHODS: tuple[Method, ...] = (
    Method("full", lambda budget: c.full(), "the uncompressed cache: the reference", budgets=frozenset()),
    Method("random", lambda budget: _at(c.random(0.0), budget), "evict uniformly at random (kvpress RandomPress)"),
    Method("knorm", lambda budget: _at(c.knorm(0.0), budget), "evict the keys of largest L2 norm (Devoto et al. 2024)"),
    Method(
        "streaming_llm",
        lambda budget: _at(c.streaming_llm(0.0), budget),
        "4 attention sinks + the most recent tokens (StreamingLLM, Xiao et al. 2024)",
    ),
    Method(
        "snapkv",
        lambda budget: _at(c.snapkv(0.0), budget),
        "observation-window attention, 64 queries, avg-pool 5 (SnapKV, Li et al. 2024)",
    ),
    Method(
        "chunkkv",
        lambda budget: _at(c.chunkkv(0.0), budget),
        "whole 10-token chunks by SnapKV window attention, the same in every head (ChunkKV, Liu et al. 2025)",
    ),
    Method(
        "expected_attention",
        lambda budget: _at(c.expected_attention(0.0), budget),
        "expected attention of the next 512 queries (RoPE-rotated query statistics) x value norm, 4 sinks "
        "(Expected Attention, Devoto et al. 2025); needs the rope_inv_freq extra",
    ),
    Method(
        "pyramidkv",
        lambda budget: _at(c.pyramidkv(0.0), budget),
        "SnapKV window scores with per-layer budgets shrinking from the first layer to the last, beta 20, the "
        "same total (PyramidKV, Cai et al. 2024); a global budget",
    ),
    Method(
        "sentencekv",
        lambda budget: _at(c.sentencekv(0.0), budget),
        "SnapKV prefill eviction (window 32, max-pool 7), then each decode step attends to 32 sinks, 32 recent and "
        "the punctuation sentences whose mean key best matches the query, 1/5 of the held entries (SentenceKV, Zhu "
        "et al. 2025); needs the sentence_ids extra (a tokenizer)",
    ),
    Method(
        "h2o", lambda budget: _at(c.h2o(0.0), budget), "heavy hitters by cumulative attention (H2O, Zhang et al. 2023)"
    ),
    Method("kivi-4", _kivi(4), "KIVI 4-bit keys per channel / values per token; ratio > 0 adds SnapKV eviction"),
    Method("kivi-2", _kivi(2), "KIVI 2-bit keys per channel / values per token; ratio > 0 adds SnapKV eviction"),
    Method(
        "kvzip",
        lambda budget: _at(c.kvzip(0.0), budget),
        "KVzip context-reconstruction scores, global top-k (Kim et al. 2025); the adapter supplies the scores",
    ),
    Method(
        "kvzip-uniform",
        lambda budget: _at(dataclasses.replace(c.kvzip(0.0, granularity="head"), name="kvzip-uniform"), budget),
        "KVzip context-reconstruction scores, the same share kept in every layer and KV head (the KVzip repo's "
        "'pair-uniform' level); a layer cannot be starved by another's scores",
    ),
    Method(
        "fastkvzip",
        lambda budget: _at(c.fastkvzip(0.0), budget),
        "a trained sink-attention gate predicting KVzip's scores from each entry's key and value, no "
        "reconstruction pass, global top-k (Fast KVzip, Kim et al. 2026); the gate shipped for SmolLM2-135M",
    ),
)
