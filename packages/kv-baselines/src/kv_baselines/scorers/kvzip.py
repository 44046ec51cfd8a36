"""KVzip as a kvcore Scorer: importance from a context-reconstruction pass an engine adapter runs.

Based on KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv:2505.23416, §3.2; snu-mllab/KVzip ``attention/score.py``, kvpress ``kvzip_press.py``). The scores need model
forward passes, which only an engine adapter can run, so the scorer declares the extra ``"kvzip_scores"`` and only
reads it; with transformers, ``kv_hf.prefill`` runs the provider of that name (KVzip's reconstruction pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore import Scorer, Scores, ScoringContext

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
