"""PyTorch reference of the HubKV refinement (paper §3.3, Eqs. 6–10, 13) — the CPU path.

Unfused: one-sided max-pools for the hub mask, masked head statistics, then element-wise mixing.
:func:`kv_hubkv.triton_kernel.refine_triton` computes the same thing in one fused kernel.

Mixing is evaluated in the factorised form of Appendix J.3, ``z = s·((1 - λ) + λ·β·q)`` with
``q = 1`` for hubs and ``γ`` otherwise, i.e. one multiply by a per-head factor (``a_h`` for hubs,
``b_h`` for non-hubs) instead of the five element-wise passes of ``(1 - λ)s + λβs̃``; it equals
Eq. 10 up to float32 rounding (the Triton kernel uses the same form, so the two agree to an ulp).
"""

from __future__ import annotations

import torch

from .ceiling import retention_ceiling
from .checks import prepare
from .config import HubKVConfig
from .hubs import hub_mask_from_masked
from .selectivity import head_statistics, weights_from_statistics

__all__ = ["mixing_factors", "refine_torch", "refine_torch_config"]


def mixing_factors(beta: torch.Tensor, lam: float, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head factors ``a = (1-λ) + λβ`` (hubs) and ``b = (1-λ) + λβγ`` (non-hubs), float32."""
    one_minus = 1.0 - lam
    return one_minus + lam * beta, one_minus + lam * (beta * gamma)


def refine_torch_config(
    scores: torch.Tensor, ratio: float, protected: torch.Tensor | None, config: HubKVConfig
) -> torch.Tensor:
    """:func:`refine_torch` with a ready :class:`HubKVConfig` (same checks and result)."""
    scores, prot, r = prepare(scores, ratio, protected, config)
    small = None if protected is None else protected  # un-broadcast mask: cheaper element-wise ops
    x = scores.float()
    if x.numel() == 0:
        return x.clone()
    lam = config.gate(r)
    masked = x if small is None else x.masked_fill(small, float("-inf"))
    hub = hub_mask_from_masked(x, masked, config.half_window)
    n, mean, std = head_statistics(x, small, neg_masked=masked if small is not None else None)
    beta = weights_from_statistics(
        n, mean, std, tau=config.tau, beta_min=config.beta_min, beta_max=config.beta_max, eps=config.eps
    )
    a, b = mixing_factors(beta, lam, config.gamma)
    z = x * torch.where(hub, a.unsqueeze(-1), b.unsqueeze(-1))
    if prot is None:
        return z
    zmax = z.masked_fill(small, float("-inf")).amax()
    return z.masked_fill_(small, retention_ceiling(zmax))


def refine_torch(
    scores: torch.Tensor,
    ratio: float,
    protected: torch.Tensor | None = None,
    *,
    kernel_size: int = 5,
    gamma: float = 0.5,
    tau: float = 0.5,
    beta_min: float = 0.8,
    beta_max: float = 1.2,
    p: float = 2.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """HubKV score refinement, plain PyTorch (any device).

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., H, N]`` finite float scores (fp32/fp16/bf16/fp64), ``>= 0`` where unprotected.
    ratio : float
        Compression ratio ``r ∈ [0, 1)`` (fraction removed); gate ``λ = r^p`` (Eq. 10).
    protected : torch.Tensor of bool, optional
        Broadcastable to ``scores``: sinks, recent window... (Appendix A.1).
    kernel_size, gamma, tau, beta_min, beta_max, p, eps
        See :class:`kv_hubkv.HubKVConfig`.

    Returns
    -------
    torch.Tensor
        float32, same shape as ``scores``: ``z = (1 - λ)s + λβs̃`` on unprotected tokens and the
        retention ceiling (:func:`kv_hubkv.ceiling.retention_ceiling`) on protected ones.
    """
    config = HubKVConfig(
        kernel_size=kernel_size, gamma=gamma, tau=tau, beta_min=beta_min, beta_max=beta_max, p=p, eps=eps
    )
    return refine_torch_config(scores, ratio, protected, config)
