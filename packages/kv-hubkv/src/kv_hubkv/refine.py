"""``kv_hubkv.refine``: the HubKV score refinement with back-end dispatch (paper §3.3).

Triton on CUDA tensors (when triton is installed), the PyTorch reference everywhere else
(the reference *is* the CPU path; docs/architecture.md, "Kernels"); the decision is
:func:`kvcore.dispatch.use_triton`.
"""

from __future__ import annotations

import torch

from kvcore.dispatch import use_triton

from .config import HubKVConfig
from .reference import refine_torch_config
from .triton_kernel import refine_triton_config

__all__ = ["refine", "refine_config"]


def refine_config(
    scores: torch.Tensor,
    ratio: float,
    protected: torch.Tensor | None = None,
    config: HubKVConfig | None = None,
) -> torch.Tensor:
    """:func:`refine` with a :class:`HubKVConfig` object (``None`` = paper defaults)."""
    config = HubKVConfig() if config is None else config
    if not isinstance(config, HubKVConfig):
        raise TypeError(f"config must be a HubKVConfig, got {type(config).__name__}")
    if isinstance(scores, torch.Tensor) and use_triton(scores):
        return refine_triton_config(scores, ratio, protected, config)
    return refine_torch_config(scores, ratio, protected, config)


def refine(
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
    """Refine base importance scores with HubKV (paper §3.3, Eqs. 6–10; Appendix A.1, Eq. 13).

    For every leading index (layer / batch row) and head, on the unprotected tokens:

    1. local hubs ``M_i = 1[i = argmax_{j ∈ W_i, j unprotected} s_j]``, ``W_i = [i-k, i+k]``
       clipped at the edges, ``k = kernel_size // 2``, ties to the lowest index (Eq. 6);
    2. ``s̃ = s`` for hubs, ``γ·s`` otherwise (Eq. 7);
    3. ``c = σ/(μ+ε)`` over the head's unprotected tokens (population std), ``c̄`` = mean of ``c``
       over the heads of the same leading index, ``β = clip((c/c̄)^τ, β_min, β_max)`` (Eqs. 8–9);
    4. ``λ = r^p``, ``z = (1-λ)·s + λ·β·s̃`` (Eq. 10).

    Protected tokens get the maximum retention score ``P`` (1, or the next float above every
    unprotected ``z`` of the call if some ``z >= 1``; see :mod:`kv_hubkv.ceiling`).

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., H, N]`` base scores (float32/float16/bfloat16/float64; computed in float32).
        Must be finite, and ``>= 0`` at unprotected positions.
    ratio : float
        Compression ratio ``r ∈ [0, 1)``, the fraction of entries removed. ``r = 0`` returns the
        base scores unchanged (as float32) on unprotected tokens.
    protected : torch.Tensor of bool, optional
        Broadcastable to ``scores`` (e.g. ``[B, 1, N]`` for ``[B, H, N]`` scores): attention
        sinks, recent window, residual buffer.
    kernel_size : int, default 5
        Odd hub window size ``2k+1 >= 1``.
    gamma : float, default 0.5
        Non-hub discount in ``(0, 1)``.
    tau : float, default 0.5
        Selectivity exponent ``>= 0``.
    beta_min, beta_max : float, default 0.8, 1.2
        Head-weight clip range, ``0 < beta_min <= beta_max``.
    p : float, default 2.0
        Gate exponent ``> 0``.
    eps : float, default 1e-6
        ``ε > 0`` of the coefficient of variation.

    Returns
    -------
    torch.Tensor
        float32 tensor with the shape of ``scores``; higher = keep.

    Raises
    ------
    TypeError
        Non-tensor or non-float ``scores``, non-bool ``protected``, wrongly typed parameters.
    ValueError
        Shape mismatch, non-finite or negative-unprotected scores, parameters out of range.

    Examples
    --------
    >>> import torch, kv_hubkv
    >>> s = torch.tensor([[[0.1, 0.9, 0.8, 0.2, 0.1, 0.7]]])
    >>> kv_hubkv.refine(s, ratio=0.0).equal(s)   # r = 0: gate closed
    True
    """
    config = HubKVConfig(
        kernel_size=kernel_size, gamma=gamma, tau=tau, beta_min=beta_min, beta_max=beta_max, p=p, eps=eps
    )
    return refine_config(scores, ratio, protected, config)
