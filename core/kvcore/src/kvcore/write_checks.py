"""Checks every ``Store.write`` of a tiered store shares: the plan is laid out like the keys, holds no element-level
mask the store cannot keep, uses only the tiers the store holds and -- for stores that hold a token's key and value
together -- keeps the same entries on both sides. The ``retier`` counterpart is :mod:`kvcore.retier_checks`."""

from __future__ import annotations

from collections.abc import Set

import torch

from kvcore.plan import EVICT, Plan

__all__ = ["check_write_plan"]


def check_write_plan(
    plan: object,
    shape: tuple[int, int, int],
    device: torch.device,
    store: str,
    *,
    key_tiers: Set[int],
    value_tiers: Set[int] | None = None,
    same_kept: bool = False,
    full_precision_note: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the ``plan`` given to ``write``; ``(key_bits, value_bits)`` on ``device``.

    Parameters
    ----------
    plan : kvcore.Plan
        The plan given to ``write``.
    shape : tuple of int
        ``(B, H, T)`` of the keys written.
    device : torch.device
        Where the store builds its content (the keys' device).
    store : str
        The store's name, for the messages.
    key_tiers, value_tiers : set of int
        The tiers (``EVICT``, bit widths, ``FULL``) the store holds for keys and for values (``value_tiers`` None:
        the same as the keys').
    same_kept : bool
        Keys and values must keep the same entries (stores that hold a token's key and value together).
    full_precision_note : str
        Appended to the message refusing ``plan.full_precision`` (say where the store's own mask comes from).

    Raises
    ------
    ValueError
        Naming what is wrong: not a plan or another layout, ``plan.full_precision``, a tier the store does not hold,
        different kept entries.
    """
    B, H, T = shape
    if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != (B, H, T):
        raise ValueError(f"plan must be a kvcore.Plan of shape [B={B}, H={H}, T={T}]")
    if plan.full_precision is not None:
        raise ValueError(
            f"{store} does not hold element-level full-precision masks (plan.full_precision){full_precision_note}"
        )
    kb, vb = plan.key_bits.to(device), plan.bits_for_values.to(device)
    value_tiers = key_tiers if value_tiers is None else value_tiers
    for name, bits, allowed in (("key_bits", kb, key_tiers), ("value_bits", vb, value_tiers)):
        bad = set(torch.unique(bits).tolist()) - set(allowed)
        if bad:
            raise ValueError(f"plan.{name} uses tiers {sorted(bad)}; this {store} holds {sorted(allowed)}")
    if same_kept and not torch.equal(kb != EVICT, vb != EVICT):
        raise ValueError(f"{store} needs the same kept entries for keys and values (tiers may differ)")
    return kb, vb
