"""PyTorch reference of SEKV's routing gate (SEKV §3.3, Eqs. 4–5 and 9), the CPU path of
:func:`~kv_sekv.kernels.dispatch.routing_priority`.

For each decode query ``q`` of query head ``h`` the router projects ``q̃ = W^{(h)} q`` (Eq. 4) and scores every span
``S`` of its KV head by the gate ``z = σ(q̃ · K̄_S^{(h)} / √d′ + log|S|)`` (Eq. 5, ``K̄_S^{(h)}`` the unit routing
summary of Eq. 3); the span is selected when ``z > τ_h`` (Eq. 9). Stage 2 needs, per KV head and span, whether any
of the head's query heads (and queries) selects it and how strongly — the budget cap expands spans in descending
gate order — so the result is that largest selecting gate, ``-1`` where none selects or the span is gone.
"""

from __future__ import annotations

import math

import torch

__all__ = ["routing_priority_torch"]


def routing_priority_torch(
    query: torch.Tensor,
    W: torch.Tensor,
    tau: torch.Tensor,
    summary: torch.Tensor,
    length: torch.Tensor,
    alive: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest selecting gate per KV head and span (module doc), float32.

    Parameters
    ----------
    query : Tensor
        ``[B, Hq, Q, D]`` decode queries.
    W : Tensor
        ``[Hq, d′, D]`` routing projections of the layer (Eq. 4).
    tau : Tensor
        ``[Hq]`` zoom thresholds (Eq. 9).
    summary : Tensor
        ``[B, Hq, M, d′]`` unit routing summaries (Eq. 3).
    length : Tensor
        ``[B, M]`` integer span lengths (``0`` on padding; ``log|S|`` uses ``max(|S|, 1)``).
    alive : Tensor
        ``[B, Hkv, M]`` bool: the span is held in that KV head.

    Returns
    -------
    (priority, coarse_bias)
        ``[B, Hkv, M]`` float32 each. ``priority``: ``max`` over the KV head's query heads and queries of the gates
        above their threshold on an alive span, ``-1`` where there is none (a gate lies in ``(0, 1)``).
        ``coarse_bias``: Stage 1's logit bias of the spans' coarse entries, ``log max(|S|, 1)`` where the span is
        alive, ``-inf`` elsewhere (the kernel has ``log|S|`` and liveness at hand: one more store, no launch).
    """
    B, Hq, Q, _D = query.shape
    H, M = alive.shape[1], alive.shape[2]
    g = Hq // H
    qp = torch.einsum("hed,bhqd->bhqe", W.float(), query.float())  # Eq. 4
    logits = qp @ summary.float().transpose(-1, -2) / math.sqrt(W.shape[1])  # [B, Hq, Q, M]
    loglen = torch.log(length.clamp_min(1).float())  # [B, M]
    gate = torch.sigmoid(logits + loglen[:, None, None, :])  # Eq. 5
    selected = (gate > tau.float()[None, :, None, None]) & alive.repeat_interleave(g, 1)[:, :, None, :]  # Eq. 9
    priority = torch.where(selected, gate, -1.0).reshape(B, H, g * Q, M).amax(2)
    return priority, torch.where(alive, loglen[:, None, :], float("-inf"))
