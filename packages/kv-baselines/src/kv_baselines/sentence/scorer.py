"""SentenceKV's prefill scores: SnapKV's observation-window attention, carrying the prompt's sentences along."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kv_baselines.scorers.snapkv import SnapKVScorer
from kv_baselines.sentence.plan import SentenceScores
from kvcore import Scorer, ScoringContext, WrappingScorer

SENTENCE_EXTRA = "sentence_ids"
"""``ctx.extras`` key of the prompt's sentence index per token (``[B, T]`` integers, non-decreasing per row)."""


def _window() -> SnapKVScorer:
    return SnapKVScorer(window=32, kernel_size=7, pooling="max")


@dataclass(frozen=True)
class SentenceKVScorer(WrappingScorer):
    """The base scorer's scores as :class:`SentenceScores`, with ``ctx.extras["sentence_ids"]`` attached.

    SentenceKV's prefill (Zhu et al. 2025, §3, prefilling stage; the authors' ``custom_llama_sentencekv.py``) keeps
    the entries SnapKV ranks highest, with a 32-query observation window and max pooling of width 7, and remembers
    which sentence every kept token belongs to; the sentences travel to :class:`SentenceKVStore` through the selector's
    :class:`SentencePlan`.

    Parameters
    ----------
    base : kvcore.Scorer
        Token importance (default ``SnapKVScorer(window=32, kernel_size=7, pooling="max")``, the authors' code).
    """

    base: Scorer = dataclasses.field(default_factory=_window)
    chunkable: ClassVar[bool] = False  # the sentence ids are the whole prompt's

    def __post_init__(self) -> None:
        self.check_base()

    @property
    def needs_extras(self) -> frozenset[str]:
        return frozenset(self.base.needs_extras) | {SENTENCE_EXTRA}

    def score(self, ctx: ScoringContext) -> SentenceScores:
        if SENTENCE_EXTRA not in ctx.extras:
            raise ValueError(
                f"SentenceKVScorer needs ctx.extras[{SENTENCE_EXTRA!r}] ([B, T] sentence index per token); with "
                "transformers, kv_hf.prefill(..., tokenizer=...) supplies it from the punctuation tokens"
            )
        ids = ctx.extras[SENTENCE_EXTRA]
        B, T = ctx.batch_size, ctx.seq_len
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (B, T) or ids.dtype.is_floating_point:
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"extras[{SENTENCE_EXTRA!r}] must be an integer tensor [B={B}, T={T}], got {got}")
        ids = ids.to(device=ctx.keys.device, dtype=torch.int64)
        if bool((ids < 0).any()):
            raise ValueError(f"extras[{SENTENCE_EXTRA!r}] must be >= 0")
        s = self.base.score(ctx)
        return SentenceScores(s.keys, s.values, sentence_id=ids)
