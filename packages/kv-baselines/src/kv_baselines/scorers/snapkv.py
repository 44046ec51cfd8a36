"""SnapKV: observation-window attention, average-pooled (Li et al. 2024, "SnapKV", §4.2; kvpress SnapKVPress)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kv_baselines.scorers._attention import window_attention
from kvcore import Scorer, Scores, ScoringContext
from kvcore.checks import check_int


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """Mean attention of the last ``window`` queries on every key, smoothed by a 1-D pool (average by default).

    GQA groups are aggregated by the mean over the group's query heads, after pooling (as kvpress does). Window
    tokens themselves get the maximum score (SnapKV always keeps the observation window; the ready-made
    compressor also protects it).

    Parameters
    ----------
    window : int
        Observation window ``W`` (64 in SnapKV / kvpress).
    kernel_size : int
        Pooling kernel (5 in kvpress and the SnapKV code; odd).
    pooling : {"avg", "max"}
        1-D pooling of the window attention: ``"avg"`` (kvpress, SnapKV's default) or ``"max"`` (the SnapKV
        code's other option, used by KVCache-Factory with kernel 7). Pooling keeps whole runs of tokens around
        an attended one (SnapKV §4.2, "clustering via pooling").

    Notes
    -----
    Chunkable as an explicit approximation: under chunked prefill the observation window is the last ``window``
    queries of the latest chunk (SnapKV §4.2 takes it at the end of the whole prompt), and the held entries plus
    the new chunk are re-scored with it at every step; only the final step sees the prompt's true window.
    """

    window: int = 64
    kernel_size: int = 5
    pooling: str = "avg"
    needs_queries: ClassVar[bool] = True
    chunkable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("window", self.window, low=1)
        if check_int("kernel_size", self.kernel_size, low=1) % 2 == 0:
            raise ValueError(f"kernel_size must be odd and >= 1, got {self.kernel_size}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")

    @property
    def query_window(self) -> int:
        """Number of trailing prompt queries the adapter must supply."""
        return self.window

    def score(self, ctx: ScoringContext) -> Scores:
        if ctx.queries is None:
            raise ValueError("SnapKVScorer needs ctx.queries ([B, Hq, W, D])")
        W = min(ctx.queries.shape[2], ctx.seq_len)
        T = ctx.seq_len
        group = ctx.queries.shape[1] // ctx.num_kv_heads
        total = torch.zeros(ctx.batch_size, ctx.num_kv_heads, group, T, device=ctx.keys.device)
        for probs in window_attention(dataclasses.replace(ctx, queries=ctx.queries[:, :, -W:])):
            total += probs.sum(dim=3)
        flat = (total / W).flatten(0, 2)[:, None]  # per query head: pool, then the GQA mean (kvpress order)
        if self.pooling == "max":
            pooled = F.max_pool1d(flat, self.kernel_size, 1, self.kernel_size // 2)
        else:
            pooled = F.avg_pool1d(flat, self.kernel_size, 1, self.kernel_size // 2, count_include_pad=False)
        pooled = pooled.view_as(total).mean(2)
        top = pooled.amax(-1, keepdim=True)
        window = torch.arange(T, device=pooled.device) >= T - W
        return Scores(torch.where(window, top, pooled).contiguous())
