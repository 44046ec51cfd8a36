"""HEX's heavy-hitter score: accumulated attention summed over all heads and queries (HEX §3.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kv_hex.kernels import dispatch
from kvcore import Scorer, Scores, ScoringContext

__all__ = ["AccumulatedAttentionScorer"]


@dataclass(frozen=True)
class AccumulatedAttentionScorer(Scorer):
    """``s_t = Σ_i Σ_q A^{(q)}_{i,t}``: the softmax probability token ``t`` receives, summed over every query head
    ``i`` and every prompt query ``q`` (HEX §3.3).

    HEX selects heavy hitters **globally across heads** ("Unlike the original H₂O, which selects heavy hitters
    separately per head…"), so with ``global_heads=True`` (default) the sum runs over all query heads of the layer
    and the same score is returned for every KV head: any per-head selector then picks one token set for all heads.
    ``global_heads=False`` keeps one sum per KV head (over its GQA group), H2O's per-head variant. The causal bias
    toward early tokens is kept (no normalization; spec A5). Padding scores 0.

    The column sums are computed query-chunk by query-chunk (:func:`kv_hex.kernels.attention_column_sums`), never
    materializing the ``T × T`` attention matrix.

    Parameters
    ----------
    global_heads : bool, default True
        Sum over all heads (HEX) or per KV head (H2O).
    """

    global_heads: bool = True
    needs_queries: ClassVar[bool] = True
    query_window: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        if not isinstance(self.global_heads, bool):
            raise TypeError(f"global_heads must be a bool, got {type(self.global_heads).__name__}")

    def score(self, ctx: ScoringContext) -> Scores:
        """Float32 ``[B, Hkv, T]`` accumulated attention (identical across KV heads when ``global_heads``)."""
        if ctx.queries is None:
            raise ValueError("AccumulatedAttentionScorer needs ctx.queries ([B, Hq, W, D], every prompt query)")
        if ctx.queries.shape[2] > ctx.seq_len:
            raise ValueError(f"queries window W={ctx.queries.shape[2]} is longer than the sequence T={ctx.seq_len}")
        D = ctx.keys.shape[-1]
        sums = dispatch.attention_column_sums(ctx.queries, ctx.keys, ctx.valid, 1.0 / math.sqrt(D))
        if self.global_heads:
            sums = sums.sum(1, keepdim=True).expand_as(sums)
        return Scores(sums.contiguous())
