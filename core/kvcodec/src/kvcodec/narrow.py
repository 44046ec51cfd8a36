"""The narrowest integer dtype for stored metadata (true positions, counts, segment ids).

Positions are a few percent of a low-bit code row, so stores keep them in int16 while every value fits and widen
to int32 for good when one does not. Compare a narrowed tensor with a Python int only after ``.int()``: torch
wraps an out-of-range Python int to the tensor's dtype before comparing (``int16 < 40000`` is ``False``).
"""

from __future__ import annotations

import torch

from kvcore.checks import values_checked

__all__ = ["narrow", "narrow_int", "narrow_positions"]


def narrow_int(max_value: int) -> torch.dtype:
    """The narrowest signed integer dtype holding ``[-1, max_value]``."""
    for dtype in (torch.int16, torch.int32):
        if max_value <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def narrow(values: torch.Tensor, *held: torch.Tensor | None) -> torch.Tensor:
    """``values`` (non-negative integers, or ``-1``) in the narrowest dtype that holds them and is no narrower than
    any ``held`` tensor they will be stored beside (a store never narrows what it already widened)."""
    dtype = narrow_int(int(values.max()) if values.numel() else 0)
    for t in held:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return values.to(dtype)


def narrow_positions(
    positions: torch.Tensor, *held: torch.Tensor | None, like: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`narrow` where the per-step value checks run for ``like``'s device (``positions``' by default;
    :func:`kvcore.checks.values_checked`); elsewhere (accelerators by default) the positions are not read, which
    would be a host sync, and are held in int32 or wider: int32 holds every position a store takes
    (``kvcore.checks.MAX_POSITION``)."""
    if values_checked(positions if like is None else like):
        return narrow(positions, *held)
    dtype = torch.int32
    for t in held:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return positions.to(dtype)
