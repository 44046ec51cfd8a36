"""ChunkKV: keep whole chunks of consecutive tokens (Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache
Compression for Efficient Long-Context LLM Inference", §3; kvpress ChunkKVPress)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kv_baselines.scorers.snapkv import SnapKVScorer
from kvcore import Scorer, Scores, ScoringContext, WrappingScorer
from kvcore.checks import check_int


@dataclass(frozen=True)
class ChunkKVScorer(WrappingScorer):
    """Chunk importance from a base scorer: every token scores its chunk's importance, for every KV head.

    The sequence is cut into chunks of ``chunk`` consecutive tokens from its first index (the last one may be
    shorter). A chunk's importance is the mean over its tokens of the base score summed over KV heads (ChunkKV §3,
    Alg. 1: observation-window attention aggregated per chunk; kvpress sums over heads and averages over the
    chunk); every token of the chunk, in every head, gets that value. A top-k selector then keeps whole chunks, the
    same ones in every head, except one partly kept chunk where the budget ends mid-chunk.

    Protected entries (``ctx.protected``: SnapKV's observation window, kept anyway) and padding are left out of
    the chunk means, so a chunk that overlaps the window is ranked by its other tokens; a chunk with none scores 0.

    Parameters
    ----------
    base : kvcore.Scorer
        Token importance (the paper uses SnapKV's observation-window attention). What it reads is what this
        scorer reads (:class:`kvcore.WrappingScorer`).
    chunk : int
        Chunk length in tokens: 10, the paper's default (kvpress defaults to 20).
    """

    base: Scorer = dataclasses.field(default_factory=SnapKVScorer)
    chunk: int = 10
    chunkable: ClassVar[bool] = False  # chunk boundaries and the head sum span the whole prompt

    def __post_init__(self) -> None:
        self.check_base()
        check_int("chunk", self.chunk, low=1)

    def score(self, ctx: ScoringContext) -> Scores:
        """Chunk importance per token, float32 ``[B, Hkv, T]`` (the same in every head)."""
        base = self.base.score(ctx).keys.float()
        B, H, T = base.shape
        counted = ctx.valid if ctx.protected is None else ctx.valid & ~ctx.protected.expand(B, T)
        weight = counted.to(base.dtype)  # [B, T]
        total = (base * weight[:, None]).sum(1)  # [B, T]: summed over KV heads, protected and padding left out
        n = -(-T // self.chunk)
        pad = n * self.chunk - T
        sums = torch.nn.functional.pad(total, (0, pad)).view(B, n, self.chunk).sum(-1)
        counts = torch.nn.functional.pad(weight, (0, pad)).view(B, n, self.chunk).sum(-1)
        means = torch.where(counts > 0, sums / counts.clamp(min=1.0), torch.zeros_like(sums))
        per_token = means.repeat_interleave(self.chunk, dim=1)[:, :T]
        return Scores(per_token[:, None, :].expand(B, H, T).contiguous())
