"""The score given to protected tokens (paper Eq. 13, Appendix A.1).

The paper sets ``z = 1`` for protected tokens "so that sink and recent-window tokens remain
available to the underlying pruning rule", assuming ``s ∈ [0, 1]``. But the head weight
``β ≤ β_max = 1.2`` lets an unprotected hub reach ``z = (1 - λ + λβ)·s > 1`` even for
``s ≤ 1``, and scores from other scorers may exceed 1. To keep the paper's intent (protected tokens
rank first under any pruning granularity) we use::

    P = 1                        if every unprotected z of the call is < 1
    P = nextafter(max z, +inf)   otherwise (the smallest float32 strictly above every z)

``P`` is one scalar for the whole ``refine`` call, so it dominates under head, layer and global
pruning of that tensor. kvcore Selectors also receive the protected mask and keep those tokens
regardless; ``P`` matters only for consumers that look at the scores alone.
"""

from __future__ import annotations

import torch

__all__ = ["retention_ceiling"]


def retention_ceiling(max_unprotected: torch.Tensor) -> torch.Tensor:
    """Protected-token score ``P`` from the maximum unprotected refined score.

    Parameters
    ----------
    max_unprotected : torch.Tensor
        0-d (or any-shape, reduced with ``max``) float32 tensor; ``-inf`` when nothing is
        unprotected.

    Returns
    -------
    torch.Tensor
        0-d float32 tensor on the same device (no host synchronisation).
    """
    m = (
        max_unprotected.float().max()
        if max_unprotected.numel()
        else torch.full((), float("-inf"), device=max_unprotected.device)
    )
    one = torch.ones((), dtype=torch.float32, device=m.device)
    above = torch.nextafter(m, torch.full_like(m, float("inf")))
    return torch.where(m >= 1.0, above, one)
