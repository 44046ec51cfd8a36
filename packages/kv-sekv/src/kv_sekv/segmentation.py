"""Surprisal segmentation (SEKV §3.1–3.2, Appendix A) and the budget rule of the always-resident part.

A token is an **anchor** when its surprisal exceeds ``μ + α·σ`` (mean and population standard deviation over the
sequence). A **span** is a maximal run of tokens between neighbouring anchors; spans shorter than ``L_min`` and
the local window of the last ``w`` tokens stay at full resolution. The first token (nothing predicts it) is always
an anchor. One segmentation serves every layer and head.

Budget rule. The paper's budget (§3.3) is the peak accelerator-resident KV, "including persistent anchors,
summaries, coarse means, and any spans reconstructed at that step". With the paper's α = 1 and w = 512 the
persistent part alone can exceed a 10 % budget, so (our choice) ``strict=True`` applies α and w literally and
reports the budget actually used, while the default shrinks the window to ``window_share`` of the budget and raises
α per sequence (a bisection over the surprisal values) until the persistent part fits in the budget less a
``zoom_share`` reserved for the spans reconstructed at a decoding step; when even no anchor but the first token does
not fit, it raises ``ValueError``.

Span length. Raising α drops anchors and so merges the runs between them: on SmolLM2-135M at 10 % of a 1k–4k
context α rises to ~2.5–3 and the longest runs reach ~300–400 tokens, longer than the zoom reserve of a layer can
rebuild, while the paper's own α (1.0; 2.0 is the coarsest of its Table 7 sweep) gives spans of 16–48 (16–150)
tokens. So (our choice) runs are cut into near-equal pieces of at most ``max_span`` tokens (64 by default, see
:class:`~kv_sekv.SEKVConfig`) *before* α is fitted: the budget then drops anchors, not span resolution, and a span
stays small enough to be reconstructed. ``max_span`` is doubled only when no α fits with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Segmentation", "fit_segmentation", "runs_to_spans", "segment", "split_spans"]


@dataclass(frozen=True)
class Segmentation:
    """The segmentation of one sequence (its real tokens, in order).

    Attributes
    ----------
    span_id : Tensor
        ``[n]`` int64: the span of each token (``0 .. n_spans − 1`` in order) or ``−1`` for a resident token
        (anchor, short span, window).
    anchors : Tensor
        ``[n]`` bool: the anchors (boundary tokens).
    n_spans : int
        Number of spans (each becomes one coarse entry per KV head).
    alpha : float
        The α used (the configured one, or the raised one that fits the budget).
    window : int
        The window used.
    cost : float
        Persistent accelerator entries per KV head in token equivalents: resident tokens + one coarse entry per
        span + its routing summaries (``summary_cost`` per span).
    capacity : int
        Budget in tokens per KV head (``budget × n``).
    """

    span_id: torch.Tensor
    anchors: torch.Tensor
    n_spans: int
    alpha: float
    window: int
    cost: float
    capacity: int

    @property
    def used(self) -> float:
        """Persistent part as a fraction of the full cache of the sequence (the budget actually used)."""
        n = self.span_id.numel()
        return self.cost / n if n else 0.0


def _stats(h: torch.Tensor) -> tuple[float, float]:
    rest = h[1:].double()
    if rest.numel() == 0:
        return 0.0, 0.0
    return float(rest.mean()), float(rest.std(unbiased=False)) if rest.numel() > 1 else 0.0


def segment(
    h: torch.Tensor,
    threshold: float,
    min_span: int,
    window: int,
    forced: torch.Tensor | None = None,
    max_span: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors ``h > threshold`` (plus the first token) outside the last ``window`` tokens, and span ids.

    Parameters
    ----------
    h : Tensor
        ``[n]`` surprisal of the real tokens of one sequence, in order.
    threshold : float
        Boundary threshold ``μ + α·σ``.
    min_span : int
        ``L_min``: shorter runs stay resident.
    window : int
        Trailing tokens kept resident and not segmented.
    forced : Tensor, optional
        ``[n]`` bool: tokens that must be anchors (protected tokens).
    max_span : int, optional
        Spans longer than this are cut into ``⌈|S| / max_span⌉`` near-equal consecutive pieces (our addition; see
        :class:`~kv_sekv.SEKVConfig`).

    Returns
    -------
    (span_id, anchors)
        ``span_id`` ``[n]`` int64 (``−1`` resident), ``anchors`` ``[n]`` bool.
    """
    n = h.numel()
    idx = torch.arange(n, device=h.device)
    in_window = idx >= n - window
    anchors = (h > threshold) & ~in_window
    anchors[:1] = ~in_window[:1]
    if forced is not None:
        anchors |= forced & ~in_window
    span_id = runs_to_spans(~anchors & ~in_window, min_span)
    if max_span is not None:
        span_id = split_spans(span_id, max_span)
    return span_id, anchors


def runs_to_spans(eligible: torch.Tensor, min_span: int) -> torch.Tensor:
    """Span ids of the maximal runs of ``eligible`` tokens at least ``min_span`` long, numbered in order; ``−1``
    elsewhere (anchors, window, short runs)."""
    start = eligible & ~torch.cat([eligible.new_zeros(1), eligible[:-1]])
    run = torch.where(eligible, torch.cumsum(start.long(), 0) - 1, -1)
    n_runs = int(start.sum())
    span_id = torch.full(eligible.shape, -1, dtype=torch.long, device=eligible.device)
    if n_runs:
        lengths = torch.bincount(run[eligible], minlength=n_runs)
        long_run = lengths >= min_span
        new_id = torch.cumsum(long_run.long(), 0) - 1
        keep = eligible & long_run[run.clamp_min(0)]
        span_id = torch.where(keep, new_id[run.clamp_min(0)], -1)
    return span_id


def split_spans(span_id: torch.Tensor, max_span: int) -> torch.Tensor:
    """Cut every span longer than ``max_span`` into ``⌈|S| / max_span⌉`` near-equal consecutive pieces (lengths
    differ by at most one); ids stay in token order, resident tokens (``−1``) unchanged."""
    inside = span_id >= 0
    if not bool(inside.any()):
        return span_id
    sid = span_id[inside]
    lengths = torch.bincount(sid)
    start = torch.cumsum(lengths, 0) - lengths
    offset = torch.arange(sid.numel(), device=sid.device) - start[sid]  # a span's tokens are consecutive
    pieces = -(-lengths // max_span)
    piece = offset * pieces[sid] // lengths[sid]
    first = torch.cumsum(pieces, 0) - pieces
    out = span_id.clone()
    out[inside] = first[sid] + piece
    return out


def _cost(span_id: torch.Tensor, summary_cost: float) -> tuple[float, int]:
    n_spans = int(span_id.max()) + 1 if span_id.numel() else 0
    resident = int((span_id < 0).sum())
    return resident + n_spans * (1.0 + summary_cost), n_spans


def fit_segmentation(
    h: torch.Tensor,
    *,
    alpha: float,
    min_span: int,
    window: int,
    capacity: int,
    summary_cost: float = 0.0,
    strict: bool = False,
    window_share: float = 0.25,
    zoom_share: float = 0.0,
    forced: torch.Tensor | None = None,
    max_span: int | str | None = None,
) -> Segmentation:
    """Segment one sequence under the budget rule (module docstring).

    Parameters
    ----------
    h : Tensor
        ``[n]`` surprisal of the real tokens (``h[0]`` is ignored: the first token is an anchor).
    alpha, min_span, window : float, int, int
        α, ``L_min`` and ``w`` of :class:`~kv_sekv.SEKVConfig`.
    capacity : int
        Budget in tokens per KV head.
    summary_cost : float
        Accelerator cost of one span's routing summaries in token equivalents per KV head
        (``group · d′ / (2 d_h)``).
    strict : bool
        Apply α and w literally (the budget used may exceed ``capacity``; see :attr:`Segmentation.used`).
    window_share : float
        With ``strict=False``: the window is at most this share of ``capacity``.
    zoom_share : float
        With ``strict=False``: the share of ``capacity`` kept free for reconstructed spans (the persistent part must
        fit ``(1 − zoom_share) · capacity``).
    forced : Tensor, optional
        ``[n]`` bool tokens that are always anchors (protected tokens).
    max_span : int, "auto" or None
        Longest span (:class:`~kv_sekv.SEKVConfig`; 64 by default there). An int is doubled (with ``strict=False``)
        only when no α fits with it, unbounded as the last resort; ``"auto"``: ``max(min_span, ⌊zoom_share ·
        capacity⌋)``, doubled the same way; ``None``: the paper's maximal runs between anchors.

    Raises
    ------
    ValueError
        With ``strict=False``, when no α fits: the message gives the budget and the smallest persistent part.
    """
    if max_span == "auto" or (isinstance(max_span, int) and not strict):
        room = max(min_span, math.floor(zoom_share * capacity)) if max_span == "auto" else max_span
        tries = [room * 2**k for k in range(32) if room * 2**k < h.numel()] + [None]
        opts = dict(alpha=alpha, min_span=min_span, window=window, capacity=capacity, summary_cost=summary_cost)
        opts.update(strict=strict, window_share=window_share, zoom_share=zoom_share, forced=forced)
        for i, cap_len in enumerate(tries):
            try:
                return _fit(h, **opts, max_span=cap_len)
            except ValueError:
                if i == len(tries) - 1:
                    raise
    return _fit(
        h,
        alpha=alpha,
        min_span=min_span,
        window=window,
        capacity=capacity,
        summary_cost=summary_cost,
        strict=strict,
        window_share=window_share,
        zoom_share=zoom_share,
        forced=forced,
        max_span=None if max_span == "auto" else max_span,
    )


def _fit(
    h: torch.Tensor,
    *,
    alpha: float,
    min_span: int,
    window: int,
    capacity: int,
    summary_cost: float,
    strict: bool,
    window_share: float,
    zoom_share: float,
    forced: torch.Tensor | None,
    max_span: int | None,
) -> Segmentation:
    h = h.float()
    n = h.numel()
    mu, sigma = _stats(h)
    limit = capacity * (1.0 - zoom_share)
    if not strict:
        window = min(window, math.floor(window_share * capacity))

    def build(thr: float, a: float) -> Segmentation:
        span_id, anchors = segment(h, thr, min_span, window, forced, max_span)
        cost, n_spans = _cost(span_id, summary_cost)
        return Segmentation(span_id, anchors, n_spans, a, window, cost, capacity)

    seg = build(mu + alpha * sigma, alpha)
    if strict or seg.cost <= limit:
        return seg
    body = h[1 : max(1, n - window)]
    thr0 = mu + alpha * sigma
    cands = torch.unique(body[body > thr0]).tolist()  # ascending; raising the threshold to c drops anchors <= c
    if not cands:
        raise ValueError(_nothing_fits(seg, limit, n))

    def at(k: int) -> Segmentation:
        return build(cands[k], (cands[k] - mu) / sigma if sigma > 0 else alpha)

    hi = len(cands) - 1
    best = at(hi)
    if best.cost > limit:
        raise ValueError(_nothing_fits(best, limit, n))
    lo = -1  # cost(lo) does not fit (lo = -1 is the configured α)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = at(mid)
        if s.cost <= limit:
            hi, best = mid, s
        else:
            lo = mid
    return best


def _nothing_fits(seg: Segmentation, limit: float, n: int) -> str:
    return (
        f"SEKV budget too small: the budget leaves {limit:.1f} of {n} tokens per KV head for the always-resident part "
        f"(the budget {seg.capacity} less the share reserved for zoom-in), but it "
        f"needs {seg.cost:.1f} (window {seg.window}, {seg.n_spans} spans with their coarse entries and summaries, "
        "anchors and short spans) even with no anchor but the first token; raise the budget, lower min_span, "
        "window_share or zoom_share, or pass strict=True to apply α and w literally"
    )
