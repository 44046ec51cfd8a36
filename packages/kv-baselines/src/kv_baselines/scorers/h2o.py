"""H2O: heavy hitters by cumulative attention (Zhang et al. 2023, "H2O", §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kv_baselines.scorers._attention import window_attention
from kvcore import Scorer, Scores, ScoringContext


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """Attention each key received, summed over the supplied queries (all prompt queries by default).

    GQA groups are aggregated by the mean. With a shorter query window the sum runs over that window.
    Keys later in the prompt are seen by fewer queries; ``normalize=True`` divides by the number of queries
    that could attend to each key (an option, off by default as in the paper).

    Parameters
    ----------
    query_window : int or None
        Queries the adapter supplies: ``None`` = every prompt query (the paper's accumulation).
    normalize : bool
        Divide by the count of queries that see each key.

    Notes
    -----
    Chunkable as an approximation: under chunked prefill each step scores the held entries plus the new chunk
    with the new chunk's queries only, so a key's score is the attention it received from the latest chunk,
    not the sum over every query since it was written (keys that are evicted never come back, as in the
    paper's online eviction, §3.2).
    """

    query_window: int | None = None
    normalize: bool = False
    needs_queries: ClassVar[bool] = True
    chunkable: ClassVar[bool] = True

    def score(self, ctx: ScoringContext) -> Scores:
        if ctx.queries is None:
            raise ValueError("H2OScorer needs ctx.queries ([B, Hq, W, D])")
        B, Hq, W, _ = ctx.queries.shape
        T = ctx.seq_len
        total = torch.zeros(B, ctx.num_kv_heads, T, device=ctx.keys.device)
        for probs in window_attention(ctx):
            total += probs.sum(dim=(2, 3))
        total /= Hq // ctx.num_kv_heads
        if self.normalize:
            seen = (T - torch.arange(T, device=total.device)).clamp(max=W)  # window queries at or after key j
            total = total / seen
        return Scores(total.contiguous())
