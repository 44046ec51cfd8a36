"""Score-locality diagnostics of the HubKV paper (§2.3 Observations 1–3; Appendix I).

Run them on score tensors captured from any base scorer (e.g. ``[layers, kv_heads, T]`` from a
prefill) to see whether the locality that motivates HubKV is present in *your* model and data::

    imp = token_importance(content_region(scores))      # mean over layers and heads, sinks/recent dropped
    marginal_coverage(imp)                              # Observation 1 (Fig. 1a)
    autocorrelation(imp, max_lag=150)                   # Observation 2 (Fig. 1b)
    nms_coverage(imp)                                   # Observation 3 (Fig. 1c)

All rankings break ties by the lower index. Everything is computed in float64 on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvcore.checks import check_int

__all__ = [
    "autocorrelation",
    "content_region",
    "coverage_curve",
    "marginal_coverage",
    "nms_coverage",
    "nms_scores",
    "ranking",
    "segment_ids",
    "token_importance",
]


def _as_1d(importance) -> torch.Tensor:
    x = torch.as_tensor(importance).detach().to("cpu", torch.float64)
    if x.dim() != 1:
        raise ValueError(f"importance must be 1-D [T], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError("importance must not be empty")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("importance must be finite")
    return x


def _pos_int(name: str, v, minimum: int = 1) -> int:
    check_int(name, v, low=minimum)
    return v


def content_region(scores: torch.Tensor, n_sink: int = 4, recent_frac: float = 0.02) -> torch.Tensor:
    """Drop the protected sinks and the trailing recency window (Appendix I, A.1).

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., T]`` scores.
    n_sink : int, default 4
        Leading attention-sink tokens to drop.
    recent_frac : float, default 0.02
        The trailing ``floor(recent_frac · T)`` tokens are dropped (40 of 2,048 in the paper).

    Returns
    -------
    torch.Tensor
        ``scores[..., n_sink : T - floor(recent_frac·T)]``.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() < 1:
        raise ValueError("scores must be a tensor [..., T]")
    n_sink = _pos_int("n_sink", n_sink, 0)
    if not (isinstance(recent_frac, (int, float)) and 0.0 <= recent_frac < 1.0):
        raise ValueError(f"recent_frac must lie in [0, 1), got {recent_frac!r}")
    t = scores.shape[-1]
    recent = math.floor(recent_frac * t)
    if n_sink + recent >= t:
        raise ValueError(f"no content left: T={t}, n_sink={n_sink}, recent={recent}")
    return scores[..., n_sink : t - recent]


def token_importance(scores: torch.Tensor) -> torch.Tensor:
    """Scalar importance per token: the mean over every leading dim (layers, heads) (Appendix I)."""
    x = torch.as_tensor(scores).detach().to("cpu", torch.float64)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError("scores must be [..., T] with T >= 1")
    return x.reshape(-1, x.shape[-1]).mean(0)


def segment_ids(t: int, n_segments: int = 64) -> torch.Tensor:
    """Segment of each of ``t`` tokens when the region is cut into ``n_segments`` equal widths.

    Token ``i`` belongs to segment ``floor(i · n_segments / t)``.
    """
    t = _pos_int("t", t)
    n_segments = _pos_int("n_segments", n_segments)
    return torch.div(torch.arange(t) * n_segments, t, rounding_mode="floor")


def ranking(importance) -> torch.Tensor:
    """Indices by decreasing importance, ties to the lower index (the Top-K order)."""
    x = _as_1d(importance)
    return torch.sort(x, descending=True, stable=True).indices


def marginal_coverage(importance, n_segments: int = 64, steps: int = 80, order=None) -> torch.Tensor:
    """Observation 1: marginal spatial gain of each Top-K selection step (Fig. 1a).

    Parameters
    ----------
    importance : array-like
        1-D content-token importance ``[T]``.
    n_segments : int, default 64
        Equal-width segments of the content region.
    steps : int, default 80
        Number of selection steps reported (``<= T``).
    order : sequence of int, optional
        Selection order to score instead of Top-K (e.g. a random permutation baseline).

    Returns
    -------
    torch.Tensor
        ``[steps]`` float64: ``1/n_segments`` where the ``t``-th selected token falls in a segment
        not covered before, else 0.
    """
    x = _as_1d(importance)
    steps = _pos_int("steps", steps)
    if steps > x.numel():
        raise ValueError(f"steps must be <= number of tokens ({x.numel()}), got {steps}")
    seg = segment_ids(x.numel(), n_segments)
    order = ranking(x) if order is None else torch.as_tensor(order, dtype=torch.long)
    if order.dim() != 1 or order.numel() < steps:
        raise ValueError(f"order must be 1-D with at least {steps} indices")
    covered = torch.zeros(n_segments, dtype=torch.bool)
    gains = torch.zeros(steps, dtype=torch.float64)
    for t in range(steps):
        g = seg[order[t]]
        if not covered[g]:
            covered[g] = True
            gains[t] = 1.0 / n_segments
    return gains


def coverage_curve(order, t: int, budgets: Iterable[int], n_segments: int = 64) -> torch.Tensor:
    """Fraction of the ``n_segments`` segments covered by the first ``K`` tokens of ``order``.

    Returns
    -------
    torch.Tensor
        float64, one entry per ``K`` in ``budgets``.
    """
    order = torch.as_tensor(order, dtype=torch.long)
    seg = segment_ids(t, n_segments)
    budgets = [int(k) for k in budgets]
    if any(k < 0 or k > order.numel() for k in budgets):
        raise ValueError(f"budgets must lie in [0, {order.numel()}]")
    first_seen = torch.full((n_segments,), order.numel(), dtype=torch.long)
    segs_in_order = seg[order]
    pos = torch.arange(order.numel())
    first_seen.scatter_reduce_(0, segs_in_order, pos, reduce="amin")
    return torch.tensor([(first_seen < k).sum().item() / n_segments for k in budgets], dtype=torch.float64)


def autocorrelation(importance, max_lag: int = 150) -> torch.Tensor:
    """Observation 2: normalised autocorrelation ``R(d)``, ``d = 1..max_lag`` (Fig. 1b).

    ``R(d) = E_i[(s_i - s̄)(s_{i+d} - s̄)] / E_i[(s_i - s̄)²]`` with the numerator averaged over
    the ``T - d`` available pairs (Appendix I).

    Raises
    ------
    ValueError
        If the importance is constant (``R`` undefined) or ``max_lag >= T``.
    """
    x = _as_1d(importance)
    max_lag = _pos_int("max_lag", max_lag)
    t = x.numel()
    if max_lag >= t:
        raise ValueError(f"max_lag must be < T = {t}, got {max_lag}")
    c = x - x.mean()
    denom = (c * c).mean()
    if not float(denom) > 0.0:
        raise ValueError("importance is constant: autocorrelation undefined")
    return torch.stack([(c[:-d] * c[d:]).mean() for d in range(1, max_lag + 1)]) / denom


def nms_scores(importance, window: int = 7, discount: float = 0.3) -> torch.Tensor:
    """Observation 3's 1D-NMS: local maxima keep their score, other tokens are multiplied by
    ``discount`` (Appendix I: neighbourhood 7, factor 0.3).

    A token is a local maximum when it equals the max-pool of its ``window`` neighbourhood
    (clipped at the edges), so every member of a tied plateau maximum is kept — this is the hard
    diagnostic of §2.3, not HubKV's index-tie-broken hub rule.
    """
    x = _as_1d(importance)
    window = _pos_int("window", window)
    if window % 2 == 0:
        raise ValueError(f"window must be odd, got {window}")
    if not (isinstance(discount, (int, float)) and 0.0 <= discount <= 1.0):
        raise ValueError(f"discount must lie in [0, 1], got {discount!r}")
    k = window // 2
    pooled = F.max_pool1d(F.pad(x[None, None], (k, k), value=float("-inf")), window, stride=1)[0, 0]
    return torch.where(x == pooled, x, x * discount)


def nms_coverage(
    importance,
    budgets: Iterable[int] = range(1, 81),
    n_segments: int = 64,
    window: int = 7,
    discount: float = 0.3,
) -> dict[str, torch.Tensor]:
    """Observation 3: segment coverage of Top-K vs 1D-NMS-adjusted Top-K (Fig. 1c).

    Returns
    -------
    dict
        ``{"budgets": [K...], "topk": coverage, "nms": coverage, "ratio": nms / topk}``.
    """
    x = _as_1d(importance)
    budgets = [int(k) for k in budgets]
    topk = coverage_curve(ranking(x), x.numel(), budgets, n_segments)
    nms = coverage_curve(ranking(nms_scores(x, window, discount)), x.numel(), budgets, n_segments)
    ratio = torch.where(topk > 0, nms / torch.where(topk > 0, topk, 1.0), torch.nan)
    return {"budgets": torch.tensor(budgets), "topk": topk, "nms": nms, "ratio": ratio}
