"""Score-weighted local coverage objective ``F_sub`` (paper §3.2, Eqs. 4–5; Appendix J.1, Def. 1).

``w_{x,j} = s_j · K(|x - j|) / Z_j``, ``Z_j = Σ_{x∈V} K(|x - j|)`` and
``F_sub(S) = Σ_{x∈V} max_{j∈S} w_{x,j}`` (``F_sub(∅) = 0``). Prop. 1: ``F_sub`` is monotone,
submodular, and ``F_sub({j}) = s_j``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from kvcore.checks import check_int

__all__ = ["CoverageObjective", "gaussian_kernel", "window_kernel"]

Kernel = Callable[[torch.Tensor], torch.Tensor]


def window_kernel(half_width: int) -> Kernel:
    """Window kernel ``K(d) = 1[d <= half_width]`` (the kernel matching HubKV's hub window).

    Parameters
    ----------
    half_width : int
        ``k >= 0``.
    """
    check_int("half_width", half_width, low=0)

    def kernel(d: torch.Tensor) -> torch.Tensor:
        return (d <= half_width).to(torch.float64)

    return kernel


def gaussian_kernel(bandwidth: float) -> Kernel:
    """Gaussian kernel ``K(d) = exp(-d² / (2·bandwidth²))``.

    Parameters
    ----------
    bandwidth : float
        ``> 0``.
    """
    if not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth must be a finite number > 0, got {bandwidth!r}")

    def kernel(d: torch.Tensor) -> torch.Tensor:
        d = d.to(torch.float64)
        return torch.exp(-(d * d) / (2.0 * bandwidth * bandwidth))

    return kernel


class CoverageObjective:
    """The facility-location objective ``F_sub`` of Eq. 4 over one score sequence.

    Parameters
    ----------
    scores : torch.Tensor or sequence of float
        1-D non-negative finite scores ``s_1..s_N``.
    kernel : callable, optional
        Non-negative distance kernel ``K`` applied to an int64 tensor of distances; ``K(0)``
        must be ``> 0``. Default :func:`window_kernel` ``(2)`` (HubKV's default window).

    Attributes
    ----------
    weights : torch.Tensor
        ``[N, N]`` float64 matrix, ``weights[x, j] = w_{x,j}``.
    """

    def __init__(self, scores, kernel: Kernel | None = None) -> None:
        s = torch.as_tensor(scores, dtype=torch.float64).detach().cpu()
        if s.dim() != 1:
            raise ValueError(f"scores must be 1-D, got shape {tuple(s.shape)}")
        if not bool(torch.isfinite(s).all()):
            raise ValueError("scores must be finite")
        if bool((s < 0).any()):
            raise ValueError("scores must be >= 0 (F_sub uses importance-weighted coverage)")
        kernel = window_kernel(2) if kernel is None else kernel
        n = s.numel()
        idx = torch.arange(n)
        dist = (idx[:, None] - idx[None, :]).abs()
        kmat = torch.as_tensor(kernel(dist), dtype=torch.float64)
        if kmat.shape != (n, n) or not bool(torch.isfinite(kmat).all()) or bool((kmat < 0).any()):
            raise ValueError("kernel must map distances to finite non-negative values")
        if n and not bool((kmat.diagonal() > 0).all()):
            raise ValueError("kernel must satisfy K(0) > 0 so that Z_j > 0")
        z = kmat.sum(0)  # Z_j = Σ_x K(|x - j|)
        self.scores = s
        self.weights = s[None, :] * kmat / z[None, :]

    @property
    def n(self) -> int:
        """Number of tokens ``N``."""
        return self.scores.numel()

    def _cover(self, subset: Iterable[int]) -> torch.Tensor:
        idx = sorted(set(int(j) for j in subset))
        for j in idx:
            if not 0 <= j < self.n:
                raise ValueError(f"index {j} outside [0, {self.n})")
        if not idx:
            return torch.zeros(self.n, dtype=torch.float64)
        return self.weights[:, idx].amax(dim=1)

    def value(self, subset: Iterable[int]) -> float:
        """``F_sub(S) = Σ_x max_{j∈S} w_{x,j}`` (0 for the empty set)."""
        return float(self._cover(subset).sum())

    def gain(self, k: int, subset: Iterable[int]) -> float:
        """Marginal gain ``Δ(k | S) = Σ_x max(0, w_{x,k} - max_{j∈S} w_{x,j})`` (§3.2)."""
        cover = self._cover(subset)
        if not 0 <= int(k) < self.n:
            raise ValueError(f"index {k} outside [0, {self.n})")
        return float((self.weights[:, int(k)] - cover).clamp(min=0).sum())

    def overlap_ratio(self, i: int, h: int) -> float:
        """``ρ(i, h) = (1/s_i) Σ_x min(w_{x,i}, w_{x,h})`` of Prop. 2 (requires ``s_i > 0``)."""
        s_i = float(self.scores[i])
        if s_i <= 0:
            raise ValueError(f"overlap_ratio needs s_i > 0, got s_{i} = {s_i}")
        return float(torch.minimum(self.weights[:, i], self.weights[:, h]).sum()) / s_i
