"""PyTorch reference of the HubKV refinement (paper §3.3, Eqs. 6–10, 13) — the CPU path.

Unfused: one-sided max-pools for the hub mask, masked head statistics, then element-wise mixing.
:func:`kv_hubkv.triton_kernel.refine_triton` computes the same thing in one fused kernel.
"""

from __future__ import annotations

import torch

from .ceiling import retention_ceiling
from .checks import prepare
from .config import HubKVConfig
from .hubs import local_hubs, smd_discount
from .selectivity import head_weights

__all__ = ["refine_torch", "refine_torch_config"]


def refine_torch_config(
    scores: torch.Tensor, ratio: float, protected: torch.Tensor | None, config: HubKVConfig
) -> torch.Tensor:
    """:func:`refine_torch` with a ready :class:`HubKVConfig` (same checks and result)."""
    scores, prot, r = prepare(scores, ratio, protected, config)
    x = scores.float()
    if x.numel() == 0:
        return x.clone()
    lam = config.gate(r)
    hubs = local_hubs(x, prot, config.kernel_size)
    s_tilde = smd_discount(x, hubs, config.gamma)
    beta = head_weights(
        x, prot, tau=config.tau, beta_min=config.beta_min, beta_max=config.beta_max, eps=config.eps
    )
    z = (1.0 - lam) * x + lam * (beta.unsqueeze(-1) * s_tilde)
    if prot is None:
        return z
    zmax = z.masked_fill(prot, float("-inf")).amax()
    return z.masked_fill(prot, retention_ceiling(zmax))


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
    config = HubKVConfig(kernel_size=kernel_size, gamma=gamma, tau=tau, beta_min=beta_min,
                         beta_max=beta_max, p=p, eps=eps)
    return refine_torch_config(scores, ratio, protected, config)
