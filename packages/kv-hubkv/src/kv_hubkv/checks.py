"""Argument checks shared by every :func:`kv_hubkv.refine` back end.

Bad inputs raise ``TypeError`` / ``ValueError`` naming the argument and the allowed range, never
silent garbage (docs/architecture.md, "Contracts").
"""

from __future__ import annotations

import math
from numbers import Real

import torch

NONFINITE_MSG = "scores must be finite (found NaN or ±inf)"
NEGATIVE_MSG = (
    "unprotected scores must be >= 0: HubKV's discount γ·s assumes non-negative importance "
    "(paper §3.1, Prop. 3); shift the base scores first (see HubKV(nonnegative='shift'))"
)

__all__ = ["NEGATIVE_MSG", "NONFINITE_MSG", "check_protected", "check_ratio", "check_scores", "check_values", "prepare"]


def check_ratio(ratio: object) -> float:
    """Validate the compression ratio ``r`` (fraction of entries removed).

    Parameters
    ----------
    ratio : float
        Must be a finite real number in ``[0, 1)``.

    Returns
    -------
    float
        ``ratio`` as a Python float.
    """
    if isinstance(ratio, torch.Tensor):
        if ratio.numel() != 1:
            raise TypeError("ratio must be a real number in [0, 1), got a tensor with several elements")
        ratio = ratio.item()
    if isinstance(ratio, bool) or not isinstance(ratio, Real):
        raise TypeError(f"ratio must be a real number in [0, 1), got {type(ratio).__name__}")
    r = float(ratio)
    if not (math.isfinite(r) and 0.0 <= r < 1.0):
        raise ValueError(f"ratio (fraction removed) must lie in [0, 1), got {r}")
    return r


def check_scores(scores: object) -> torch.Tensor:
    """Validate the type, dtype and rank of ``scores`` (``[..., H, N]`` floating point)."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"scores must have a floating dtype (float32, float16, bfloat16, float64), got {scores.dtype}")
    if scores.dim() < 2:
        raise ValueError(f"scores must have shape [..., H, N] (at least 2 dims), got {tuple(scores.shape)}")
    return scores


def check_protected(protected: object, scores: torch.Tensor) -> torch.Tensor | None:
    """Validate ``protected`` and broadcast it (as a view) to ``scores.shape``.

    Parameters
    ----------
    protected : torch.Tensor or None
        Boolean mask, broadcastable to ``scores.shape`` without enlarging it, on the same device.

    Returns
    -------
    torch.Tensor or None
        A broadcast (possibly stride-0) view with exactly ``scores.shape``.
    """
    if protected is None:
        return None
    if not isinstance(protected, torch.Tensor):
        raise TypeError(f"protected must be a bool torch.Tensor or None, got {type(protected).__name__}")
    if protected.dtype != torch.bool:
        raise TypeError(f"protected must have dtype torch.bool, got {protected.dtype}")
    if protected.device != scores.device:
        raise ValueError(f"protected is on {protected.device} but scores is on {scores.device}")
    # (torch.broadcast_shapes would import torch._refs: seconds on first use)
    try:
        return protected.broadcast_to(scores.shape)
    except RuntimeError:
        raise ValueError(
            f"protected shape {tuple(protected.shape)} must broadcast to scores shape {tuple(scores.shape)}"
        ) from None


def check_values(scores: torch.Tensor, protected: torch.Tensor | None) -> None:
    """Reject non-finite scores and negative unprotected scores.

    One ``aminmax`` pass and one host sync (``aminmax`` propagates NaN); the protected-aware
    negativity check only runs when the global minimum is negative. HubKV's multiplicative discount
    and Prop. 3 assume ``s >= 0`` (paper §3.1: ``s_i ∈ [0, 1]``; Appendix J.3); a negative score
    would be *raised* by the discount ``γ·s``.
    """
    if scores.numel() == 0:
        return
    lo, hi = torch.aminmax(scores)
    lo_f, hi_f = torch.stack([lo, hi]).float().tolist()
    if not (math.isfinite(lo_f) and math.isfinite(hi_f)):
        raise ValueError(NONFINITE_MSG)
    if lo_f < 0 and (protected is None or bool((scores.masked_fill(protected, 0) < 0).any())):
        raise ValueError(NEGATIVE_MSG)


def prepare(scores: object, ratio: object, protected: object, config: object, *, values: bool = True):
    """Run every check; return ``(scores, protected_view_or_None, ratio_float)``.

    ``config`` must already be a validated :class:`~kv_hubkv.config.HubKVConfig` (its
    ``__post_init__`` checks the hyper-parameters). ``values=False`` skips :func:`check_values`, for a
    back end that checks the values itself (the Triton kernel folds them into its statistics pass).
    """
    scores = check_scores(scores)
    r = check_ratio(ratio)
    prot = check_protected(protected, scores)
    if values:
        check_values(scores, prot)
    return scores, prot, r
