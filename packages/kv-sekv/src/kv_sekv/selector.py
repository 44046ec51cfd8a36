"""The SEKV selector: surprisal segmentation under the budget rule (SEKV §3.1–3.3; see :mod:`kv_sekv.segmentation`).

A threshold, not a top-k: anchors, short spans and the window are kept at full precision; span tokens are kept as
a coarse entry plus CPU low-rank bases (``span_id >= 0`` in the returned :class:`~kv_sekv.SpanPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcore import EVICT, FULL, Budget, Plan, Scores, Selector

from .config import SEKVConfig
from .plan import SpanPlan, SpanScoresInfo
from .router import RouterSource
from .scorer import SurprisalScores
from .segmentation import Segmentation, fit_segmentation
from .summaries import span_weights

__all__ = ["SpanSelector"]


@dataclass
class SpanSelector(Selector):
    """Segment every row of a batch and return a :class:`~kv_sekv.SpanPlan`.

    Parameters
    ----------
    config : SEKVConfig
        α, ``L_min``, ``w`` and ``window_share``.
    strict : bool
        Apply α and w literally and report the budget used (``SpanPlan.used``); the default raises α per row until
        the always-resident part fits the budget (:func:`~kv_sekv.segmentation.fit_segmentation`).
    router : RouterSource, optional
        Gives the routing summaries' accelerator cost per span (``group · d′ / (2 d_h)``); ``None`` counts them as 0.
    """

    config: SEKVConfig = field(default_factory=SEKVConfig)
    strict: bool = False
    router: RouterSource | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, SEKVConfig):
            raise TypeError(f"config must be a kv_sekv.SEKVConfig, got {type(self.config).__name__}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be a bool, got {type(self.strict).__name__}")

    def segment(self, h: torch.Tensor, **options) -> Segmentation:
        """Segment one row's real tokens (``options`` of :func:`~kv_sekv.segmentation.fit_segmentation`); the
        entropy-guided rule of §3.1 here, overridden by the Table 5 ablations (:mod:`kv_sekv.ablations`)."""
        return fit_segmentation(h, **options)

    def weights(self, h: torch.Tensor, span_id: torch.Tensor) -> torch.Tensor:
        """Per-token weights of the coarse entries and summaries: Eq. 2's surprisal weights here."""
        return span_weights(h, span_id)

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        if not isinstance(scores, Scores):
            raise TypeError(f"scores must be kvcore.Scores (from SurprisalScorer), got {type(scores).__name__}")
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a kvcore.Budget, got {type(budget).__name__}")
        for name, mask in (("protected", protected), ("valid", valid)):
            if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
                got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise TypeError(f"{name} must be a bool tensor, got {got}")
        if budget.avg_bits is not None or budget.granularity == "global":
            raise ValueError(
                "SpanSelector takes a 'head' or 'layer' budget by ratio or tokens (no avg_bits, no global)"
            )
        if scores.keys.ndim != 3:
            raise ValueError("SpanSelector needs Scores [B, Hkv, T] (the surprisal, from SurprisalScorer)")
        info = scores.info if isinstance(scores, SurprisalScores) else SpanScoresInfo()
        B, H, T = scores.keys.shape
        device = scores.keys.device
        valid = torch.ones(B, T, dtype=torch.bool, device=device) if valid is None else valid.to(device).bool()
        if protected is not None and protected.ndim == 3:
            protected = protected.any(1)
        h = scores.keys[:, 0].float()
        summary_cost = 0.0
        if self.router is not None:
            summary_cost = self.router.resolve(H, info.head_dim or None).summary_cost(H, info.head_dim)
        span_id = torch.full((B, T), -1, dtype=torch.long, device=device)
        weights = torch.zeros(B, T, dtype=torch.float32, device=device)
        alpha, used, capacity = torch.zeros(B), torch.zeros(B), torch.zeros(B, dtype=torch.long)
        ratio = 0.0 if budget.ratio is None else budget.ratio
        for b in range(B):
            idx = valid[b].nonzero()[:, 0]
            n = idx.numel()
            if n == 0:
                continue
            cap = budget.kept(n)
            forced = None if protected is None else protected[b, idx].to(device)
            seg = self.segment(
                h[b, idx],
                alpha=self.config.alpha,
                min_span=self.config.min_span,
                window=self.config.window,
                capacity=cap,
                summary_cost=summary_cost,
                strict=self.strict,
                window_share=self.config.window_share,
                zoom_share=self.config.zoom_share,
                forced=forced,
                max_span=self.config.max_span,
            )
            span_id[b, idx] = seg.span_id
            weights[b, idx] = self.weights(h[b, idx], seg.span_id)
            alpha[b], used[b], capacity[b] = seg.alpha, seg.used, cap
        bits = torch.where(valid, FULL, EVICT).to(torch.uint8)[:, None, :].expand(B, H, T).contiguous()
        return SpanPlan(
            bits,
            span_id=span_id,
            weights=weights,
            layer=info.layer,
            alpha=alpha,
            used=used,
            capacity=capacity,
            budget=1.0 - ratio if budget.tokens is None else 1.0,
        )
