"""Tiered selection: every entry gets a bit width, by shares or by an average-bits budget (HqeKV §3.3, Eq. 3)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvcore.budget import Budget
from kvcore.checks import check_int, check_number
from kvcore.plan import EVICT, TIERS, Plan
from kvcore.scores import Scores
from kvcore.selectors._ranking import as_scores, check_protected_fit, prepare, stable_rank, unflatten


def solve_shares(tiers: tuple[int, ...], avg_bits: float, fixed: Mapping[int, float] | None = None) -> dict[int, float]:
    """Shares of ``tiers`` meeting ``sum(share) = 1`` and ``sum(bits * share) = avg_bits`` (HqeKV Eq. 3).

    All tiers but two must have a share in ``fixed`` (HqeKV fixes the 1-bit and evict shares and solves the
    4- and 2-bit ones, Appendix Alg. 1). With no ``fixed`` shares, the two tiers adjacent to ``avg_bits``
    take everything (the least spread solution).
    """
    tiers = tuple(sorted(set(tiers), reverse=True))
    fixed = dict(fixed or {})
    if not fixed:
        above = [b for b in tiers if b >= avg_bits]
        below = [b for b in tiers if b < avg_bits]
        if not above or not below:
            if avg_bits in tiers:
                return {b: float(b == avg_bits) for b in tiers}
            raise ValueError(f"avg_bits={avg_bits} is outside the range of tiers {tiers}")
        hi, lo = min(above), max(below)
        fixed = {b: 0.0 for b in tiers if b not in (hi, lo)}
    free = [b for b in tiers if b not in fixed]
    if len(free) != 2 or set(fixed) - set(tiers):
        raise ValueError(f"shares must fix all tiers but two of {tiers}, got {sorted(fixed)}")
    hi, lo = free
    rest = 1.0 - sum(fixed.values())
    bits_rest = avg_bits - sum(b * s for b, s in fixed.items())
    s_hi = (bits_rest - lo * rest) / (hi - lo)
    shares = {**fixed, hi: s_hi, lo: rest - s_hi}
    if any(s < -1e-9 or s > 1 + 1e-9 for s in shares.values()):
        raise ValueError(f"avg_bits={avg_bits} is unreachable with tiers {tiers} and fixed shares; solved {shares}")
    return {b: min(max(s, 0.0), 1.0) for b, s in shares.items()}


def tier_counts(shares: Mapping[int, float], n: int) -> list[tuple[int, int]]:
    """Integer counts per tier (highest bits first) by cumulative floors.

    The resulting average never exceeds ``sum(bits * share)`` and falls short of it by less than
    ``max(bits) / n``.
    """
    out, prev, cum = [], 0, 0.0
    ordered = sorted(shares.items(), reverse=True)
    for i, (bits, share) in enumerate(ordered):
        cum += share
        c = n if i == len(ordered) - 1 else min(n, math.floor(n * cum + 1e-9))
        out.append((bits, c - prev))
        prev = c
    return out


@dataclass(frozen=True)
class TieredSelector:
    """Assign bit widths by score rank: the best ``share[b_1]`` of each head get the highest width, and so on.

    Parameters
    ----------
    tiers : tuple of int
        Available widths, e.g. ``(4, 2, 1, 0)`` for HqeKV (0 = evict, 16 = full precision).
    shares : mapping of int to float
        Share of entries per width. Complete (summing to 1) when the budget has no ``avg_bits``; with
        ``budget.avg_bits`` it fixes all tiers but two (or is empty) and the rest is solved from Eq. 3.

    Protected entries take the highest tier and count inside its share. Under ``"layer"`` granularity the
    ranking runs over all heads of the layer; under ``"head"`` per head. ``plan_bits`` (:class:`kvcore.PlanBits`)
    is ``tiers`` plus ``EVICT`` (padding).
    """

    tiers: tuple[int, ...] = (4, 2, 1, 0)
    shares: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, (tuple, list)) or not self.tiers:
            raise TypeError(f"tiers must be a non-empty tuple of bit widths, got {self.tiers!r}")
        for b in self.tiers:
            check_int("tiers (widths: 0 = evict, 16 = full)", b, choices=TIERS)
        for b, s in dict(self.shares).items():
            check_number(f"shares[{b}]", s, low=0.0, high=1.0)
        if set(self.shares) - set(self.tiers):
            raise ValueError(f"shares name widths {sorted(set(self.shares) - set(self.tiers))} not in tiers")

    @property
    def plan_bits(self) -> frozenset[int]:
        """The tiers a plan may hold: ``tiers`` and ``EVICT`` (padding is never kept)."""
        return frozenset({EVICT, *self.tiers})

    def resolve_shares(self, budget: Budget) -> dict[int, float]:
        """The complete shares this selector uses under ``budget``."""
        if budget.avg_bits is not None:
            return solve_shares(self.tiers, float(budget.avg_bits), self.shares)
        if budget.tokens is not None or (budget.ratio or 0.0) > 0.0:
            raise ValueError(
                f"TieredSelector is budgeted by its shares or by budget.avg_bits, not by {budget}: put the evicted "
                "fraction in shares[0] (or wrap an evicting selector)"
            )
        shares = {b: float(self.shares.get(b, 0.0)) for b in self.tiers}
        if abs(sum(shares.values()) - 1.0) > 1e-6:
            raise ValueError(f"shares must sum to 1 without budget.avg_bits, got {sum(shares.values())}")
        return shares

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        scores = as_scores(scores)
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a kvcore.Budget, got {type(budget).__name__}")
        if budget.granularity == "global" or scores.keys.ndim != 3:
            raise ValueError("TieredSelector supports granularity 'head' or 'layer' on [B, H, T] scores")
        shares = self.resolve_shares(budget)
        kb = self._bits(scores.keys, budget, shares, protected, valid)
        vb = None if scores.values is None else self._bits(scores.values, budget, shares, protected, valid)
        return Plan(kb, vb)

    def _bits(self, s, budget, shares, protected, valid) -> torch.Tensor:
        key, prot, valid_m, n_valid = prepare(s, protected, valid)
        B, H, _T = key.shape
        per_layer = budget.granularity == "layer"
        rank = stable_rank(key.flatten(1)).view_as(key) if per_layer else stable_rank(key)
        bits = torch.full_like(key, EVICT, dtype=torch.uint8)
        for b in range(B):
            n = int(n_valid[b]) * (H if per_layer else 1)
            counts = tier_counts(shares, n)
            top = counts[0][1]
            check_protected_fit(prot[b].flatten() if per_layer else prot[b], torch.tensor(top), "the top tier")
            start = 0
            for width, c in counts:
                sel = (rank[b] >= start) & (rank[b] < start + c)
                bits[b][sel] = width
                start += c
        return unflatten(bits.masked_fill(~valid_m, EVICT), s.shape)
