"""The methods kv-hf registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`): methods
whose scores need the model itself.

``kvzip``: KVzip context-reconstruction scores (Kim et al. 2025, §3.2), query-agnostic, global top-k over layers
and heads (the paper's "pair" threshold); the budget's ratio / tokens are used at that global granularity.
"""

from __future__ import annotations

from kvcore import Budget, Compressor
from kvcore.registry import Method

from kv_hf.kvzip_scorer import kvzip

__all__ = ["METHODS"]


def _kvzip(budget: Budget) -> Compressor:
    return kvzip(0.0).with_budget(ratio=budget.ratio, tokens=budget.tokens, avg_bits=budget.avg_bits)


METHODS: tuple[Method, ...] = (
    Method("kvzip", _kvzip, "KVzip context-reconstruction scores, global top-k over layers and heads (needs kv_hf)"),
)
