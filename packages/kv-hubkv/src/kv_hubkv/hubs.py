"""Local hub detection and Submodular Marginal Discounting (paper §3.3 steps 1–2, Eqs. 6–7).

A token ``i`` is a *local hub* iff it is the argmax of the scores over the unprotected positions
of its window ``W_i = [i - k, i + k]`` (clipped at the sequence edges), ties going to the lowest
index ("deterministic index-based tie-breaking is used for score plateaus", Eq. 6). Protected
positions take no part in the competition (Appendix A.1: "local max-pooling is evaluated over
unprotected positions in the local window") and are never hubs.

With lowest-index tie-breaking the argmax condition splits into two one-sided max-pools::

    hub_i  <=>  s_i >  max{ s_j : j in [i-k, i-1], j unprotected }
            and s_i >= max{ s_j : j in [i+1, i+k], j unprotected }

(an empty side has maximum ``-inf``). This is what both back ends compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["hub_mask_from_masked", "local_hubs", "one_sided_window_max", "smd_discount"]


def one_sided_window_max(masked: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Maxima of ``masked[..., i-k : i]`` (left) and ``masked[..., i+1 : i+k+1]`` (right).

    Parameters
    ----------
    masked : torch.Tensor
        ``[..., N]`` float tensor in which excluded (protected) positions already hold ``-inf``.
    k : int
        Half window ``k >= 0``.

    Returns
    -------
    left, right : torch.Tensor
        Same shape as ``masked``; ``-inf`` where the one-sided window is empty.
    """
    if k == 0:
        empty = torch.full_like(masked, float("-inf"))
        return empty, empty
    shape = masked.shape
    n = shape[-1]
    flat = masked.reshape(-1, 1, n)
    left = F.max_pool1d(F.pad(flat, (k, 0), value=float("-inf")), k, stride=1)[..., :n]
    right = F.max_pool1d(F.pad(flat, (0, k), value=float("-inf")), k, stride=1)[..., 1 : n + 1]
    return left.reshape(shape), right.reshape(shape)


def hub_mask_from_masked(x: torch.Tensor, masked: torch.Tensor, k: int) -> torch.Tensor:
    """Hub test of Eq. 6 given ``masked`` (``x`` with ``-inf`` at protected positions).

    The value at protected positions themselves is unspecified (callers overwrite them).
    """
    left, right = one_sided_window_max(masked, k)
    hub = x > left
    hub &= x >= right
    return hub


def local_hubs(scores: torch.Tensor, protected: torch.Tensor | None = None, kernel_size: int = 5) -> torch.Tensor:
    """Local-hub mask ``M`` of Eq. 6 with lowest-index tie-breaking and protected masking.

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., N]`` finite float scores.
    protected : torch.Tensor of bool, optional
        Broadcastable to ``scores``; protected positions are excluded from every window and are
        not hubs (Appendix A.1).
    kernel_size : int, default 5
        Odd window size ``2k + 1``.

    Returns
    -------
    torch.Tensor of bool
        ``True`` where token ``i`` is the (lowest-index) argmax of its unprotected window.
    """
    x = scores.float()
    masked = x if protected is None else x.masked_fill(protected, float("-inf"))
    hub = hub_mask_from_masked(x, masked, kernel_size // 2)
    if protected is not None:
        hub = hub & ~protected
    return hub


def smd_discount(scores: torch.Tensor, hubs: torch.Tensor, gamma: float) -> torch.Tensor:
    """SMD-refined score ``s̃ = M·s + (1 - M)·γ·s`` (Eq. 7), in float32."""
    x = scores.float()
    return torch.where(hubs, x, x * gamma)
