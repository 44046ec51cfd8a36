"""kv_sekv — SEKV: surprisal-segmented KV cache with accelerator-resident span summaries, CPU low-rank span bases
and a trained zoom-in router.

Main entry points
-----------------
sekv                        the ready-made compressor (a ``kvcore.Compressor``)
SEKVConfig                  validated hyper-parameters (paper defaults)
SurprisalScorer, SpanSelector, SEKVStore   the protocol objects (scorer, selector, store)
SpanPlan                    the selector's plan (segmentation + budget report)
SEKVRouter                  W, τ and g_φ; safetensors + JSON artifact; ``SEKVRouter.untrained(...)`` for tests
surprisal_from_hidden       chunked-vocabulary surprisal (Eq. 1)
fit_segmentation, segment   the segmentation and its budget rule
"""

from .ablations import (
    FixedSpanSelector,
    GlobalThresholdRouter,
    MeanPoolingSelector,
    UntrainedRouter,
    sekv_fixed_spans,
    sekv_global_threshold,
    sekv_mean_pooling,
    sekv_no_svd,
    sekv_untrained,
)
from .bases import SpanBasis, reconstruction_error, truncated_svd
from .compressor import sekv
from .config import SEKVConfig
from .plan import SpanPlan
from .router import GateNet, RouterSource, SEKVRouter, ShippedRouter, shipped_routers
from .scorer import SurprisalScorer, SurprisalScores
from .segmentation import Segmentation, fit_segmentation, segment
from .selector import SpanSelector
from .store import SEKVStore, StepStats
from .summaries import coarse_entries, routing_summaries, span_weights
from .surprisal import surprisal_from_hidden, surprisal_from_logits

__all__ = [
    "FixedSpanSelector",
    "GateNet",
    "GlobalThresholdRouter",
    "MeanPoolingSelector",
    "RouterSource",
    "SEKVConfig",
    "SEKVRouter",
    "SEKVStore",
    "Segmentation",
    "ShippedRouter",
    "SpanBasis",
    "SpanPlan",
    "SpanSelector",
    "StepStats",
    "SurprisalScorer",
    "SurprisalScores",
    "UntrainedRouter",
    "coarse_entries",
    "fit_segmentation",
    "reconstruction_error",
    "routing_summaries",
    "segment",
    "sekv",
    "sekv_fixed_spans",
    "sekv_global_threshold",
    "sekv_mean_pooling",
    "sekv_no_svd",
    "sekv_untrained",
    "shipped_routers",
    "span_weights",
    "surprisal_from_hidden",
    "surprisal_from_logits",
    "truncated_svd",
]
