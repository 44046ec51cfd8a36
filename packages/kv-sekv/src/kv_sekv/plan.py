"""The SEKV plan: a :class:`kvcore.Plan` that also carries the segmentation (SEKV §3.1–3.2).

kvcore's tiers are evict / quantized widths / full precision; SEKV adds a lossy low-rank tier for span tokens.
Until kvcore has such a tier, span tokens are marked ``FULL`` in ``key_bits`` (they are kept, not evicted) and
``span_id >= 0`` says that :class:`~kv_sekv.SEKVStore` holds them as a coarse entry plus CPU low-rank bases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcore import Plan

__all__ = ["SpanPlan", "SpanScoresInfo"]


@dataclass(frozen=True)
class SpanScoresInfo:
    """What the scorer passes on to the selector besides the scores: the layer and the head dim."""

    layer: int = 0
    head_dim: int = 0


@dataclass(frozen=True)
class SpanPlan(Plan):
    """A plan with SEKV's segmentation.

    Parameters
    ----------
    span_id : Tensor
        ``[B, T]`` int64: span index of each token within its row (``0 .. n_spans − 1``), ``−1`` for resident
        tokens and padding.
    weights : Tensor
        ``[B, T]`` float32 surprisal weights ``w_t = H_t / Σ_{k∈S} H_k`` of span tokens (Eq. 2), 0 elsewhere.
    layer : int
        Layer index (selects the router's ``W^{(l)}`` and ``τ^{(l)}``).
    alpha, used : Tensor
        ``[B]`` the α applied per row and the persistent part as a fraction of the full cache.
    capacity : Tensor
        ``[B]`` int64 budget in tokens per KV head.
    budget : float
        The budget as a fraction of the full cache (``1 − ratio``); ``1.0`` disables the expansion cap.
    """

    span_id: torch.Tensor = field(default=None)  # type: ignore[assignment]
    weights: torch.Tensor = field(default=None)  # type: ignore[assignment]
    layer: int = 0
    alpha: torch.Tensor | None = None
    used: torch.Tensor | None = None
    capacity: torch.Tensor | None = None
    budget: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        B, _, T = self.key_bits.shape[-3:]
        if not isinstance(self.span_id, torch.Tensor) or tuple(self.span_id.shape) != (B, T):
            raise ValueError(f"span_id must be an int64 tensor [B={B}, T={T}]")
        if not isinstance(self.weights, torch.Tensor) or tuple(self.weights.shape) != (B, T):
            raise ValueError(f"weights must be a float32 tensor [B={B}, T={T}]")

    @property
    def n_spans(self) -> torch.Tensor:
        """``[B]`` spans per row."""
        return self.span_id.max(-1).values.clamp_min(-1) + 1
