"""Low-rank span bases and gated reconstruction (SEKV §3.2, Eqs. 6–8, 14; Eqs. 18–19 for the bytes).

Each span's key matrix ``K_S ∈ R^{|S|×d_h}`` (and, separately, its value matrix) is decomposed by a truncated SVD
``K_S ≈ Σ_{i≤R} σ_i u_i v_iᵀ`` with ``R = min(|S|, d_h, R_max)`` (Eq. 6); gates ``m_i ∈ (0, 1)`` from the router
scale the components (Eq. 8: ``K̂_S = Σ m_i σ_i u_i v_iᵀ``). At deployment components with ``m_i < ε`` are dropped
and ``m`` is folded into ``σ``; the factors ``U (|S|×r), σ (r), V (d_h×r)`` take ``r(|S| + d_h + 1)`` values
against ``|S|·d_h`` raw, so a span whose factors would be larger is held raw (exact) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SpanBasis", "factored_size", "reconstruction_error", "truncated_svd"]


def truncated_svd(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-``min(L, D, rank)`` SVD of ``x`` ``[..., L, D]`` in float32: ``(U [.., L, R], σ [.., R], Vᵀ [.., R, D])``.

    Exact (``torch.linalg.svd``); Eq. 6 allows a randomized SVD, which pays only for spans far longer than the rank.
    """
    U, s, Vh = torch.linalg.svd(x.float(), full_matrices=False)
    R = min(rank, s.shape[-1])
    return U[..., :R], s[..., :R], Vh[..., :R, :]


def reconstruction_error(sigma: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Eq. 14: ``E(m, σ) = Σ_i (1 − m_i)² σ_i²`` over the last axis."""
    return ((1.0 - gates) ** 2 * sigma**2).sum(-1)


def factored_size(length: int, head_dim: int, rank: int) -> int:
    """Values held by rank-``rank`` factors of a ``length × head_dim`` span: ``r(|S| + d_h + 1)`` (Eq. 18)."""
    return rank * (length + head_dim + 1)


@dataclass
class SpanBasis:
    """One span's keys or values for every KV head: raw ``[Hkv, L, D]`` or gated factors.

    Attributes
    ----------
    raw : Tensor or None
        ``[Hkv, L, D]`` when the factors would not be smaller.
    U, sigma, Vh : Tensor or None
        ``[Hkv, L, r]``, ``[Hkv, r]`` (gates folded in; dropped components are 0), ``[Hkv, r, D]``.
    """

    raw: torch.Tensor | None = None
    U: torch.Tensor | None = None
    sigma: torch.Tensor | None = None
    Vh: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        x: torch.Tensor,
        U: torch.Tensor,
        sigma: torch.Tensor,
        Vh: torch.Tensor,
        gates: torch.Tensor,
        eps: float,
        device: torch.device | str,
    ) -> SpanBasis:
        """Drop components with gate ``< eps``, fold the gates into ``σ`` and keep the smaller of factors and raw.

        ``x`` ``[Hkv, L, D]`` is the span (kept raw if the factors are not smaller); ``U, σ, Vh, gates`` come from
        :func:`truncated_svd` and the router. The result is stored in ``x.dtype`` on ``device`` (pinned if CUDA).
        """
        H, L, D = x.shape
        keep = gates >= eps
        r = int(keep.sum(-1).max()) if keep.numel() else 0
        if factored_size(L, D, r) >= L * D:
            return cls(raw=_place(x.clone(), device))
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :r]  # kept components first
        s = (sigma * gates * keep).gather(-1, order)
        Uk = U.gather(-1, order[:, None, :].expand(H, L, r))
        Vk = Vh.gather(-2, order[:, :, None].expand(H, r, D))
        dt = x.dtype
        return cls(U=_place(Uk.to(dt), device), sigma=_place(s.to(dt), device), Vh=_place(Vk.to(dt), device))

    @property
    def rank(self) -> int:
        """Components held (``-1`` for a raw span)."""
        return -1 if self.raw is not None else int(self.sigma.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.raw, self.U, self.sigma, self.Vh) if t is not None]

    def reconstruct(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``K̂_S`` ``[Hkv, L, D]`` float32 (Eq. 8) on ``device``."""
        if self.raw is not None:
            return self.raw.to(device, non_blocking=True).float()
        U, s, Vh = (t.to(device, non_blocking=True).float() for t in (self.U, self.sigma, self.Vh))
        return (U * s[:, None, :]) @ Vh

    def to(self, device: torch.device | str) -> SpanBasis:
        """A copy on ``device`` (the fetch of §3.3)."""
        return SpanBasis(
            *(None if t is None else t.to(device, non_blocking=True) for t in (self.raw, self.U, self.sigma, self.Vh))
        )

    def select(self, rows: torch.Tensor) -> SpanBasis:
        """The basis restricted to the KV heads ``rows``."""
        return SpanBasis(*(None if t is None else t[rows] for t in (self.raw, self.U, self.sigma, self.Vh)))


def _place(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    t = t.to(device).contiguous()
    if t.device.type == "cpu" and torch.cuda.is_available():
        t = t.pin_memory()
    return t
