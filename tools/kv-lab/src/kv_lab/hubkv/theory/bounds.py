"""Bounded ratio-gated perturbation (paper Appendix J.3, Prop. 3, Eqs. 15–17).

For every unprotected token with ``s >= 0``::

    (1 - λ + λ·γ·β_min)·s  <=  z  <=  (1 - λ + λ·β_max)·s,      λ = r^p        (16)

and for two unprotected tokens ``a``, ``b``: if
``s_a / s_b > (1 - λ + λβ_max) / (1 - λ + λγβ_min)`` then ``z_a > z_b``          (17)
"""

from __future__ import annotations

import torch

from kv_hubkv.checks import check_ratio
from kv_hubkv.config import HubKVConfig

__all__ = ["perturbation_bounds", "ranking_stability_threshold"]


def _factors(ratio: float, config: HubKVConfig | None) -> tuple[float, float]:
    config = HubKVConfig() if config is None else config
    lam = config.gate(check_ratio(ratio))
    lo = 1.0 - lam + lam * config.gamma * config.beta_min
    hi = 1.0 - lam + lam * config.beta_max
    return lo, hi


def perturbation_bounds(
    scores: torch.Tensor, ratio: float, config: HubKVConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds of Eq. 16 on the refined score of unprotected tokens.

    Parameters
    ----------
    scores : torch.Tensor
        Base scores ``s >= 0``.
    ratio : float
        Compression ratio ``r ∈ [0, 1)``.
    config : HubKVConfig, optional
        Default: the paper's.

    Returns
    -------
    lower, upper : torch.Tensor
        float64 tensors shaped like ``scores``.
    """
    lo, hi = _factors(ratio, config)
    s = scores.to(torch.float64)
    return lo * s, hi * s


def ranking_stability_threshold(ratio: float, config: HubKVConfig | None = None) -> float:
    """Right-hand side of Eq. 17: ``(1 - λ + λβ_max) / (1 - λ + λγβ_min)``.

    If ``s_a / s_b`` exceeds it, HubKV cannot reorder the two unprotected tokens.
    """
    lo, hi = _factors(ratio, config)
    return hi / lo
