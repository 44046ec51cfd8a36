"""Query-free baseline scorers: constant, random, key norm, StreamingLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore import Scorer, Scores, ScoringContext
from kvcore.checks import check_int


@dataclass(frozen=True)
class ConstantScorer(Scorer):
    """Every entry scores 0: with ties broken by lower index, a budget keeps the earliest tokens. Used by
    ``full()`` and quantization-only methods, where the budget keeps everything. Chunkable (position-only)."""

    chunkable: ClassVar[bool] = True

    def score(self, ctx: ScoringContext) -> Scores:
        return Scores(torch.zeros(ctx.batch_size, ctx.num_kv_heads, ctx.seq_len, device=ctx.keys.device))


@dataclass(frozen=True)
class RandomScorer(Scorer):
    """Uniform random scores, deterministic per ``(seed, layer_idx)`` (kvpress RandomPress). Chunkable: each
    chunk step draws fresh scores for what is held (still uniform)."""

    seed: int = 0
    chunkable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("seed", self.seed, low=0)

    def score(self, ctx: ScoringContext) -> Scores:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + ctx.layer_idx)
        s = torch.rand(ctx.batch_size, ctx.num_kv_heads, ctx.seq_len, generator=gen)
        return Scores(s.to(ctx.keys.device))


@dataclass(frozen=True)
class KnormScorer(Scorer):
    """``-‖k‖₂``: keys with small norms draw the most attention (Devoto et al. 2024, "A Simple and Effective
    L2 Norm-Based Strategy for KV Cache Compression", §3; kvpress KnormPress). Key-only, hence chunkable: chunked
    compression keeps exactly what one-shot compression keeps."""

    chunkable: ClassVar[bool] = True

    def score(self, ctx: ScoringContext) -> Scores:
        return Scores(-ctx.keys.float().norm(dim=-1))


@dataclass(frozen=True)
class StreamingLLMScorer(Scorer):
    """Attention sinks plus the most recent tokens (Xiao et al. 2024, "StreamingLLM", §3.2).

    The first ``n_sink`` real tokens score 2; every other real token scores ``rank / n`` (later = higher), so
    any budget keeps the sinks and then the most recent tokens.

    Parameters
    ----------
    n_sink : int
        Attention sinks kept (4 in the paper).
    """

    n_sink: int = 4
    chunkable: ClassVar[bool] = True  # position-only: chunked compression keeps what one-shot keeps

    def __post_init__(self) -> None:
        check_int("n_sink", self.n_sink, low=0)

    def score(self, ctx: ScoringContext) -> Scores:
        valid = ctx.valid
        rank = (valid.long().cumsum(-1) - 1).float()
        n = valid.sum(-1, keepdim=True).clamp(min=1).float()
        s = torch.where(rank < self.n_sink, 2.0, rank / n)
        return Scores(s[:, None, :].expand(-1, ctx.num_kv_heads, -1).contiguous())
