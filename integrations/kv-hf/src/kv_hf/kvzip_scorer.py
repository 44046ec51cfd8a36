"""KVzip as a kvcore Scorer: importance from a context-reconstruction pass the adapter runs.

Based on KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv:2505.23416; snu-mllab/KVzip ``attention/score.py``, kvpress ``kvzip_press.py``; anchors.md §4). The scores
need model forward passes, which only an engine adapter can run, so the scorer itself only reads
``ctx.extras["kvzip_scores"]``; :func:`kv_hf.prefill` (:mod:`kv_hf.reconstruction`) supplies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from kvcore import Budget, Compressor, DenseStore, Scorer, Scores, ScoringContext, TopKSelector

KVZIP_EXTRA = "kvzip_scores"


@dataclass(frozen=True)
class KVzipScorer(Scorer):
    """Scores = ``ctx.extras["kvzip_scores"]``: per context key, the max over the GQA group and over the
    reconstruction queries of the softmax attention it receives (``[B, Hkv, T]``; higher = keep)."""

    needs_extras: ClassVar[frozenset[str]] = frozenset({KVZIP_EXTRA})

    def score(self, ctx: ScoringContext) -> Scores:
        if KVZIP_EXTRA not in ctx.extras:
            raise ValueError(
                f"KVzipScorer needs ctx.extras[{KVZIP_EXTRA!r}]; with transformers run "
                "kv_hf.prefill(model, cache, ids, tokenizer=...) which computes them"
            )
        s = ctx.extras[KVZIP_EXTRA]
        expect = (ctx.batch_size, ctx.num_kv_heads, ctx.seq_len)
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != expect:
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"extras[{KVZIP_EXTRA!r}] must be a tensor of shape {expect} ([B, Hkv, T]), got {got}")
        s = s.to(device=ctx.keys.device, dtype=torch.float32)
        if not bool(torch.isfinite(s[ctx.valid[:, None, :].expand(expect)]).all()):
            raise ValueError(f"extras[{KVZIP_EXTRA!r}] must be finite on real tokens")
        return Scores(torch.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0))


def kvzip(ratio: float = 0.5, granularity: str = "global", store=DenseStore) -> Compressor:
    """A ready-made KVzip compressor: :class:`KVzipScorer` + top-k without per-head floor + a dense store.

    Parameters
    ----------
    ratio : float
        Fraction of the context entries removed (kvpress convention; the original repo's ``ratio`` is kept).
    granularity : {"global", "layer", "head"}
        ``"global"`` = KVzip's default "pair" threshold over all layers and heads; ``"head"`` = ``pair_uniform``.
    store : Store or callable
        Per-layer store factory or prototype.
    """
    return Compressor(
        scorer=KVzipScorer(),
        selector=TopKSelector(head_floor=0.0),
        store=store,
        budget=Budget(ratio=ratio, granularity=granularity),
        name="kvzip",
    )
