"""SEKV's Table 5 component ablations (SEKV App. C), each :func:`kv_sekv.sekv` with one part replaced.

==========================  ============================  ==============================================================
Table 5 row                 here                          what changes
==========================  ============================  ==============================================================
w/o trained zoom-in         :func:`sekv_untrained`        :meth:`~kv_sekv.SEKVRouter.untrained` router of the shipped
                                                          shapes: fixed semi-orthogonal ``W``, ``τ = τ_init`` for
                                                          every head, every basis component kept
w/o SVD reconstruction      :func:`sekv_no_svd`           no CPU span bases, no span is ever expanded: spans are their
                                                          coarse entries only
w/o entropy segmentation    :func:`sekv_fixed_spans`      span boundaries evenly spaced instead of at surprisal peaks,
                                                          as many as fit the accelerator cost of SEKV's segmentation
                                                          of the row (same window)
fixed global threshold      :func:`sekv_global_threshold` the trained router with every head's ``τ`` replaced by their
                                                          mean over all layers and heads
mean pooling summary        :func:`sekv_mean_pooling`     uniform weights ``1/|S|`` in Eq. 2 instead of surprisal
                                                          weights (coarse entries and routing summaries)
==========================  ============================  ==============================================================

The paper retrains the router for each variant; these reuse the router trained for full SEKV (no retraining), so
they measure what each component contributes to that trained system. Everything not named (budget rule, cap,
two-stage decode) is SEKV's.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from kv_sekv.compressor import sekv
from kv_sekv.router import RouterSource, SEKVRouter, ShippedRouter
from kv_sekv.segmentation import Segmentation, fit_segmentation, runs_to_spans
from kv_sekv.selector import SpanSelector
from kv_sekv.summaries import span_weights
from kvcore import Compressor

__all__ = [
    "FixedSpanSelector",
    "GlobalThresholdRouter",
    "MeanPoolingSelector",
    "UntrainedRouter",
    "evenly_spaced_segmentation",
    "sekv_fixed_spans",
    "sekv_global_threshold",
    "sekv_mean_pooling",
    "sekv_no_svd",
    "sekv_untrained",
]


class UntrainedRouter:
    """A :class:`~kv_sekv.router.RouterSource`: the deterministic untrained router with the shapes (and model
    identity) of the router ``like`` gives for the cache (by default the shipped router of the cache's shape,
    :class:`~kv_sekv.ShippedRouter`), built when first needed, one per such router."""

    def __init__(self, like: RouterSource | None = None, seed: int = 0) -> None:
        self.like = ShippedRouter() if like is None else like
        if not isinstance(self.like, RouterSource):
            raise TypeError(f"like must be a kv_sekv.RouterSource, got {type(self.like).__name__}")
        self.seed = seed
        self._routers: dict[int, SEKVRouter] = {}

    def resolve(self, num_kv_heads: int | None = None, head_dim: int | None = None) -> SEKVRouter:
        t = self.like.resolve(num_kv_heads, head_dim)
        if id(t) not in self._routers:
            self._routers[id(t)] = SEKVRouter.untrained(
                t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim, t.config, t.model_id, seed=self.seed
            )
        return self._routers[id(t)]

    def __repr__(self) -> str:
        return f"UntrainedRouter(like={self.like!r}, seed={self.seed})"


class GlobalThresholdRouter:
    """A :class:`~kv_sekv.router.RouterSource`: the router ``base`` gives (by default the shipped router of the
    cache's shape) with every ``τ`` set to the mean of its per-layer, per-head thresholds (Table 5 "fixed global
    threshold"); ``W`` and ``g_φ`` unchanged."""

    def __init__(self, base: RouterSource | None = None) -> None:
        self.base = ShippedRouter() if base is None else base
        if not isinstance(self.base, RouterSource):
            raise TypeError(f"base must be a kv_sekv.RouterSource, got {type(self.base).__name__}")
        self._routers: dict[int, SEKVRouter] = {}

    def resolve(self, num_kv_heads: int | None = None, head_dim: int | None = None) -> SEKVRouter:
        t = self.base.resolve(num_kv_heads, head_dim)
        if id(t) not in self._routers:
            router = copy.deepcopy(t)
            with torch.no_grad():
                router.tau.fill_(float(router.tau.mean()))
            self._routers[id(t)] = router
        return self._routers[id(t)]

    def __repr__(self) -> str:
        return f"GlobalThresholdRouter(base={self.base!r})"


def evenly_spaced_segmentation(seg: Segmentation, min_span: int) -> Segmentation:
    """``seg`` with content-blind boundaries at the same accelerator cost: ``k`` boundary tokens evenly spaced from
    the first token over the part before the window, the runs between them spans (shorter than ``min_span``:
    resident), ``k`` the largest count whose persistent part (``k`` boundary tokens, ``k`` spans at ``seg``'s cost per
    span, the window) is no larger than ``seg``'s and whose gaps are at least ``min_span`` long (when SEKV keeps many
    short spans resident, the evenly spaced version holds fewer accelerator bytes: it never holds more).

    Parameters
    ----------
    seg : Segmentation
        SEKV's segmentation of the row (:func:`~kv_sekv.segmentation.fit_segmentation`); returned unchanged when it
        has no span (there is no per-span cost to match).
    min_span : int
        ``L_min``.

    Returns
    -------
    Segmentation
        Same ``window``, ``alpha`` and ``capacity``; ``cost`` recomputed at ``seg``'s cost per span.
    """
    if seg.n_spans == 0:
        return seg
    n = seg.span_id.numel()
    body = n - seg.window
    device = seg.span_id.device
    per_span = (seg.cost - int((seg.span_id < 0).sum())) / seg.n_spans  # coarse entry + summaries
    # as many boundaries as the cost allows, each gap at least min_span long (else the gaps would be resident)
    k = max(1, min(math.floor((seg.cost - seg.window) / (1.0 + per_span)), body // (min_span + 1)))
    anchors = torch.zeros(n, dtype=torch.bool, device=device)
    anchors[torch.linspace(0, body, k + 1, device=device)[:-1].floor().long()] = True
    eligible = torch.zeros(n, dtype=torch.bool, device=device)
    eligible[:body] = ~anchors[:body]
    span_id = runs_to_spans(eligible, min_span)
    n_spans = int(span_id.max()) + 1 if bool((span_id >= 0).any()) else 0
    cost = int((span_id < 0).sum()) + n_spans * per_span
    return Segmentation(span_id, anchors, n_spans, seg.alpha, seg.window, cost, seg.capacity)


@dataclasses.dataclass
class FixedSpanSelector(SpanSelector):
    """:class:`~kv_sekv.SpanSelector` with evenly spaced span boundaries (:func:`evenly_spaced_segmentation`)."""

    def segment(self, h: torch.Tensor, **options) -> Segmentation:
        return evenly_spaced_segmentation(fit_segmentation(h, **options), options["min_span"])


@dataclasses.dataclass
class MeanPoolingSelector(SpanSelector):
    """:class:`~kv_sekv.SpanSelector` whose coarse entries and summaries average a span's tokens uniformly."""

    def weights(self, h: torch.Tensor, span_id: torch.Tensor) -> torch.Tensor:
        return span_weights(torch.ones_like(h), span_id)


def _with_selector(compressor: Compressor, cls: type[SpanSelector]) -> Compressor:
    s = compressor.selector
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    return dataclasses.replace(compressor, selector=cls(**fields))


def sekv_untrained(budget: float | None = None, name: str = "sekv-untrained") -> Compressor:
    """SEKV without its trained zoom-in (Table 5): :func:`kv_sekv.sekv` with an :class:`UntrainedRouter`."""
    return sekv(budget=budget, router=UntrainedRouter(), name=name)


def sekv_no_svd(budget: float | None = None, name: str = "sekv-no-svd") -> Compressor:
    """SEKV without SVD reconstruction (Table 5): spans are only their coarse entries (``reconstruct=False``)."""
    return sekv(budget=budget, reconstruct=False, name=name)


def sekv_fixed_spans(budget: float | None = None, name: str = "sekv-fixed-spans") -> Compressor:
    """SEKV without entropy-guided segmentation (Table 5): evenly spaced boundaries (:class:`FixedSpanSelector`)."""
    return _with_selector(sekv(budget=budget, name=name), FixedSpanSelector)


def sekv_global_threshold(budget: float | None = None, name: str = "sekv-global-tau") -> Compressor:
    """SEKV with one global zoom threshold (Table 5): the trained router under :class:`GlobalThresholdRouter`."""
    return sekv(budget=budget, router=GlobalThresholdRouter(), name=name)


def sekv_mean_pooling(budget: float | None = None, name: str = "sekv-mean-pool") -> Compressor:
    """SEKV with mean-pooled span summaries (Table 5): uniform Eq. 2 weights (:class:`MeanPoolingSelector`)."""
    return _with_selector(sekv(budget=budget, name=name), MeanPoolingSelector)
