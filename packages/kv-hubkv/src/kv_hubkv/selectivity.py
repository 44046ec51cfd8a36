"""Bounded head-wise selectivity calibration (paper §3.3 step 3, Eqs. 8–9; Appendix A.1).

For every head ``h`` of one leading index (layer, or layer × batch), over its *unprotected*
tokens ``C_h``::

    μ_h = mean(s_i : i ∈ C_h)
    σ_h = sqrt(mean((s_i - μ_h)^2 : i ∈ C_h))          # population standard deviation
    c_h = σ_h / (μ_h + ε)                               # coefficient of variation, Eq. 8
    c̄  = mean(c_h over the heads of that leading index with |C_h| > 0)
    β_h = clip((c_h / c̄)^τ, β_min, β_max)              # Eq. 9

Choices the paper leaves open, documented here:

* ``σ`` is the **population** standard deviation (divide by ``|C_h|``). The paper defines ``σ_h``
  as the standard deviation "computed over unprotected tokens" of the content region, i.e. a
  descriptive statistic of the whole region, not an estimate from a sample. When every head has
  the same number of unprotected tokens (the usual sinks + recent-window mask) the choice does not
  matter at all: Bessel's factor ``sqrt(n / (n - 1))`` scales every ``c_h`` alike and cancels in
  ``c_h / c̄``. It only matters for per-head masks with different counts.
* ``σ`` is computed as ``min(sqrt(var), (max - min) / 2)`` over the head's unprotected tokens.
  The clamp is a mathematical identity (Popoviciu's inequality) but makes ``σ`` exactly 0 on a
  constant head: without it the float32 rounding of the mean leaves ``σ ≈ 1e-8`` there, and since
  ``c_h / c̄`` is scale-free that noise would decide ``β`` between the clip bounds.
* Heads with no unprotected token have undefined statistics; they are left out of ``c̄`` (their
  ``β`` is irrelevant since they have nothing to refine).
* If ``c̄ = 0`` (every head constant over its content region) all heads are equally selective and
  ``c_h / c̄`` is taken as 1. ``0^0 = 1`` when ``τ = 0``.
"""

from __future__ import annotations

import torch

__all__ = ["head_statistics", "head_weights", "weights_from_statistics"]


def head_statistics(
    scores: torch.Tensor, protected: torch.Tensor | None = None, *, neg_masked: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and population std of each head's unprotected scores.

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., H, N]`` float scores.
    protected : torch.Tensor of bool, optional
        Broadcastable to ``scores``.
    neg_masked : torch.Tensor, optional
        ``scores`` (float32) with ``-inf`` at protected positions, if the caller already has it.

    Returns
    -------
    count, mean, std : torch.Tensor
        Each ``[..., H]``; ``count`` is int64, ``mean``/``std`` float32 (0 where ``count == 0``).
        ``std`` is the population standard deviation, clamped to half the range (exactly 0 on
        constant heads).
    """
    x = scores.float()
    lead = x.shape[:-1]
    if protected is None:
        n = torch.full(lead, x.shape[-1], dtype=torch.int64, device=x.device)
        nf = n.clamp(min=1).float()
        mean = x.sum(-1) / nf
        dev = x - mean.unsqueeze(-1)
        lo, hi = torch.aminmax(x, dim=-1)
    else:
        # count on the un-broadcast mask (a bool sum over the full shape would copy it to int64)
        n_prot = protected.expand(*protected.shape[:-1], x.shape[-1]).sum(-1)
        n = (x.shape[-1] - n_prot).expand(lead)
        nf = n.clamp(min=1).float()
        mean = x.masked_fill(protected, 0.0).sum(-1) / nf
        dev = (x - mean.unsqueeze(-1)).masked_fill_(protected, 0.0)
        if neg_masked is None:
            neg_masked = x.masked_fill(protected, float("-inf"))
        hi = neg_masked.amax(-1)
        lo = x.masked_fill(protected, float("inf")).amin(-1)
    var = dev.square_().sum(-1) / nf
    # Popoviciu: σ <= (max - min) / 2. Exact for the maths, and it makes σ exactly 0 on constant
    # heads, where float32 rounding of the mean would otherwise leave a noise-level σ that the
    # scale-free ratio c / c̄ would blow up to a full clip (see module notes).
    half_range = torch.where(n > 0, (hi - lo) * 0.5, 0.0)
    return n, mean, torch.minimum(var.sqrt(), half_range)


def weights_from_statistics(
    n: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    tau: float,
    beta_min: float,
    beta_max: float,
    eps: float,
) -> torch.Tensor:
    """``β = clip((c / c̄)^τ, β_min, β_max)`` from per-head statistics ``[..., H]`` (Eqs. 8–9)."""
    c = std / (mean + eps)
    valid = n > 0
    n_valid = valid.sum(-1, keepdim=True).clamp(min=1).float()
    cbar = torch.where(valid, c, 0.0).sum(-1, keepdim=True) / n_valid
    rel = torch.where(cbar > 0, c / torch.where(cbar > 0, cbar, 1.0), 1.0)
    w = torch.pow(rel, tau)
    return w.clamp(beta_min, beta_max)


def head_weights(
    scores: torch.Tensor,
    protected: torch.Tensor | None = None,
    *,
    tau: float = 0.5,
    beta_min: float = 0.8,
    beta_max: float = 1.2,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Clipped relative head weights ``β`` of Eq. 9.

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., H, N]`` non-negative float scores.
    protected : torch.Tensor of bool, optional
        Broadcastable to ``scores``; excluded from the statistics (Appendix A.1).
    tau, beta_min, beta_max, eps : float
        See :class:`kv_hubkv.HubKVConfig`.

    Returns
    -------
    torch.Tensor
        ``[..., H]`` float32 weights in ``[beta_min, beta_max]``.
    """
    n, mean, std = head_statistics(scores, protected)
    return weights_from_statistics(n, mean, std, tau=tau, beta_min=beta_min, beta_max=beta_max, eps=eps)
