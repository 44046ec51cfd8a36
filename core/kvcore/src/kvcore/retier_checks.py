"""Checks every ``Store.retier`` implementation shares: the plan is laid out like the store's ``tiers()``, holds no
element-level mask the store cannot keep, keeps no padding and — for stores that re-tier by eviction only — moves no
held entry to another tier."""

from __future__ import annotations

import torch

from kvcore.plan import EVICT, Plan

__all__ = ["check_retier_plan"]


def check_retier_plan(
    plan: object, held: Plan, store: str, *, eviction_only: bool, same_kept: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``plan`` against ``held`` (the store's ``tiers()``); ``(key_bits, value_bits)`` on held's device.

    Parameters
    ----------
    plan : kvcore.Plan
        The plan given to ``retier``.
    held : kvcore.Plan
        ``store.tiers()``: what the store holds, laid out like ``read()`` (padding is ``EVICT``).
    store : str
        The store's name, for the messages.
    eviction_only : bool
        Every entry must be ``EVICT`` or its held tier (stores without ``can_demote``).
    same_kept : bool
        Keys and values must keep the same entries (stores that hold a token's key and value together).

    Raises
    ------
    ValueError
        Naming what is wrong: layout, ``plan.full_precision``, kept padding, a tier change, different kept sets.
    """
    if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != tuple(held.key_bits.shape):
        raise ValueError(f"plan must be a kvcore.Plan laid out like read(): shape {tuple(held.key_bits.shape)}")
    if plan.full_precision is not None:
        raise ValueError(f"{store} does not hold element-level full-precision masks (plan.full_precision)")
    device = held.key_bits.device
    kb, vb = plan.key_bits.to(device), plan.bits_for_values.to(device)
    for name, new, old in (("key_bits", kb, held.key_bits), ("value_bits", vb, held.bits_for_values)):
        padding = old == EVICT
        if bool((padding & (new != EVICT)).any()):
            raise ValueError(
                f"plan.{name} keeps entries the store does not hold (padding, positions -1 in read(), or a value "
                "already evicted); they must be EVICT"
            )
        if eviction_only:
            changed = ~padding & (new != EVICT) & (new != old)
            if bool(changed.any()):
                raise ValueError(
                    f"plan.{name} moves held entries to another tier ({sorted(set(new[changed].tolist()))}); "
                    f"{store} re-tiers by eviction only (each entry EVICT or its held tier, see tiers())"
                )
    if same_kept and not torch.equal(kb != EVICT, vb != EVICT):
        raise ValueError(f"plan must keep the same entries for keys and values in a {store} (tiers may differ)")
    return kb, vb
