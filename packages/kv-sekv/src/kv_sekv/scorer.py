"""The SEKV scorer: token surprisal (SEKV §3.1, Eq. 1) read from the ``"surprisal"`` extra."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore import Scorer, Scores, ScoringContext

from .plan import SpanScoresInfo

__all__ = ["SurprisalScorer", "SurprisalScores"]


@dataclass(frozen=True)
class SurprisalScores(Scores):
    """Scores holding the surprisal of every token (broadcast over KV heads) and the layer / head dim."""

    info: SpanScoresInfo = field(default_factory=SpanScoresInfo)


class SurprisalScorer(Scorer):
    """Surprisal ``H_t = −log p(x_t | x_<t)`` of the served model, from ``ctx.extras["surprisal"]``.

    The extra is ``[B, T]`` (or ``[B, Hkv, T]``, averaged over heads: one segmentation serves every head, §3.1),
    aligned with the context's tokens, non-negative and finite. An adapter computes it from the prefill's own
    logits (``kv_hf`` registers the ``"surprisal"`` provider). The score is the surprisal itself: high = boundary.
    """

    needs_extras: ClassVar[frozenset[str]] = frozenset({"surprisal"})

    def score(self, ctx: ScoringContext) -> SurprisalScores:
        if "surprisal" not in ctx.extras:
            raise ValueError("SurprisalScorer needs ctx.extras['surprisal'] ([B, T] token surprisal)")
        h = ctx.extras["surprisal"]
        B, H, T, D = ctx.keys.shape
        if not isinstance(h, torch.Tensor) or not (h.is_floating_point()):
            raise TypeError("extras['surprisal'] must be a float tensor [B, T]")
        if h.ndim == 3 and tuple(h.shape) == (B, H, T):
            h = h.float().mean(1)
        if tuple(h.shape) != (B, T):
            raise ValueError(f"extras['surprisal'] must be [B={B}, T={T}] (or [B, Hkv, T]), got {tuple(h.shape)}")
        h = h.float().to(ctx.keys.device)
        valid = ctx.valid
        if not bool(torch.isfinite(h[valid]).all()):
            raise ValueError("extras['surprisal'] holds NaN or inf on real tokens")
        if bool((h[valid] < -1e-4).any()):
            raise ValueError("extras['surprisal'] must be >= 0 (a negative log-probability)")
        h = torch.where(valid, h.clamp_min(0.0), 0.0)
        return SurprisalScores(
            h[:, None, :].expand(B, H, T).contiguous(), info=SpanScoresInfo(layer=int(ctx.layer_idx), head_dim=D)
        )
