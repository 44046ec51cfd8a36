"""A query-free token importance for page codecs that keep some tokens at higher precision."""

from __future__ import annotations

import torch


def sink_score(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Query-free importance of each token of a page ``[T, H, D]``: float32 ``[T]``, summed over the KV heads.

    ``s_t = Σ_h ‖k_{t,h} - k̄_h‖ / ‖v_{t,h}‖`` with ``k̄_h`` the page's mean key of head ``h``. Tokens that draw
    much attention (attention sinks, delimiters) have keys far from the others and small values ("value drains").
    A page codec sees no queries, so a method whose importance is attention-based (HEX §3.3's accumulated
    attention, HqeKV §3.2's window attention) ranks a page's tokens by this instead; on SmolLM2-135M it picks the
    token of highest accumulated attention in a 64-token page more often than the key norm, the value norm or the
    key deviation alone (docs/results/2026-11-29-method-codecs.md in the repository).

    Parameters
    ----------
    keys, values : Tensor
        ``[T, H, D]`` of one page (the layout every :class:`~kvpages.PageCodec` encodes).
    """
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError("keys and values must be tensors")
    if keys.ndim != 3 or values.shape[:2] != keys.shape[:2]:
        raise ValueError(
            f"keys and values must be [T, H, D] pages of the same tokens and heads, got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    k, v = keys.float(), values.float()
    dev = (k - k.mean(0, keepdim=True)).norm(dim=-1)
    return (dev / v.norm(dim=-1).clamp_min(1e-12)).sum(-1)
