"""Widths assigned by share: the optional ``TierShares`` capability of a :class:`kvcore.Selector`.

A tiered selector (HqeKV's Eq. 3 budget: ``sum(share) = 1``, ``sum(bits * share) = avg_bits``) declares the widths
it assigns as a ``tiers`` attribute and says which share of the entries each width takes under a budget with
``resolve_shares(budget)``. The conformance suites read the declaration through :func:`tier_shares` (the range of
feasible ``avg_bits``, the expected count per width), which refuses a selector that declares ``tiers`` without
``resolve_shares``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvcore.budget import Budget
from kvcore.plan import TIERS

__all__ = ["TierShares", "tier_shares"]


@runtime_checkable
class TierShares(Protocol):
    """A selector that assigns bit widths by share (optional capability of a :class:`kvcore.Selector`).

    Attributes
    ----------
    tiers : tuple of int
        The widths its plans assign, the declaration (``EVICT = 0``, ``FULL = 16``, quantized widths 1-8; e.g.
        ``(4, 2, 1, 0)``); non-empty.
    """

    tiers: tuple[int, ...]

    def resolve_shares(self, budget: Budget) -> dict[int, float]:
        """The share of entries each width takes under ``budget``.

        Parameters
        ----------
        budget : kvcore.Budget
            A budget the selector is budgeted by (``avg_bits``, or its own shares).

        Returns
        -------
        dict of int to float
            Width (a member of ``tiers``) to its share in [0, 1]; the shares of the widths a plan counts by share.

        Raises
        ------
        ValueError
            A budget the selector is not budgeted by (a ratio or token budget), or an unreachable ``avg_bits``.
        """
        ...


@runtime_checkable
class _DeclaresTiers(Protocol):
    """The declaration alone: what :func:`tier_shares` checks before the method."""

    tiers: tuple[int, ...]


def tier_shares(selector: object) -> TierShares | None:
    """``selector`` as a :class:`TierShares` when it declares ``tiers``; ``None`` when it declares none.

    Parameters
    ----------
    selector : kvcore.Selector
        The selector a suite tests (or an adapter reads).

    Returns
    -------
    TierShares or None
        ``selector`` itself when it declares ``tiers`` and implements ``resolve_shares``.

    Raises
    ------
    TypeError
        ``tiers`` is declared but is not a non-empty tuple of widths in ``{0, 1-8, 16}``, or ``resolve_shares`` is
        missing (a declared capability that the suites and callers would fail on later).

    Examples
    --------
    >>> import kvcore
    >>> tier_shares(kvcore.TieredSelector(tiers=(4, 2, 0))).tiers
    (4, 2, 0)
    >>> tier_shares(kvcore.TopKSelector()) is None
    True
    """
    if not isinstance(selector, _DeclaresTiers):
        return None
    name, tiers = type(selector).__name__, selector.tiers
    if (
        not isinstance(tiers, (tuple, list))
        or not tiers
        or not all(type(b) is int and b in TIERS for b in tiers)  # bool is not a width
    ):
        raise TypeError(f"{name} declares tiers={tiers!r}; it must be a non-empty tuple of widths in {{0, 1-8, 16}}")
    if not isinstance(selector, TierShares) or not callable(selector.resolve_shares):
        raise TypeError(
            f"{name} declares tiers {tiers} but has no resolve_shares(budget) method: implement kvcore.TierShares "
            "(the share of entries per width under a budget) or do not declare tiers"
        )
    return selector
