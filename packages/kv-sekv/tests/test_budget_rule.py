"""The default budget rule keeps spans in the paper's size range and leaves room to zoom in (issue 40).

At a 10 % or 20 % budget of a 1k–4k context with SmolLM2-135M's shapes (3 KV heads, head dim 64, d' 32, so one span's
routing summaries cost 0.75 token equivalents per KV head), every span is between L_min = 16 and the default
``max_span`` = 64 tokens, and the room a layer keeps for reconstructions at a decoding step (its capacity over the 3
KV heads less the persistent part) is positive and holds the longest span. Before, raising α merged the runs between
anchors into spans of ~300–400 tokens that no zoom reserve could hold.
"""

import math

import pytest
import torch

from kv_sekv import SEKVConfig, SpanSelector, fit_segmentation
from kv_sekv.config import DEFAULT_MAX_SPAN
from kvcore import Budget, Scores

H_KV, SUMMARY_COST = 3, 3 * 32 / (2 * 64)


def _text_like(n: int, seed: int) -> torch.Tensor:
    """Surprisal shaped like running text (SmolLM2 on lee_background: mean ~3.3 nats, std ~3)."""
    g = torch.Generator().manual_seed(seed)
    return -torch.log(torch.rand(n, generator=g).clamp_min(1e-9)) * 3.3  # exponential, mean 3.3


def _repetitive(n: int, seed: int) -> torch.Tensor:
    """A passkey-like prompt: near-zero surprisal with a few peaks (the case that gave ~400-token spans)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(n, generator=g) * 0.2
    h[torch.randint(0, n, (max(1, n // 200),), generator=g)] = 12.0
    return h


@pytest.mark.parametrize("n", [1024, 2048, 4096])
@pytest.mark.parametrize("budget", [0.1, 0.2])
@pytest.mark.parametrize("make", [_text_like, _repetitive])
def test_spans_in_range_and_zoom_reserve_holds_a_span(n, budget, make):
    cfg = SEKVConfig()
    assert cfg.max_span == DEFAULT_MAX_SPAN == 64
    h = make(n, 0)
    cap = math.floor(budget * n)
    seg = fit_segmentation(
        h,
        alpha=cfg.alpha,
        min_span=cfg.min_span,
        window=cfg.window,
        capacity=cap,
        summary_cost=SUMMARY_COST,
        window_share=cfg.window_share,
        zoom_share=cfg.zoom_share,
        max_span=cfg.max_span,
    )
    lengths = torch.bincount(seg.span_id[seg.span_id >= 0])
    assert seg.n_spans > 0
    assert int(lengths.min()) >= cfg.min_span and int(lengths.max()) <= cfg.max_span
    assert seg.cost <= (1 - cfg.zoom_share) * cap  # the zoom reserve is kept
    room = H_KV * (cap - seg.cost)  # what the store's cap leaves per layer at the first decoding step
    assert room > 0 and room >= int(lengths.max())
    assert seg.window > 0


def test_selector_default_is_the_bounded_rule():
    """``SpanSelector`` with the default config segments with the bounded spans (the path kvbench measures)."""
    n = 2048
    h = _repetitive(n, 1)
    scores = Scores(keys=h[None, None, :].expand(1, H_KV, n).contiguous())
    plan = SpanSelector(SEKVConfig()).select(scores, Budget(ratio=0.9))
    sid = plan.span_id[0]
    lengths = torch.bincount(sid[sid >= 0])
    assert lengths.numel() > 0 and int(lengths.max()) <= 64 and int(lengths.min()) >= 16


def test_unbounded_rule_still_available():
    """``max_span=None`` is the paper's maximal runs (and shows the long spans the default avoids)."""
    h = _repetitive(1024, 0)
    seg = fit_segmentation(h, alpha=1.0, min_span=16, window=512, capacity=102, summary_cost=SUMMARY_COST)
    assert int(torch.bincount(seg.span_id[seg.span_id >= 0]).max()) > 64


def test_max_span_relaxes_only_when_nothing_fits():
    """A budget too small for 64-token spans doubles the limit rather than failing."""
    h = _text_like(1024, 3)
    opts = dict(alpha=1.0, min_span=16, window=512, summary_cost=SUMMARY_COST, zoom_share=0.25)
    seg = fit_segmentation(h, capacity=40, max_span=64, **opts)
    assert seg.cost <= 30 and int(torch.bincount(seg.span_id[seg.span_id >= 0]).max()) > 64
    with pytest.raises(ValueError, match="budget too small"):
        fit_segmentation(h, capacity=40, max_span=64, strict=False, **{**opts, "zoom_share": 0.99})
