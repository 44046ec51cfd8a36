"""Shared preparation and ranking for the reference selectors."""

from __future__ import annotations

import torch

from kvcore.checks import check_bool_mask, check_finite
from kvcore.scores import Scores
from kvcore.transfer import from_host


def prepare(
    scores: torch.Tensor, protected: torch.Tensor | None, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten to ``[B, G, T]`` (G = heads, or layers x heads for ``[L, B, H, T]`` scores).

    Returns the ranking key (protected ``+inf``, padding ``-inf``), the protected and valid masks (``[B, G, T]``)
    and the number of valid tokens per batch row ``[B]``.
    """
    check_finite("scores", scores)
    lead = scores.shape[:-3]  # () or (L,)
    B, H, T = scores.shape[-3:]
    if T == 0:
        raise ValueError("scores must cover at least one token (T == 0)")

    def as_bhT(name: str, mask: torch.Tensor | None, default: bool) -> torch.Tensor:
        if mask is None:
            return torch.full((B, H, T), default, dtype=torch.bool, device=scores.device)
        if mask.ndim == 2:
            mask = mask[:, None, :]
        return check_bool_mask(name, mask, (B, H, T))

    valid_m = as_bhT("valid", valid, True)
    prot = as_bhT("protected", protected, False) & valid_m
    if lead:
        L = lead[0]
        flat = scores.permute(1, 0, 2, 3).reshape(B, L * H, T)
        valid_m = valid_m.repeat(1, L, 1)
        prot = prot.repeat(1, L, 1)
    else:
        flat = scores
    key = flat.float().masked_fill(prot, float("inf")).masked_fill(~valid_m, float("-inf"))
    n_valid = valid_m[:, 0, :].sum(-1)
    return key, prot, valid_m, n_valid


def unflatten(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of the ``[L, B, H, T] -> [B, L*H, T]`` flattening of :func:`prepare`."""
    if len(shape) == 3:
        return x
    L, B, H, T = shape
    return x.reshape(B, L, H, T).permute(1, 0, 2, 3)


def stable_rank(key: torch.Tensor) -> torch.Tensor:
    """Rank of every entry along the last dim, descending, ties broken by lower index (rank 0 = best)."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))
    return rank


def kept_per_row(budget, n_valid: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``([B] tensor, the same as a list)``: entries kept per head, per batch row, from the budget and the valid
    counts (one host read of the counts; the budget is a Python rule)."""
    kept = [budget.kept(int(n)) for n in n_valid.tolist()]
    return from_host(kept, n_valid.device, dtype=torch.long), kept


def check_protected_fit(prot: torch.Tensor, capacity: torch.Tensor, what: str) -> None:
    """Raise if protected entries exceed the budget (``capacity`` broadcasts against ``prot.sum(-1)``)."""
    count = prot.sum(-1)
    over = count > capacity
    if bool(over.any()):
        raise ValueError(
            f"budget below the protected count: {what} keeps {int(capacity.min())} entries but "
            f"{int(count.max())} are protected; lower the ratio or the protected window"
        )


def as_scores(scores: object) -> Scores:
    if not isinstance(scores, Scores):
        raise TypeError(f"scores must be a kvcore.Scores, got {type(scores).__name__}")
    return scores
